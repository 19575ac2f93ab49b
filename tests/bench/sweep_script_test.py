#!/usr/bin/env python3
"""bench/sweep.sh end to end on the CPU: the bundled model's config as the shape, dummy weights, a tiny
random workload at concurrencies 1 and 2, sparrow's sweep and a vLLM peer played by tests/bench/fake_vllm.sh
(sparrow serving the same folder on vLLM's port), then the same with SPARROW_SWEEP=0 (the peer alone) on another
PEER_PORT.
The two sweeps' JSONs also go through tools/sweep_table.py (serve.md's tables), with a point that failed whole.

  python3 tests/bench/sweep_script_test.py --sparrow build/sparrow
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sweep(sparrow, out, **env):
    argv = os.path.join(out, "vllm-argv.txt")
    full = dict(os.environ, OUT=out, SPARROW=sparrow, DEVICE="cpu", MODELS=os.path.join(out, "models"),
                CONCURRENCIES="1,2", ISL="72", OSL="4", PROMPTS_PER_CONCURRENCY="1", NUM_WARMUPS="0",
                KV_MEMORY="1GiB", MAX_MODEL_LEN="128", LAUNCH_TIMEOUT="120", PEERS="vllm",
                VLLM=os.path.join(ROOT, "tests/bench/fake_vllm.sh"), FAKE_VLLM_ARGV=argv, **env)
    run = subprocess.run(["bash", os.path.join(ROOT, "bench/sweep.sh"), os.path.join(ROOT, "models/minimax_m3/config.json")],
                         env=full, cwd=ROOT, capture_output=True, text=True, timeout=600)
    shape_dir = os.path.join(out, "minimax_m3-config")
    log = open(os.path.join(shape_dir, "sweep.log")).read() if os.path.exists(os.path.join(shape_dir, "sweep.log")) else ""
    assert run.returncode == 0, f"sweep.sh failed ({run.returncode}):\n{run.stderr}\n{log[-3000:]}"
    with open(argv) as f:
        vllm_args = f.read().split("\n")
    with open(argv + ".routing") as f:
        vllm_args.append("routing=" + f.read())
    return shape_dir, vllm_args, log


def points(path):
    with open(path) as f:
        sweep = json.load(f)
    return sweep, {p["concurrency"]: p for p in sweep["points"]}


def check_table(ours_path, peer_path, out):
    """tools/sweep_table.py on both sweeps and on a peer whose server died: one row per point, the engine's
    counters in sparrow's rows, the failed points without figures."""
    with open(peer_path) as f:
        peer = json.load(f)
    peer["points"].append({"concurrency": 4, "completed": 0, "failed": 4, "num_prompts": 4})
    peer["points"].append({"concurrency": 8, "completed": 0, "error": "cannot read the served model; is it up?"})
    dead = os.path.join(out, "dead-peer.json")
    with open(dead, "w") as f:
        json.dump(peer, f)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools/sweep_table.py"), "--engine", "sparrow", ours_path,
                          "--engine", "peer", dead], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("sparrow", "1", "1 of 1"), ("sparrow", "2", "2 of 2"), ("peer", "1", "1 of 1"), ("peer", "2", "2 of 2"),
        ("peer", "4", "0 of 4"), ("peer", "8", "none: cannot read the served model")], run.stdout
    for r in rows[:4]:
        assert float(r[5].replace(",", "")) > 0 and r[9].endswith("%"), r  # tok/s per user and its share of the roofline
    assert all(rows[i][12] and rows[i][14] for i in (0, 1)), rows[:2]  # sparrow's decode step time and prefill steps
    for r in rows[:4]:  # the random workload's serving limit (prefill included) and its share
        assert float(r[10].replace(",", "")) > 0 and r[11].endswith("%"), r
    assert not any(rows[4][3:]) and not any(rows[5][3:]), rows[4:]
    # A folder of per-concurrency results (the HF peer's) borrows the first sweep's limits at its concurrency.
    results = os.path.join(out, "hf")
    os.makedirs(results)
    with open(os.path.join(results, "hf-concurrency2.json"), "w") as f:
        json.dump({"max_concurrency": 2, "num_prompts": 2, "completed": 2, "failed": 0, "median_ttft_ms": 900.0,
                   "median_tpot_ms": 100.0, "total_token_throughput": 50.0, "output_throughput": 5.0}, f)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools/sweep_table.py"), "--engine", "sparrow", ours_path,
                          "--engine", "hf", results], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()[2:]]
    assert rows[-1][:8] == ["hf", "2", "2 of 2", "900", "100.00", "10.0", "50", "5"], rows[-1]
    assert rows[-1][8] == rows[1][8] and rows[-1][9] == f"{100 * 10.0 / float(rows[1][8].replace(',', '')):.0f}%", rows
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools/sweep_table.py"), os.path.join(out, "missing.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "missing.json" in bad.stderr, (bad.returncode, bad.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sparrow", required=True)
    args = ap.parse_args()
    sparrow = os.path.abspath(args.sparrow)

    with tempfile.TemporaryDirectory() as out:
        shape_dir, vllm_args, log = sweep(sparrow, out, KV_CACHE_DTYPE="bfloat16", VLLM_ARGS="--enforce-eager")
        ours, ours_points = points(os.path.join(shape_dir, "sweep-sparrow.json"))
        peer, peer_points = points(os.path.join(shape_dir, "sweep-vllm.json"))
        for sweep_json, pts in ((ours, ours_points), (peer, peer_points)):
            assert sorted(pts) == [1, 2], pts.keys()
            for c, p in pts.items():
                assert p["completed"] == c and p["failed"] == 0, (sweep_json["label"], c, p["completed"], p["failed"])
                assert p["roofline"]["tokens_per_s_per_user"] > 0
                # Prefill counted: the serving limit is never above the decode roofline.
                assert 0 < p["serving_limit"]["tokens_per_s_per_user"] <= p["roofline"]["tokens_per_s_per_user"]
            # The cache format reaches the roofline of both sweeps (and sparrow's server: see the launch).
            assert sweep_json["kv_cache_dtype"] == "bfloat16", sweep_json["kv_cache_dtype"]
        assert ours["label"] == "sparrow" and peer["label"] == "vllm"
        assert "--kv-cache-dtype bfloat16" in ours["launch"], ours["launch"]
        # Both engines run the same step token budget (vLLM's default unless MAX_NUM_BATCHED_TOKENS says).
        assert "--max-num-batched-tokens 8192" in ours["launch"], ours["launch"]
        # vLLM got the folder, dummy weights, the sweep's limits, then VLLM_ARGS.
        model = os.path.join(out, "models", "minimax_m3-config")
        assert vllm_args[:2] == ["serve", model], vllm_args
        for flag, value in (("--load-format", "dummy"), ("--port", "8100"), ("--max-model-len", "128"),
                            ("--max-num-batched-tokens", "8192")):
            assert vllm_args[vllm_args.index(flag) + 1] == value, (flag, vllm_args)
        assert "--enforce-eager" in vllm_args, vllm_args
        # vLLM's dummy weights route nearly every token to the same experts: both engines draw them uniformly.
        assert vllm_args[-1] == "routing=uniform_random", vllm_args
        assert "--moe-routing-simulation uniform_random" in ours["launch"], ours["launch"]
        # vLLM's untimed warm pass ran first, at the same points with another seed: the measured prompts (72
        # tokens, a whole 64-token block each) find nothing of it, nor of each other, in the prefix cache.
        warm, warm_points = points(os.path.join(shape_dir, "sweep-vllm-warm-pass.json"))
        assert sorted(warm_points) == [1, 2] and warm["workload"]["seed"] == 1000, warm["workload"]
        for sweep_json, pts in ((ours, ours_points), (peer, peer_points)):
            assert [pts[c]["seed"] for c in (1, 2)] == [0, 1], sweep_json["label"]
            assert all(p["prefix_cache_hit_rate"] == 0 for p in pts.values()), (sweep_json["label"], pts)
        check_table(os.path.join(shape_dir, "sweep-sparrow.json"), os.path.join(shape_dir, "sweep-vllm.json"), out)

    with tempfile.TemporaryDirectory() as out:
        shape_dir, vllm_args, log = sweep(sparrow, out, SPARROW_SWEEP="0", PEER_PORT="8350", PEER_WARM_PASS="0",
                                          MOE_ROUTING="own")
        assert not os.path.exists(os.path.join(shape_dir, "sweep-sparrow.json")), "SPARROW_SWEEP=0 still ran sparrow"
        assert "== sparrow" not in log
        assert not os.path.exists(os.path.join(shape_dir, "sweep-vllm-warm-pass.json")), "PEER_WARM_PASS=0 still warmed"
        _, peer_points = points(os.path.join(shape_dir, "sweep-vllm.json"))
        assert sorted(peer_points) == [1, 2]
        assert vllm_args[vllm_args.index("--port") + 1] == "8350", vllm_args  # a second sweep beside the first
        assert vllm_args[-1] == "routing=", vllm_args  # MOE_ROUTING=own: vLLM's own (empty: no simulation)
    print("sweep_script_test: ok")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"sweep_script_test: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
