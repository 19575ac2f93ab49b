"""Starts `sparrow serve` for the tests: each server runs on a free loopback port (--port 0; the port
is read from its start-up line) and is stopped with SIGTERM at the end, which must drain and exit 0.

    python3 -m pytest -q tests/server --sparrow build/sparrow [--model-dir DIR]

Without --model-dir the model is tests/fixtures/deepseek_v32 with the byte-level tokenizer and chat
template of test_model.py (its greedy output is known from transformers: greedy.json)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparrow_server import API_KEY, SparrowServer
from fixture_model import make_test_model

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    parser.addoption("--sparrow", default=os.environ.get("SPARROW_BINARY", str(REPO / "build" / "sparrow")),
                     help="the sparrow binary")
    parser.addoption("--model-dir", default=None, help="serve this model folder instead of the test model")


@pytest.fixture(scope="session")
def sparrow_binary(request) -> str:
    binary = request.config.getoption("--sparrow")
    if not Path(binary).exists():
        pytest.fail(f"no sparrow binary at {binary} (build it, or pass --sparrow)")
    return binary


@pytest.fixture(scope="session")
def test_model(tmp_path_factory):
    """test_model(family) -> a servable folder of tests/fixtures/<family> (fixture_model.py)."""
    made = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = make_test_model(REPO / "tests" / "fixtures" / family, tmp_path_factory.mktemp(family))
        return made[family]
    return make


@pytest.fixture(scope="session")
def model_dir(request, test_model) -> Path:
    given = request.config.getoption("--model-dir")
    return Path(given) if given else test_model("deepseek_v32")


@pytest.fixture(scope="session")
def start_server(sparrow_binary, model_dir):
    """start_server(*flags, model=None, log_requests=False) -> a running SparrowServer (of model_dir unless
    `model` is given; with the access log on stderr when log_requests), stopped (and checked to exit 0)
    at the end of the session. A test whose servers nothing else uses stops them itself when it is done
    (SparrowServer.stop): under the sanitizers every live server holds about half a gigabyte."""
    servers = []

    def start(*flags: str, model: Path | None = None, log_requests: bool = False) -> SparrowServer:
        defaults = [] if "--kv-cache-memory" in flags else ["--kv-cache-memory", "64MiB"]
        server = SparrowServer(sparrow_binary, model or model_dir, *defaults, *flags, log_requests=log_requests)
        servers.append(server)
        return server

    yield start
    # Every server is stopped, also after one failed to stop cleanly (a sanitizer build's servers hold ~0.5 GB
    # each: one left running per failure would starve the runs after it).
    failures = []
    for server in servers:
        try:
            code = server.stop()
        except RuntimeError as e:
            failures.append(str(e))
            continue
        if code != 0:
            failures.append(f"sparrow serve exited with {code}\n{server.output()}")
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="session")
def server(start_server) -> SparrowServer:
    """The plain server: no parsers, an API key."""
    return start_server("--api-key", API_KEY)


@pytest.fixture(scope="session")
def parser_server(start_server) -> SparrowServer:
    """A server with Kimi K2's reasoning and tool-call parsers and automatic tool choice."""
    return start_server("--api-key", API_KEY, "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2",
                        "--enable-auto-tool-choice")
