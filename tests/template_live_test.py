#!/usr/bin/env python3
"""Live check of sparrow's Jinja interpreter against Python jinja2.

Every model template in tests/data/templates is rendered on every conversation of
conversations.json, and every feature snippet of snippets.json is rendered too, twice: by
`sparrow render --model DIR --request FILE` and by jinja2 in transformers' environment
(tools/render_reference.py). The prompts must be byte-identical; where jinja2 raises, sparrow must
exit 1 with a one-line error holding jinja2's message (or, for the few snippets that say so in
"sparrow_error", sparrow's own wording). The committed expectations that
tests/template_test.cpp uses must also still match jinja2.

    python3 tests/template_live_test.py --sparrow build/sparrow

Exits 77 (ctest SKIP_RETURN_CODE) when jinja2 is not installed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 77
ROOT = Path(__file__).resolve().parent.parent


def run_sparrow(sparrow: str, model_dir: Path, request: dict, scratch: Path) -> subprocess.CompletedProcess:
    request_path = scratch / "request.json"
    request_path.write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
    return subprocess.run([sparrow, "render", "--model", str(model_dir), "--request", str(request_path)],
                          capture_output=True, timeout=60)


def check(label: str, result: subprocess.CompletedProcess, expected: dict) -> str | None:
    """None when sparrow agrees with jinja2, else what differs."""
    err = result.stderr.decode("utf-8", "replace")
    if "prompt" in expected:
        if result.returncode != 0:
            return f"{label}: sparrow failed ({err.strip()}) where jinja2 renders"
        out = result.stdout.decode("utf-8", "replace")
        if out != expected["prompt"]:
            at = next((i for i, (a, b) in enumerate(zip(out, expected["prompt"])) if a != b),
                      min(len(out), len(expected["prompt"])))
            return (f"{label}: prompts differ at character {at}:\n  jinja2: {expected['prompt'][max(0, at - 40):at + 40]!r}"
                    f"\n  sparrow: {out[max(0, at - 40):at + 40]!r}")
        return None
    if result.returncode != 1 or not err.startswith("error: ") or err.count("\n") != 1:
        return f"{label}: jinja2 raises ({expected['error']}) but sparrow gave status {result.returncode}: {err!r}"
    if expected.get("sparrow_error", expected["error"]) not in err:
        return f"{label}: error messages differ:\n  jinja2: {expected['error']}\n  sparrow: {err.strip()}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparrow", required=True, help="the sparrow binary")
    args = parser.parse_args()
    try:
        import jinja2  # noqa: F401
    except ImportError:
        print("SKIP: jinja2 is not installed")
        return SKIP
    sys.path.insert(0, str(ROOT / "tools"))
    import render_reference as reference

    data = reference.DATA
    conversations = json.loads((data / "conversations.json").read_text(encoding="utf-8"))
    snippets = json.loads((data / "snippets.json").read_text(encoding="utf-8"))
    failures, stale, compared = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        # Model folders as transformers reads them: the template in chat_template.jinja.
        for name, (source, tokenizer_config) in reference.load_models().items():
            model_dir = scratch / name
            model_dir.mkdir()
            (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
            (model_dir / "chat_template.jinja").write_bytes(source.encode("utf-8"))
            committed = json.loads((data / "expected" / f"{name}.json").read_text(encoding="utf-8"))
            for c in conversations:
                label = f"{name}/{c['name']}"
                expected = reference.outcome(source, tokenizer_config, c["request"])
                if committed.get(c["name"]) != expected:
                    stale.append(f"{label}: tests/data/templates/expected/{name}.json is stale "
                                    "(run tools/render_reference.py)")
                failure = check(label, run_sparrow(args.sparrow, model_dir, c["request"], scratch), expected)
                compared += 1
                if failure:
                    failures.append(failure)
        # Snippets: the template inline in tokenizer_config.json.
        snippet_dir = scratch / "snippet"
        snippet_dir.mkdir()
        for s in snippets:
            (snippet_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": s["template"]}),
                                                               encoding="utf-8")
            request = reference.snippet_request(s)
            expected = reference.outcome(s["template"], {}, request)
            label = f"snippet {s['name']}"
            if {k: s[k] for k in ("prompt", "error") if k in s} != expected:
                stale.append(f"{label}: tests/data/templates/snippets.json is stale (run tools/render_reference.py)")
            if "sparrow_error" in s:  # where sparrow words an error its own way on purpose
                expected["sparrow_error"] = s["sparrow_error"]
            failure = check(label, run_sparrow(args.sparrow, snippet_dir, request, scratch), expected)
            compared += 1
            if failure:
                failures.append(failure)
    for f in failures + stale:
        print(f)
    print(f"{compared - len(failures)}/{compared} renders identical to jinja2 {jinja2.__version__}")
    return 1 if failures or stale else 0


if __name__ == "__main__":
    sys.exit(main())
