"""A vLLM command line starts sparrow (issue 27): `vllm serve`'s flags that sparrow has no setting for are
accepted, each with a one-line notice saying why it changes nothing (or silently where it means what
sparrow does anyway), and the server then serves; vLLM's probes /version and /ping answer without the API
key. The refusals are in tests/cli_test.cpp (they stop the start-up before anything loads)."""
from __future__ import annotations

import httpx

from sparrow_server import API_KEY, MODEL_NAME

# What a vLLM deployment's command line typically carries beyond the model.
VLLM_FLAGS = ["--dtype", "auto", "--trust-remote-code", "--disable-log-stats", "--enable-log-requests",
              "--uvicorn-log-level", "warning", "--enable-chunked-prefill", "--swap-space", "4", "-tp", "1",
              "-dp", "1", "-pp", "1", "--block-size", "64", "--quantization", "fp8", "--root-path", "/proxy",
              "--allowed-origins", '["*"]', "--max-num-seqs", "8"]


def test_a_vllm_command_line_serves(start_server):
    server = start_server("--api-key", API_KEY, *VLLM_FLAGS)
    notices = [line for line in server.stderr if ": ignored: " in line]
    for flag in ("--trust-remote-code", "--disable-log-stats", "--uvicorn-log-level warning", "--swap-space 4",
                 "--quantization fp8", "--root-path /proxy", '--allowed-origins ["*"]'):
        assert any(line.startswith(f"sparrow serve: {flag}: ignored: ") for line in notices), (flag, notices)
    for silent in ("--dtype", "--enable-chunked-prefill", "--enable-log-requests", "--data-parallel-size",
                   "--pipeline-parallel-size"):
        assert not any(silent in line for line in notices), (silent, notices)
    assert len(notices) == 7, notices

    completion = server.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4,
                                                    temperature=0)
    assert completion.choices[0].finish_reason == "length"
    # The probes need no key, as in vLLM.
    version = httpx.get(server.url + "/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"].count(".") == 2, version.text
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # the API itself still needs it
