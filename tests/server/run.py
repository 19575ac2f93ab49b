#!/usr/bin/env python3
"""ctest's entry to the server tests (tests/server/*.py, pytest with the official `openai` client):

    python3 tests/server/run.py --sparrow build/sparrow [test_file.py...] [pytest arguments...]

Runs the named files of tests/server (all of them when none is named). ctest runs the suite as two
entries, the multi-process files and the rest, so the 2-core CI machine runs both at once (CMakeLists.txt).

Exits 77 (ctest SKIP_RETURN_CODE) when pytest, openai or httpx is missing: pip install openai pytest httpx.
"""
import importlib.util
import os
import sys

SKIP = 77

missing = [m for m in ("pytest", "openai", "httpx") if importlib.util.find_spec(m) is None]
if missing:
    print(f"SKIP: the server tests need {', '.join(missing)}: pip install openai pytest httpx")
    sys.exit(SKIP)

import pytest  # noqa: E402  (after the check; importing the others here would upset pytest's plugins)

here = os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:]
files = [os.path.join(here, a) for a in args if a.startswith("test_") and a.endswith(".py")]
rest = [a for a in args if not (a.startswith("test_") and a.endswith(".py"))]
# -p no:cacheprovider: no .pytest_cache written into the source tree.
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *(files or [here]), *rest]))
