"""Prefill/decode disaggregation through the OpenAI API (issue 31, docs/disaggregation.md): a prefill instance
(--kv-transfer-config kv_role kv_producer), a decode instance (kv_consumer) and `sparrow proxy` in front, three
processes on the CPU: completions and chats, streamed or not, answer exactly what one instance answers (token ids
and logprobs), for an MLA + DSA model and a KDA one; the decode instance's transfer log shows one message per
block row; a prefill instance killed after answering fails only the requests that needed it; malformed or
misdirected kv_transfer_params are 400s naming the field. The engine-level cases (every family, prefix hits on the
decode side, expiry, aborts) are tests/disaggregation_test.cpp's."""
from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from sparrow_server import API_KEY, MODEL_NAME, SparrowServer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK = 64


def kv_config(role: str, **extra) -> str:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": 0}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


class Proxy:
    """One `sparrow proxy` process."""

    def __init__(self, binary: str, prefill: str, decode: str):
        self.process = subprocess.Popen([binary, "proxy", "--prefill", prefill, "--decode", decode, "--port", "0"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        assert match, line + self.process.stderr.read()
        self.url = f"http://127.0.0.1:{match.group(1)}"
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)


@pytest.fixture(scope="module", params=["deepseek_v32", "kimi_linear"])
def pair(request, start_server, test_model, sparrow_binary):
    model = test_model(request.param)
    common = ("--api-key", API_KEY, "--max-model-len", "256")
    reference = start_server(*common, model=model)
    prefill = start_server(*common, "--kv-transfer-config", kv_config("kv_producer"), model=model)
    decode = start_server(*common, "--kv-transfer-config", kv_config("kv_consumer", log_transfers=True), model=model)
    proxy = Proxy(sparrow_binary, prefill.url, decode.url)
    yield request.param, reference, prefill, decode, proxy
    assert proxy.stop() == 0
    for server in (prefill, decode, reference):
        server.stop()


def logged(server, predicate, timeout_s: float = 10) -> list[str]:
    """The server's "kv transfer: fetch" lines once one satisfies `predicate` (its stderr is read by a thread, so a
    line the server wrote before answering may reach the test after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in server.output().splitlines() if "kv transfer: fetch" in line]
        if any(predicate(line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def metric(server, name: str, predicate, timeout_s: float = 10) -> float:
    """/metrics' `name` once it satisfies `predicate` (the engine publishes its counters after the step that
    answered), or its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = server.metrics()[name]
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=120)


def streamed(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


PROMPT = [(i * 37 + 11) % 200 + 3 for i in range(150)]  # 3 blocks of 64: past the fixtures' sparse budgets


def test_completions_through_the_proxy_are_one_instances(pair):
    family, reference, _, decode, proxy = pair
    for params in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}):
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "logprobs": 2, "ignore_eos": True,
                "return_token_ids": True, **params}
        want = post(reference.url, "/v1/completions", body).json()
        got = post(proxy.url, "/v1/completions", body).json()
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (family, params)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
        assert got["usage"]["completion_tokens"] == 12
        assert "kv_transfer_params" not in got  # only the prefill instance's answer carries one
    # min_tokens past the prefill instance's one token (the proxy holds it to 1 there), then streamed.
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "min_tokens": 8, "temperature": 0, "logprobs": 1}
    want = post(reference.url, "/v1/completions", body).json()
    got = post(proxy.url, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"]["completion_tokens"] == 8
    assert httpx.get(proxy.url + "/metrics", timeout=10).text == httpx.get(decode.url + "/metrics", timeout=10).text
    # Streamed: the same tokens, chunk by chunk.
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = post(reference.url, "/v1/completions", body).json()["choices"][0]["text"]
    chunks = streamed(proxy.url, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_through_the_proxy_is_one_instances(pair):
    _, reference, _, _, proxy = pair
    body = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": "tell me about the sea " * 6}]}
    want = post(reference.url, "/v1/chat/completions", body).json()
    got = post(proxy.url, "/v1/chat/completions", body).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    chunks = streamed(proxy.url, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == (want["choices"][0]["message"]["content"] or "")


def test_one_message_per_block_row_in_the_transfer_log(pair):
    family, _, _, decode, proxy = pair
    prompt = [(i * 13 + 7) % 200 + 3 for i in range(200)]  # 4 rows of 64, not cached on the decode side yet
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert post(proxy.url, "/v1/completions", body).status_code == 200
    state = 1 if family == "kimi_linear" else 0  # the KDA layers' recurrent state: one more message
    rows = math.ceil(200 / BLOCK)
    lines = logged(decode, lambda line: f"ok, {rows + state} messages" in line)
    assert any(f"ok, {rows + state} messages" in line for line in lines), "\n".join(lines)
    assert metric(decode, "sparrow:kv_transfer_fetched_messages_total", lambda v: v >= rows + state) >= rows + state
    assert decode.metrics()["sparrow:kv_transfer_fetches_failed_total"] == 0


def test_handoff_fields_and_refusals(pair):
    _, reference, prefill, decode, _ = pair
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    answer = post(prefill.url, "/v1/completions", body).json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert len(params["remote_block_ids"]) == math.ceil(len(PROMPT) / BLOCK)
    assert params["num_tokens"] == len(PROMPT) and params["tp_size"] == 1
    # Misdirected or malformed: 400s that say what is wrong.
    cases = [
        (reference, {"do_remote_decode": True}, "kv_producer"),
        (decode, {"do_remote_prefill": True}, "kv_transfer_params.remote_request_id"),
        (decode, {**params, "remote_port": "x"}, "kv_transfer_params.remote_port"),
        (decode, {**params, "num_tokens": 5}, "computed 5 prompt tokens"),
        (decode, {**params, "cache_layout": "block 64, other"}, "differ from this instance's"),
    ]
    for server, kv, expected in cases:
        response = post(server.url, "/v1/completions", {**body, "kv_transfer_params": kv, "max_tokens": 4})
        assert response.status_code == 400, (kv, response.text)
        assert expected in response.text, response.text
    stream = post(prefill.url, "/v1/completions", {**body, "stream": True})
    assert stream.status_code == 400 and "stream false" in stream.text
    # The handoff itself still works after the refusals (it was not consumed by them).
    good = post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params, "max_tokens": 4}).json()
    assert good["usage"]["completion_tokens"] == 4


def test_dead_prefill_instance_fails_only_its_requests(start_server, test_model, sparrow_binary):
    model = test_model("deepseek_v32")
    decode = start_server("--api-key", API_KEY, "--kv-transfer-config",
                          kv_config("kv_consumer", fetch_timeout_s=20), model=model)
    # Started outside start_server, whose servers must exit 0: this one is killed.
    prefill = SparrowServer(sparrow_binary, model, "--kv-cache-memory", "64MiB", "--api-key", API_KEY,
                            "--kv-transfer-config", kv_config("kv_producer"))
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = post(prefill.url, "/v1/completions", body).json()["kv_transfer_params"]
    prefill.process.kill()  # gone before the decode instance fetches
    prefill.process.wait()
    orphan = post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params, "max_tokens": 6})
    assert orphan.status_code == 500, orphan.text
    assert any("failed" in line for line in logged(decode, lambda line: "failed" in line)), decode.output()
    # The decode instance serves on.
    fine = post(decode.url, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3})
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 3
    assert metric(decode, "sparrow:kv_transfer_fetches_failed_total", lambda v: v == 1) == 1
    decode.stop()


def test_kv_transfer_config_errors_stop_the_start(sparrow_binary, test_model):
    model = test_model("deepseek_v32")
    for config, expected in [('{"kv_role": "kv_both"}', "kv_connector is required"),
                             ('{"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}', "not one sparrow has"),
                             ('{"kv_connector": "NixlConnector", "kv_role": "both"}', "kv_role must be")]:
        done = subprocess.run([sparrow_binary, "serve", str(model), "--port", "0", "--kv-transfer-config", config],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and expected in done.stderr, done.stderr
