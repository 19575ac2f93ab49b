"""Hostile and unusual HTTP clients against `sparrow serve`, on raw loopback sockets (issue 20): slowloris,
pipelining, HTTP/1.0, 405, keep-alive, Expect: 100-continue, queueing past --max-num-seqs, a streaming
client that vanishes, the connection cap, the API key compared exactly. Each case ends with a normal
request that must be answered within two seconds. Counts and times are bounded: a few hundred sockets,
at most ~10 s per case."""
from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import threading
import time

import httpx
import pytest

from sparrow_server import MODEL_NAME, wait_until

SMALL = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
# Keeps the tiny test model busy for a second or so.
LONG = {"model": MODEL_NAME, "prompt": [3, 4, 5], "max_tokens": 250, "n": 64, "temperature": 0, "ignore_eos": True}
JSON = "Content-Type: application/json\r\n"


def request(method: str, path: str, body: bytes | dict | None = None, version: str = "1.1", headers: str = "") -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers = JSON + headers
    head = f"{method} {path} HTTP/{version}\r\nHost: test\r\n{headers}"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body or b"")


class Raw:
    """A raw client connection with a receive buffer, reading responses the way RFC 9112 frames them."""

    def __init__(self, server, timeout: float = 10):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
        self.buffer = b""

    def send(self, data: bytes):
        self.sock.sendall(data)

    def close(self):
        self.sock.close()

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _take_line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError("closed in the middle of a line")
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def read_response(self) -> tuple[str, dict[str, str], bytes]:
        """(status line, lower-cased fields, body); the body by Content-Length, chunks, or until close."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"closed before a response: {self.buffer!r}")
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        status = lines[0]
        if status.split()[1].startswith("1"):
            return status, fields, b""
        if "content-length" in fields:
            n = int(fields["content-length"])
            while len(self.buffer) < n and self._fill():
                pass
            body, self.buffer = self.buffer[:n], self.buffer[n:]
        elif fields.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._take_line(), 16)
                while len(self.buffer) < size + 2:
                    if not self._fill():
                        raise ConnectionError("closed in the middle of a chunk")
                body += self.buffer[:size]
                self.buffer = self.buffer[size + 2:]
                if size == 0:
                    break
        else:
            while self._fill():
                pass
            body, self.buffer = self.buffer, b""
        return status, fields, body

    def closed_by_server(self, timeout: float = 5) -> bool:
        """Whether the server closes (or resets) the connection within `timeout`."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


def assert_still_serving(server):
    """A normal completion after a hostile case: answered, and within two seconds."""
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json=SMALL, timeout=10)
    elapsed = time.monotonic() - start
    assert response.status_code == 200, response.text
    assert elapsed < 2, f"a normal request took {elapsed:.2f} s"


def sse_events(body: bytes) -> list:
    return [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]


@pytest.fixture(scope="module")
def open_server(start_server):
    """No API key; short deadlines so that slow clients are dropped quickly."""
    return start_server("--http-header-timeout", "2", "--http-request-timeout", "4", "--http-keep-alive-timeout", "5")


# --- slow and many clients -------------------------------------------------------------------------

def test_slowloris_is_cut_off_by_the_header_deadline(open_server):
    trickling: list[tuple[socket.socket, float]] = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", open_server.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickling.append((s, time.monotonic()))
    closed_after: dict[int, float] = {}
    stop = threading.Event()

    def trickle():  # a byte every half second on each connection still open, for at most ~10 s
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline and len(closed_after) < len(trickling):
            for i, (s, opened) in enumerate(trickling):
                if i in closed_after:
                    continue
                try:
                    s.setblocking(False)
                    try:
                        if s.recv(65536) is not None:  # data (the 408) or b"" (closed)
                            closed_after[i] = time.monotonic() - opened
                            continue
                    except BlockingIOError:
                        pass
                    s.send(b"X")
                except OSError:
                    closed_after[i] = time.monotonic() - opened
            time.sleep(0.5)

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        # Meanwhile everyone else is served at once.
        for _ in range(3):
            start = time.monotonic()
            assert httpx.get(open_server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - start < 1
            time.sleep(0.3)
        assert_still_serving(open_server)
        thread.join(15)
    finally:
        stop.set()
        thread.join()
        for s, _ in trickling:
            s.close()
    assert len(closed_after) == len(trickling), f"{len(trickling) - len(closed_after)} slow connections stayed open"
    # --http-header-timeout 2: each is cut off then (plus one trickle round and scheduling slack).
    assert max(closed_after.values()) < 5, max(closed_after.values())
    assert_still_serving(open_server)


def test_connection_cap_sheds_idle_connections_for_a_real_request(start_server):
    server = start_server("--http-max-connections", "16")
    idle = []
    for _ in range(16):
        raw = Raw(server)
        raw.send(request("GET", "/health"))
        assert raw.read_response()[0].startswith("HTTP/1.1 200")
        idle.append(raw)  # now an idle keep-alive connection
    silent = [Raw(server) for _ in range(20)]  # connect and say nothing: each replaces an older one
    assert_still_serving(server)
    assert idle[0].closed_by_server(timeout=2), "the longest idle connection was not shed"
    for raw in idle + silent:
        raw.close()
    assert_still_serving(server)


# --- RFC 9112 ---------------------------------------------------------------------------------------

def test_pipelined_requests_get_every_answer_in_order(open_server):
    raw = Raw(open_server)
    raw.send(request("POST", "/tokenize", {"prompt": "ab"}) + request("GET", "/v1/models") +
             request("POST", "/v1/completions", SMALL))
    status, _, body = raw.read_response()
    assert status.startswith("HTTP/1.1 200") and json.loads(body)["count"] == 2
    status, _, body = raw.read_response()
    assert status.startswith("HTTP/1.1 200") and json.loads(body)["object"] == "list"
    status, _, body = raw.read_response()
    assert status.startswith("HTTP/1.1 200") and json.loads(body)["object"] == "text_completion"
    raw.close()
    assert_still_serving(open_server)


def test_http_1_0_is_answered_in_http_1_0(open_server):
    raw = Raw(open_server)
    raw.send(request("POST", "/v1/completions", SMALL, version="1.0"))
    status, fields, body = raw.read_response()
    assert status.startswith("HTTP/1.0 200") and "transfer-encoding" not in fields
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    assert raw.closed_by_server()  # HTTP/1.0 without keep-alive
    raw.close()

    raw = Raw(open_server)  # a stream: no chunks, the body ends when the connection does
    raw.send(request("POST", "/v1/completions", {**SMALL, "stream": True}, version="1.0",
                     headers="Connection: keep-alive\r\n"))
    status, fields, body = raw.read_response()
    assert status.startswith("HTTP/1.0 200") and "transfer-encoding" not in fields
    assert fields["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == b"[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    raw.close()
    assert_still_serving(open_server)


def test_wrong_method_is_405_with_allow(open_server):
    raw = Raw(open_server)
    raw.send(request("GET", "/v1/completions"))
    status, fields, body = raw.read_response()
    assert status.startswith("HTTP/1.1 405") and fields["allow"] == "POST"
    error = json.loads(body)["error"]
    assert error["code"] == 405 and error["type"] == "MethodNotAllowedError"
    raw.send(request("POST", "/health", b""))
    status, fields, _ = raw.read_response()
    assert status.startswith("HTTP/1.1 405") and fields["allow"] == "GET, HEAD"
    raw.send(request("GET", "/v1/nothing"))
    assert raw.read_response()[0].startswith("HTTP/1.1 404")
    raw.close()
    assert_still_serving(open_server)


def test_keep_alive_serves_many_requests_on_one_connection(open_server):
    raw = Raw(open_server)
    for i in range(12):
        raw.send(request("POST", "/v1/completions", SMALL) if i % 3 == 0 else request("GET", "/health"))
        assert raw.read_response()[0].startswith("HTTP/1.1 200"), i
    raw.close()


def test_expect_100_continue(open_server):
    raw = Raw(open_server)
    body = json.dumps(SMALL).encode()
    raw.send(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{JSON}Content-Length: {len(body)}\r\n"
             f"Expect: 100-continue\r\n\r\n".encode())
    assert raw.read_response()[0] == "HTTP/1.1 100 Continue"
    raw.send(body)
    assert raw.read_response()[0].startswith("HTTP/1.1 200")
    raw.close()
    if shutil.which("curl"):  # as curl does it for a large body
        padded = json.dumps({**SMALL, "padding": "x" * (2 << 20)})
        result = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
                                 "-H", "Expect: 100-continue", "--data-binary", "@-", open_server.url + "/v1/completions"],
                                input=padded, capture_output=True, text=True, timeout=30)
        assert result.stdout.rsplit("\n", 1)[1] == "200", result.stdout[-500:]
    assert_still_serving(open_server)


def test_body_deadline_and_oversized_header(open_server):
    raw = Raw(open_server)  # a body that never comes: 408 once --http-request-timeout (4 s) has passed
    raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    start = time.monotonic()
    assert raw.read_response()[0].startswith("HTTP/1.1 408")
    assert time.monotonic() - start < 6
    raw.close()
    raw = Raw(open_server)
    raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * (100 << 10) + b"\r\n\r\n")
    assert raw.read_response()[0].startswith("HTTP/1.1 431")
    raw.close()
    assert_still_serving(open_server)


# --- queueing ---------------------------------------------------------------------------------------

def run_concurrently(server, count: int, body: dict) -> list[httpx.Response]:
    responses: list = [None] * count

    def run(i):
        responses[i] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return responses


def test_requests_beyond_max_num_seqs_wait_in_the_queue(start_server):
    server = start_server("--max-num-seqs", "2")
    body = {**SMALL, "max_tokens": 40, "ignore_eos": True}
    responses = run_concurrently(server, 12, body)
    assert [r.status_code for r in responses] == [200] * 12
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses)


def test_a_full_queue_is_503_with_retry_after(start_server):
    server = start_server("--max-num-seqs", "1", "--max-queued-requests", "1")
    body = {**SMALL, "max_tokens": 200, "ignore_eos": True}
    responses = run_concurrently(server, 12, body)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert_still_serving(server)


# --- clients that go away ---------------------------------------------------------------------------

def test_a_vanishing_streaming_client_is_aborted_at_once(start_server):
    server = start_server()
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    raw = Raw(server)
    raw.send(request("POST", "/v1/completions", {**LONG, "stream": True}))
    while b"data: " not in raw.buffer:  # the stream has begun
        assert raw._fill()
    assert server.metrics()["vllm:num_requests_running"] >= 1
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    raw.close()
    start = time.monotonic()
    settled = lambda: (m := server.metrics())["vllm:num_requests_running"] == 0 and \
        m["sparrow:kv_cache_blocks_used"] == 0 and m.get(aborted, 0) > before
    assert wait_until(settled, timeout_s=5), server.metrics()
    assert time.monotonic() - start < 2, "the abort was not immediate"
    assert_still_serving(server)


# --- the API key ------------------------------------------------------------------------------------

def test_api_key_is_compared_exactly(start_server):
    server = start_server("--api-key", "secret")
    for authorization, expected in [("Bearer secret", "200"), ("Bearer secret ", "401"), ("Bearer secre", "401"),
                                    ("Bearer secretx", "401"), ("", "401")]:
        raw = Raw(server)
        raw.send(request("GET", "/v1/models", headers=f"Authorization: {authorization}\r\n" if authorization else ""))
        status = raw.read_response()[0]
        assert status.split()[1] == expected, (authorization, status)
        raw.close()
