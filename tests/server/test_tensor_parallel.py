"""`sparrow serve --tensor-parallel-size 2` (docs/parallel.md) against the single-process server, with real
processes: every family (two with --enable-expert-parallel too), under the concurrency test's squeeze (chunked prefill, preemption, cancelled
streams, prefix caching, KDA state slots and snapshots), must give each request the tokens the
single-process server gives it alone (greedy). Then the ways a run ends: SIGTERM stops the workers too; a
worker that dies ends the server with its reason; ranks started by a launcher's variables (torchrun-style
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) serve the same tokens, and a worker whose rank 0 dies exits
with an error rather than waiting; two nodes started with vLLM's --nnodes / --node-rank / --headless serve them
too, and node flags that do not fit are refused."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sparrow_server import SparrowServer, wait_until
from test_concurrency import (KV_CACHE_MEMORY, MAX_MODEL_LEN, differences_from_solo, make_requests, run_alone,
                              stream_all)

REQUESTS = 64  # as many as the concurrency test: enough to make the squeezed cache preempt


def squeezed(kv_cache_memory: str) -> tuple[str, ...]:
    return ("--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory", kv_cache_memory)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a parent that is gone or busy) is not alive either.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


# Every family split inside its experts; two (a DeepSeek MoE, Kimi K3.1's latent MoE) also with the experts
# dealt out whole (--enable-expert-parallel); the MLA families also with decode context parallelism (-dcp 2:
# each rank caches every other token of the MLA latents and DSA index keys, through the same block tables),
# MiniMax-M3 with its indexer's (each rank scoring both index heads over every other key block); and with
# token-sharded prefill (steps of 64 tokens and more: chunks of prompts beside decode rows), under DCP too.
@pytest.mark.parametrize("family,layout", [(f, ()) for f in sorted(KV_CACHE_MEMORY)] +
                         [("deepseek_v32", ("--enable-expert-parallel",)),
                          ("kimi_k3_1_pro", ("--enable-expert-parallel",))] +
                         [(f, ("-dcp", "2")) for f in ("deepseek_v32", "kimi_k3_1_pro", "kimi_linear")] +
                         [("minimax_m3", ("--attention-config", '{"indexer_decode_cp": true}'))] +
                         [("deepseek_v32", ("--token-sharded-prefill", "64")),
                          ("kimi_k3_1_pro", ("-dcp", "2", "--token-sharded-prefill", "64"))],
                         ids=lambda v: v if isinstance(v, str) else
                         ("indexer_dcp" if "--attention-config" in v else "".join(v).strip("-") or "tp"))
def test_two_ranks_serve_what_one_process_serves(start_server, test_model, family, layout):
    model = test_model(family)
    single = start_server(*squeezed(KV_CACHE_MEMORY[family]), model=model)
    requests = make_requests(seed=2023)[:REQUESTS]
    expected = [run_alone(single.client(timeout=120), r) for r in requests]
    blocks = single.metrics()["sparrow:kv_cache_blocks_total"]

    # --kv-cache-memory is each rank's (vLLM's is each GPU's) and a rank caches only its heads: the sharded
    # server gets as many block rows as the single one has, so that it is squeezed alike.
    sharded = start_server(*squeezed(KV_CACHE_MEMORY[family]), "--num-gpu-blocks-override", str(int(blocks)),
                           "--tensor-parallel-size", "2", *layout, model=model)
    assert sharded.metrics()["sparrow:kv_cache_blocks_total"] == blocks
    assert len(children(sharded.process.pid)) == 1, "rank 0 should have started one worker"
    client = sharded.client(timeout=180)
    results = stream_all(client, requests, join_s=300)
    assert len(results) == REQUESTS, "some requests did not finish"
    mismatches = differences_from_solo(results, expected)
    assert not mismatches, f"{len(mismatches)} requests differ from the single-process server: {mismatches[:3]}"
    # The same prompts again: prefix-cache hits on rank 0 must find the same cached rows on the worker.
    again = [run_alone(client, r) for r in requests[:4]]
    assert again == expected[:4]
    assert sharded.metrics()["vllm:num_preemptions_total"] > 0, "nothing was preempted: the squeeze lost its point"
    for server in (sharded, single):  # used by no other test: their memory goes back now
        assert server.stop() == 0, server.output()


# Speculative decoding under tensor parallelism: the verify steps' logits rows go to the workers in the step
# plan, and a KDA rollback reaches them as a state op of the next step (kimi_linear); under DCP the verify
# rows of a sequence go through the top-k and log-sum-exp merges (deepseek_v32); the answers are still the
# single process's.
@pytest.mark.parametrize("family,layout", [("kimi_linear", ()), ("minimax_m3", ()), ("deepseek_v32", ("-dcp", "2"))],
                         ids=["kimi_linear", "minimax_m3", "deepseek_v32-dcp2"])
def test_two_ranks_speculating_serve_what_one_process_serves(start_server, test_model, family, layout):
    model = test_model(family)
    single = start_server(*squeezed(KV_CACHE_MEMORY[family]), model=model)
    requests = make_requests(seed=2024)[:REQUESTS // 2]
    expected = [run_alone(single.client(timeout=120), r) for r in requests]
    sharded = start_server(*squeezed(KV_CACHE_MEMORY[family]), "--tensor-parallel-size", "2", *layout,
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                           model=model)
    results = stream_all(sharded.client(timeout=180), requests, join_s=300)
    assert len(results) == len(requests), "some requests did not finish"
    mismatches = differences_from_solo(results, expected)
    assert not mismatches, f"{len(mismatches)} requests differ from the single-process server: {mismatches[:3]}"
    metrics = sharded.metrics()
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens_total"] < metrics["vllm:spec_decode_num_draft_tokens_total"]
    for server in (sharded, single):  # used by no other test: their memory goes back now
        assert server.stop() == 0, server.output()


# The MTP drafter under tensor parallelism, on the bundled DeepSeek-V3.2 model and the MTP layer trained for it
# (its README): the layer runs whole on rank 0 and only the target's verify steps reach the worker. Every
# request gets the tokens the same two ranks give without speculation (the CPU path is batch-invariant, so a
# verify step changes no logits), drafts are accepted, and nothing is left held.
def test_two_ranks_drafting_with_the_bundled_mtp_layer(start_server):
    model = Path(__file__).resolve().parents[2] / "models" / "deepseek_v32"
    flags = ("--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", str(MAX_MODEL_LEN),
             "--tensor-parallel-size", "2")
    requests = make_requests(seed=2025)[:REQUESTS // 2]
    plain = start_server(*flags, model=model)
    expected = [run_alone(plain.client(timeout=120), r) for r in requests]
    assert plain.stop() == 0, plain.output()
    drafting = start_server(*flags, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', model=model)
    results = stream_all(drafting.client(timeout=180), requests, join_s=300)
    assert len(results) == len(requests), "some requests did not finish"
    mismatches = differences_from_solo(results, expected)
    assert not mismatches, f"{len(mismatches)} requests differ from the same ranks without speculation: {mismatches[:3]}"
    metrics = drafting.metrics()
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0.2 * metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert wait_until(lambda: drafting.metrics()["sparrow:kv_cache_blocks_used"] == 0, timeout_s=30), drafting.metrics()
    assert drafting.stop() == 0, drafting.output()


def test_sigterm_stops_the_workers_too(sparrow_binary, test_model):
    server = SparrowServer(sparrow_binary, test_model("minimax_m3"), "--kv-cache-memory", "64MiB",
                           "--tensor-parallel-size", "2")
    workers = children(server.process.pid)
    assert len(workers) == 1
    assert server.stop() == 0, server.output()
    assert wait_until(lambda: not alive(workers[0]), timeout_s=10), "the worker outlived the server"


def test_a_dead_worker_ends_the_server_with_its_reason(sparrow_binary, test_model):
    server = SparrowServer(sparrow_binary, test_model("kimi_linear"), "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                           "--tensor-parallel-size", "2")
    worker = children(server.process.pid)[0]
    os.kill(worker, signal.SIGKILL)
    try:
        code = server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        pytest.fail("the server kept running without its worker\n" + server.output())
    assert code != 0
    wait_until(lambda: "tensor-parallel rank 1" in server.output(), timeout_s=5)
    assert f"tensor-parallel rank 1 (pid {worker}) was killed by signal 9" in server.output(), server.output()


def test_too_many_ranks_for_the_heads_is_refused(sparrow_binary, test_model):
    run = subprocess.run([sparrow_binary, "serve", str(test_model("minimax_m3")), "--port", "0",
                          "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "not divisible by the tensor-parallel size 3" in run.stderr, run.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched(binary: str, args: list[str], rank: int, port: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([binary, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ranks_from_launcher_variables(sparrow_binary, test_model, start_server):
    model = test_model("deepseek_v32")
    requests = make_requests(seed=7)[:6]
    single = start_server("--kv-cache-memory", "64MiB", model=model)
    expected = [run_alone(single.client(timeout=120), r) for r in requests]

    # Rank 1 first: a worker waits for rank 0's rendezvous rather than failing.
    port = free_port()
    worker = launched(sparrow_binary, ["serve", str(model), "--tensor-parallel-size", "2"], 1, port)
    time.sleep(0.5)
    env_backup = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        server = SparrowServer(sparrow_binary, model, "--kv-cache-memory", "64MiB", "--tensor-parallel-size", "2")
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    try:
        assert children(server.process.pid) == [], "under a launcher rank 0 starts no workers"
        got = [run_alone(server.client(timeout=120), r) for r in requests]
        assert got == expected
        assert server.stop() == 0, server.output()
        assert worker.wait(30) == 0, worker.stderr.read()
        assert worker.stdout.read() == "", "a worker prints nothing"
    finally:
        for p in (server.process, worker):
            if p.poll() is None:
                p.kill()


def test_a_launched_worker_whose_rank_0_dies_exits_with_an_error(sparrow_binary, test_model):
    model = test_model("minimax_m3")
    port = free_port()
    args = ["serve", str(model), "--port", "0", "--kv-cache-memory", "64MiB", "--tensor-parallel-size", "2"]
    worker = launched(sparrow_binary, args, 1, port)
    rank0 = launched(sparrow_binary, args, 0, port)
    try:
        started = wait_until(lambda: rank0.poll() is not None or "on http://" in (rank0.stdout.readline() or ""),
                             timeout_s=120)
        assert started and rank0.poll() is None, rank0.stderr.read()
        rank0.kill()
        rank0.wait()
        code = worker.wait(60)
        assert code != 0
        assert "tensor-parallel rank 1 of 2" in worker.stderr.read()
    finally:
        for p in (rank0, worker):
            if p.poll() is None:
                p.kill()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (Debian's openmpi-bin)")
def test_mpirun_starts_the_ranks(sparrow_binary):
    # The bundled (trained) Kimi K3: its routing has clear margins, so the ranks' rounding (partial sums
    # all-reduced) cannot flip an expert choice as it can on a random fixture, where one flipped token moves
    # the perplexity by ~1e-4. A wrong shard moves it by orders of magnitude more.
    model = Path(__file__).resolve().parents[2] / "models" / "kimi_k3"
    text = Path(__file__).resolve().parents[1] / "data" / "perplexity" / "imghdr.py.txt"
    command = [sparrow_binary, "perplexity", "--model", str(model), "--file", str(text), "--context", "256"]
    single = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    # Open MPI sets the rank and the size (OMPI_COMM_WORLD_*), not the rendezvous: --master-addr.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launched = subprocess.run(["mpirun", "--oversubscribe", "-np", "2", *command, "--tensor-parallel-size", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
                              capture_output=True, text=True, timeout=300, env=env)
    assert launched.returncode == 0, launched.stderr
    want, got = json.loads(single.stdout), json.loads(launched.stdout)  # rank 1 prints nothing
    assert got["tokens"] == want["tokens"]
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)


def test_two_nodes_without_a_launcher(sparrow_binary, test_model, start_server):
    """vLLM's --nnodes / --node-rank / --headless: each "node" (here two process trees on one machine) starts its
    own two ranks of four; node 0 serves, node 1 runs ranks only and prints nothing."""
    model = test_model("minimax_m3")
    requests = make_requests(seed=11)[:6]
    single = start_server("--kv-cache-memory", "64MiB", model=model)
    expected = [run_alone(single.client(timeout=120), r) for r in requests]

    common = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port())]
    node1 = subprocess.Popen([sparrow_binary, "serve", str(model), "--kv-cache-memory", "64MiB", *common,
                              "--node-rank", "1", "--headless"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        server = SparrowServer(sparrow_binary, model, "--kv-cache-memory", "64MiB", *common)
        assert len(children(server.process.pid)) == 1, "node 0 starts its second rank"
        assert len(children(node1.pid)) == 1, "node 1 starts its second rank"
        got = [run_alone(server.client(timeout=120), r) for r in requests]
        assert got == expected
        assert server.stop() == 0, server.output()
        assert node1.wait(30) == 0, node1.stderr.read()
        assert node1.stdout.read() == "", "a headless node prints nothing"
    finally:
        for p in ([server.process] if server else []) + [node1]:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("flags,message", [
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"], "add --headless"),
    (["-tp", "2", "--headless", "--master-addr", "127.0.0.1"], "--headless is for the nodes after the first"),
    (["-tp", "3", "--nnodes", "2", "--master-addr", "127.0.0.1"], "does not split evenly over --nnodes 2"),
    (["-tp", "2", "--nnodes", "2"], "give --master-addr"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless", "--master-addr", "127.0.0.1"],
     "--node-rank 2 is not one of the 2 nodes"),
])
def test_node_flags_that_do_not_fit_are_refused(sparrow_binary, test_model, flags, message):
    run = subprocess.run([sparrow_binary, "serve", str(test_model("minimax_m3")), "--port", "0", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    assert message in run.stderr, run.stderr


def test_an_idle_server_outlives_the_collective_timeout(sparrow_binary, test_model, monkeypatch):
    """A worker waits for its next step plan as long as the server is idle: only a step's collectives time out
    (SPARROW_DISTRIBUTED_TIMEOUT_S, here 2 s instead of 300)."""
    monkeypatch.setenv("SPARROW_DISTRIBUTED_TIMEOUT_S", "2")
    model = test_model("kimi_linear")
    server = SparrowServer(sparrow_binary, model, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                           "--tensor-parallel-size", "2")
    request = make_requests(seed=5)[0]
    try:
        first = run_alone(server.client(timeout=60), request)
        time.sleep(5)  # idle for longer than the timeout
        assert server.process.poll() is None, server.output()
        assert run_alone(server.client(timeout=60), request) == first
        assert server.stop() == 0, server.output()
    finally:
        if server.process.poll() is None:
            server.process.kill()


# --data-parallel-size (docs/parallel.md, "Data parallelism"): two groups, each an engine with its own requests,
# cache and steps, the routed experts split over both (dealt out whole with -ep, else inside each expert), and
# with tensor parallelism inside each group (-dp 2 -tp 2: four processes). Rank 0's server hands each request to
# the group with the fewest unfinished sequences.
@pytest.mark.parametrize("family,layout", [(f, ("-dp", "2", "-ep")) for f in sorted(KV_CACHE_MEMORY)] +
                         [("deepseek_v32", ("-dp", "2")), ("kimi_k3_1_pro", ("-dp", "2", "-tp", "2", "-ep"))])
def test_data_parallel_groups_serve_what_one_process_serves(start_server, test_model, family, layout):
    model = test_model(family)
    single = start_server(*squeezed(KV_CACHE_MEMORY[family]), model=model)
    requests = make_requests(seed=2023)[:REQUESTS]
    expected = [run_alone(single.client(timeout=120), r) for r in requests]
    blocks = int(single.metrics()["sparrow:kv_cache_blocks_total"])

    # Each group holds about half the requests in half the rows: squeezed alike.
    groups = start_server(*squeezed(KV_CACHE_MEMORY[family]), "--num-gpu-blocks-override", str(blocks // 2), *layout,
                          model=model)
    processes = 2 * (2 if "-tp" in layout else 1)
    assert len(children(groups.process.pid)) == processes - 1, "rank 0 starts every other rank"
    client = groups.client(timeout=180)
    results = stream_all(client, requests, join_s=300)
    assert len(results) == REQUESTS, "some requests did not finish"
    mismatches = differences_from_solo(results, expected)
    assert not mismatches, f"{len(mismatches)} requests differ from the single-process server: {mismatches[:3]}"
    again = [run_alone(client, r) for r in requests[:4]]
    assert again == expected[:4]
    # Both groups' engines report (their caches add up), both took requests, and nothing is left held.
    metrics = groups.metrics()
    handed = [metrics[f'sparrow:data_parallel_requests_total{{group="{g}"}}'] for g in (0, 1)]
    assert sum(handed) == REQUESTS + 4 and min(handed) >= REQUESTS // 4, handed
    assert metrics["sparrow:kv_cache_blocks_total"] == 2 * (blocks // 2)
    assert metrics["vllm:num_preemptions_total"] > 0, "nothing was preempted: the squeeze lost its point"
    assert wait_until(lambda: groups.metrics()["sparrow:kv_cache_blocks_used"] == 0, timeout_s=10), groups.metrics()
    assert groups.stop() == 0, groups.output()
    assert single.stop() == 0, single.output()


def test_a_dead_data_parallel_group_ends_the_server(sparrow_binary, test_model):
    server = SparrowServer(sparrow_binary, test_model("minimax_m3"), "--kv-cache-memory", "64MiB", "-dp", "2")
    leader = children(server.process.pid)[0]
    request = make_requests(seed=3)[0]
    run_alone(server.client(timeout=60), request)
    os.kill(leader, signal.SIGKILL)
    try:
        code = server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        pytest.fail("the server kept running without its second group\n" + server.output())
    assert code != 0
    # Whoever notices first says so: the supervisor (the rank it started was killed), the link to the group
    # (its leader is gone), or a step's meeting with it (a peer died).
    reasons = (f"tensor-parallel rank 1 (pid {leader}) was killed by signal 9", "group 1's leader is gone",
               "(a peer died or timed out); stopping the run")
    wait_until(lambda: any(r in server.output() for r in reasons), timeout_s=5)
    assert any(r in server.output() for r in reasons), server.output()


def test_an_idle_data_parallel_server_waits_and_stops(sparrow_binary, test_model, monkeypatch):
    """Idle groups stop meeting (no step timeout while nobody asks), then a request wakes every group; SIGTERM
    stops every rank."""
    monkeypatch.setenv("SPARROW_DISTRIBUTED_TIMEOUT_S", "2")
    server = SparrowServer(sparrow_binary, test_model("deepseek_v32"), "--kv-cache-memory", "64MiB", "-dp", "2", "-ep")
    ranks = children(server.process.pid)
    request = make_requests(seed=5)[0]
    try:
        first = run_alone(server.client(timeout=60), request)
        time.sleep(5)  # idle for longer than the timeout
        assert server.process.poll() is None, server.output()
        assert [run_alone(server.client(timeout=60), request) for _ in range(3)] == [first] * 3
        assert server.stop() == 0, server.output()
        assert wait_until(lambda: not any(alive(p) for p in ranks), timeout_s=10), "a group outlived the server"
    finally:
        if server.process.poll() is None:
            server.process.kill()
