"""Speculative decoding through the server (`--speculative-config`, docs/speculative.md): a server that
speculates answers exactly what a plain one answers (greedy and seeded sampling, logprobs, stop strings,
streaming, structured outputs), reports vLLM's spec_decode counters on /metrics, and says so at start."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sparrow_server import API_KEY, MODEL_NAME, wait_until

REPO = Path(__file__).resolve().parents[2]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPT = "abc abc abc abc abc abc abc "


@pytest.fixture(scope="module")
def speculating(start_server):
    server = start_server("--api-key", API_KEY, "--speculative-config", NGRAM)
    yield server
    assert server.stop() == 0, server.output()  # no other module uses it: its memory goes back now


def completion(server, **kwargs):
    kwargs.setdefault("max_tokens", 32)
    return server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs)


@pytest.mark.parametrize("params", [
    {"temperature": 0},
    {"temperature": 0, "logprobs": 2},
    {"temperature": 0.8, "seed": 11, "top_p": 0.9},
    {"temperature": 0.5, "seed": 3, "frequency_penalty": 0.4, "n": 2},
    {"temperature": 0, "stop": ["c a"]},
], ids=["greedy", "logprobs", "seeded", "penalties-n2", "stop"])
def test_same_answer_as_without_speculation(server, speculating, params):
    want = completion(server, **params)
    got = completion(speculating, **params)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in want.choices]
    assert got.usage.completion_tokens == want.usage.completion_tokens
    if params.get("logprobs"):
        for g, w in zip(got.choices, want.choices):
            assert g.logprobs.tokens == w.logprobs.tokens
            assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)


def test_streaming_is_the_same_text(server, speculating):
    want = completion(server, temperature=0).choices[0].text
    chunks = completion(speculating, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_structured_output_with_drafts(server, speculating):
    body = {"structured_outputs": {"regex": "(abc )+(ab|x)"}}
    want = completion(server, temperature=0, extra_body=body).choices[0]
    got = completion(speculating, temperature=0, extra_body=body).choices[0]
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason


def test_metrics_report_drafts_and_acceptance(speculating):
    completion(speculating, temperature=0, max_tokens=48)
    metrics = speculating.metrics()
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= draft_tokens
    per_position = [metrics[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a draft is accepted only after the ones before it


def test_plain_server_has_no_spec_counters(server):
    assert not any(key.startswith("vllm:spec_decode") for key in server.metrics())


def test_start_summary_says_so(speculating):
    assert wait_until(lambda: any("speculative decoding" in line for line in speculating.stderr), timeout_s=10)
    line = next(line for line in speculating.stderr if "speculative decoding" in line)
    assert re.search(r"speculative decoding: ngram, 4 draft tokens a step", line), line


def test_bad_config_refuses_to_start(sparrow_binary, model_dir):
    import subprocess
    r = subprocess.run([sparrow_binary, "serve", str(model_dir), "--port", "0", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": "x"}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "prompt_lookup_max\" must be an integer" in r.stderr, r.stderr


def test_dspark_server_answers_as_a_plain_one(start_server, test_model):
    """The dspark method (model/dspark.h) through the server: a DSpark drafter for Kimi K3
    (tests/fixtures/kimi_k3_dspark, for the kimi_k3_1_pro fixture) gives the answers a plain server of the same
    model gives, greedy and seeded, with its drafts verified (the target's KDA states roll back on rejections)."""
    model = test_model("kimi_k3_1_pro")
    config = json.dumps({"method": "dspark", "model": str(REPO / "tests/fixtures/kimi_k3_dspark"),
                         "num_speculative_tokens": 4})
    plain = start_server("--api-key", API_KEY, model=model)
    drafting = start_server("--api-key", API_KEY, "--speculative-config", config, model=model)
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        for prompt in ("hello world", "abc abc abc", "1 2 3 4 5"):
            want = plain.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, **params)
            got = drafting.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, **params)
            assert got.choices[0].text == want.choices[0].text, (prompt, params)
    assert drafting.metrics()["vllm:spec_decode_num_drafts_total"] > 0
    assert wait_until(lambda: any("speculative decoding: dspark" in line for line in drafting.stderr), timeout_s=10)
    assert drafting.stop() == 0, drafting.output()
    assert plain.stop() == 0, plain.output()
