"""64 concurrent streaming requests of mixed lengths, about a quarter of them cancelled by their client
part-way: every request that is not cancelled gets exactly the tokens it gets when it runs alone
(greedy), and once all are done every KV-cache block is free again.

The server is squeezed so that the scheduler's hard paths run: 16 sequences at most, 256 tokens per
step (chunked prefill), and a KV cache too small for 16 full contexts (preemption by recompute)."""
from __future__ import annotations

import random
import threading

import pytest

from sparrow_server import MODEL_NAME, wait_until

REQUESTS = 64
MAX_MODEL_LEN = 256


def make_requests(seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(REQUESTS):
        prompt_len = rng.choice([1, 3, 8, 20, 63, 64, 65, 100, 150])  # around the 64-token block size too
        max_tokens = rng.randint(1, min(90, MAX_MODEL_LEN - prompt_len))
        requests.append({"prompt": [rng.randrange(240) for _ in range(prompt_len)], "max_tokens": max_tokens,
                         "cancel_after": rng.randint(1, 4) if rng.random() < 0.25 else None})
    return requests


def run_alone(client, request) -> list[int]:
    response = client.completions.create(model=MODEL_NAME, prompt=request["prompt"], max_tokens=request["max_tokens"],
                                         temperature=0, extra_body={"return_token_ids": True})
    return response.choices[0].model_extra["token_ids"]


def run_streaming(client, request, results: dict, index: int):
    tokens, chunks, finish = [], 0, None
    stream = client.completions.create(model=MODEL_NAME, prompt=request["prompt"], max_tokens=request["max_tokens"],
                                       temperature=0, stream=True, extra_body={"return_token_ids": True})
    for chunk in stream:
        for choice in chunk.choices:
            tokens += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
        chunks += 1
        if request["cancel_after"] is not None and chunks >= request["cancel_after"]:
            stream.close()  # the client goes away mid-stream
            results[index] = ("cancelled", tokens, None)
            return
    results[index] = ("done", tokens, finish)


def stream_all(client, requests: list[dict], join_s: float) -> dict[int, tuple]:
    """Every request streamed at once, a thread each (run_streaming); the results of those that finished
    within join_s of their turn to be waited for."""
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=run_streaming, args=(client, r, results, i)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return results


def differences_from_solo(results: dict[int, tuple], alone: list[list[int]]) -> list[tuple]:
    """The streams whose tokens are not their solo run's: all of them for a finished stream (which must have
    stopped or hit its length), a prefix of them for a cancelled one."""
    mismatches = []
    for i, (state, tokens, finish) in sorted(results.items()):
        if state == "done":
            if tokens != alone[i] or finish not in ("stop", "length"):
                mismatches.append((i, tokens, alone[i], finish))
        elif tokens != alone[i][:len(tokens)]:
            mismatches.append((i, tokens, alone[i], "cancelled"))
    return mismatches


# Every family, the hybrid ones (KDA recurrent state slots and prefix-cache snapshots) included. The
# budgets leave 10 block rows of 64 tokens: 16 sequences of ~2 blocks each cannot fit at once, so the
# scheduler must preempt however the requests happen to interleave.
KV_CACHE_MEMORY = {"deepseek_v32": "420KiB", "kimi_k3": "1150KiB", "kimi_k3_1_pro": "1270KiB", "kimi_linear": "600KiB",
                   "minimax_m3": "600KiB"}


@pytest.mark.parametrize("family", sorted(KV_CACHE_MEMORY))
def test_concurrent_streams_match_solo_runs_and_free_every_block(start_server, test_model, family):
    server = start_server("--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len",
                          str(MAX_MODEL_LEN), "--kv-cache-memory", KV_CACHE_MEMORY[family], model=test_model(family))
    client = server.client(timeout=120)
    requests = make_requests()
    alone = [run_alone(client, r) for r in requests]

    results = stream_all(client, requests, join_s=180)
    assert len(results) == REQUESTS, "some requests did not finish"

    mismatches = differences_from_solo(results, alone)
    assert not mismatches, f"{len(mismatches)} requests differ from their solo runs: {mismatches[:3]}"
    assert sum(state == "cancelled" for state, _, _ in results.values()) >= 8

    def idle():
        m = server.metrics()
        return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and \
            m["vllm:kv_cache_usage_perc"] == 0 and m["sparrow:kv_cache_blocks_used"] == 0
    assert wait_until(idle, timeout_s=30), server.metrics()
    assert server.metrics()["vllm:num_preemptions_total"] > 0, "the small cache preempted nothing: the test lost its point"
