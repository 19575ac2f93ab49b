"""The access log (docs/server.md "Access log"): one line per request when its answer ends, with the
method, path, status, latency and request id; X-Request-Id taken from the client and, with
--enable-request-id-headers, echoed back."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from sparrow_server import API_KEY, MODEL_NAME, wait_until

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# address method path status latency id [(client gone)]
LINE = re.compile(r"^(\S+) (\S+) (\S+) (\d{3}|-) (\d+\.\dms|-) (\S+)( \(client gone\))?$")


@pytest.fixture(scope="module")
def logged(start_server):
    return start_server("--api-key", API_KEY, "--enable-request-id-headers", log_requests=True)


def log_lines(server, path: str) -> list[re.Match]:
    return [m for line in server.stderr if (m := LINE.match(line.rstrip("\n"))) and m.group(3) == path]


def wait_for_line(server, path: str, id_: str) -> re.Match:
    found = wait_until(lambda: next((m for m in log_lines(server, path) if m.group(6) == id_), None), timeout_s=10)
    assert found, f"no access-log line for {path} {id_}:\n" + "".join(server.stderr[-20:])
    return found


def test_client_request_id_is_logged_and_echoed(logged):
    response = httpx.get(logged.url + "/v1/models", headers={**HEADERS, "X-Request-Id": "my-id-1"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-id-1"
    line = wait_for_line(logged, "/v1/models", "my-id-1")
    assert line.group(1) == "127.0.0.1" and line.group(2) == "GET" and line.group(4) == "200"
    assert line.group(5).endswith("ms") and line.group(7) is None


def test_generated_request_id_when_none_or_unusable(logged):
    for headers in (HEADERS, {**HEADERS, "X-Request-Id": "two words"}, {**HEADERS, "X-Request-Id": "x" * 129}):
        response = httpx.get(logged.url + "/v1/models", headers=headers)
        id_ = response.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", id_), id_
        wait_for_line(logged, "/v1/models", id_)


def test_errors_are_logged_with_their_status(logged):
    response = httpx.get(logged.url + "/no/such/path", headers={"X-Request-Id": "missing-1"})
    assert response.status_code == 404
    assert wait_for_line(logged, "/no/such/path", "missing-1").group(4) == "404"
    response = httpx.get(logged.url + "/v1/models", headers={"X-Request-Id": "no-key-1"})
    assert response.status_code == 401
    assert wait_for_line(logged, "/v1/models", "no-key-1").group(4) == "401"


def test_completion_logged_by_its_response_id(logged):
    client = logged.client()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.id.startswith("chatcmpl-")
    assert wait_for_line(logged, "/v1/chat/completions", chat.id).group(4) == "200"
    text = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=0)
    assert text.id.startswith("cmpl-")
    wait_for_line(logged, "/v1/completions", text.id)


def test_client_request_id_is_the_completions_base(logged):
    # vLLM: the X-Request-Id header is the base of the response id, before the body's request_id.
    chat = logged.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        extra_headers={"X-Request-Id": "abc-123"}, extra_body={"request_id": "from-body"})
    assert chat.id == "chatcmpl-abc-123"
    wait_for_line(logged, "/v1/chat/completions", "chatcmpl-abc-123")


def test_stream_latency_runs_to_the_last_byte(logged):
    # 64 choices of 250 tokens (a second or so): the line is written after the last byte, so its latency
    # covers at least the span between the first and last bytes the client received, not the head alone.
    body = {"model": MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 250, "n": 64, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.monotonic()
    with httpx.stream("POST", logged.url + "/v1/completions", headers={**HEADERS, "X-Request-Id": "long-1"},
                      json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        first_byte = time.monotonic()
        rest = list(lines)
    last_byte = time.monotonic()
    assert rest[-2] == "data: [DONE]" or rest[-1] == "data: [DONE]"
    latency = float(wait_for_line(logged, "/v1/completions", "cmpl-long-1").group(5)[:-2])
    span_ms, elapsed_ms = (last_byte - first_byte) * 1000, (last_byte - start) * 1000
    assert span_ms > 200, span_ms  # the stream took long enough for the comparison to mean something
    assert 0.9 * span_ms <= latency <= elapsed_ms + 1, (latency, span_ms, elapsed_ms)


def test_client_gone_mid_stream(logged):
    with httpx.stream("POST", logged.url + "/v1/completions", headers={**HEADERS, "X-Request-Id": "gone-1"},
                      json={"model": MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 250, "n": 64,
                            "temperature": 0, "stream": True, "ignore_eos": True}, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    line = wait_for_line(logged, "/v1/completions", "cmpl-gone-1")
    assert line.group(7) == " (client gone)"


def test_no_log_when_disabled(server):
    httpx.get(server.url + "/v1/models", headers={**HEADERS, "X-Request-Id": "quiet-1"})
    time.sleep(0.3)
    assert not any("quiet-1" in line for line in server.stderr)
    # and no X-Request-Id header without --enable-request-id-headers
    assert "x-request-id" not in httpx.get(server.url + "/v1/models", headers=HEADERS).headers
