"""The Python API's tests (docs/python.md): `python3 -m pytest -q tests/python --sparrow build/sparrow` with
build/python on PYTHONPATH (ctest sets it). The `sparrow` binary gives the outputs the API must match."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    parser.addoption("--sparrow", default=os.environ.get("SPARROW_BINARY", str(REPO / "build" / "sparrow")),
                     help="the sparrow binary")


@pytest.fixture(scope="session")
def sparrow_binary(request) -> str:
    return request.config.getoption("--sparrow")
