#!/usr/bin/env python3
"""bench/peers/hf_serve_peer.py on the CPU with the bundled tiny model (models/minimax_m3): `capture` records
requests posted as sparrow bench serve posts them, `run --requests` replays them at concurrencies 1 and 2
(and through a Kimi-Linear model built by --dummy from a config alone), and tools/plot_sweep.py reads the
result files as a peer. Exits 77 (skipped) without torch / transformers.

  python3 tests/hf_serve_peer_test.py
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEER = os.path.join(ROOT, "bench", "peers", "hf_serve_peer.py")
MODEL = os.path.join(ROOT, "models", "minimax_m3")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def main():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        return 77
    tmp = tempfile.mkdtemp(prefix="hf_serve_peer_")
    requests_file = os.path.join(tmp, "requests.jsonl")

    # capture: three completions requests, with the body sparrow's client sends (serve_bench.cpp request_body)
    port = free_port()
    cap = subprocess.Popen([sys.executable, PEER, "capture", "--port", str(port), "--count", "3",
                            "--output", requests_file], stdout=subprocess.PIPE, text=True)
    for _ in range(100):
        try:
            models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read())
            break
        except OSError:
            time.sleep(0.1)
    assert models["data"][0]["id"] == "capture", models
    prompts = ["The quick brown fox", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], "jumps over the lazy dog again and"]
    for i, prompt in enumerate(prompts):
        stream = post(port, "/v1/completions", {"model": "capture", "prompt": prompt, "max_tokens": 3 + i,
                                                "temperature": 0.0, "stream": True,
                                                "stream_options": {"include_usage": True},
                                                "ignore_eos": True, "min_tokens": 3 + i})
        assert stream.rstrip().endswith("data: [DONE]"), stream
    assert cap.wait(timeout=10) == 0
    captured = [json.loads(line) for line in open(requests_file)]
    assert [r["prompt"] for r in captured] == prompts and [r["max_tokens"] for r in captured] == [3, 4, 5], captured

    # run: the captured requests through model.generate at concurrency 1 and 2
    out = os.path.join(tmp, "hf")
    subprocess.run([sys.executable, PEER, "run", MODEL, "--device", "cpu", "--dtype", "float32", "--requests",
                    requests_file, "--concurrencies", "1,2", "--num-prompts", "3", "--result-dir", out],
                   check=True, timeout=120)
    for c in (1, 2):
        r = json.load(open(os.path.join(out, f"hf-concurrency{c}.json")))
        assert r["max_concurrency"] == c and r["completed"] == 3 and r["failed"] == 0, r
        assert r["output_lens"] == [3, 4, 5], r["output_lens"]  # ignore_eos: every output at its max_tokens
        assert r["total_output_tokens"] == 12 and r["total_input_tokens"] == sum(r["input_lens"]) > 10
        assert r["input_lens"][1] == 10  # token-id prompts go in as they are
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "median_ttft_ms",
                    "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
            assert r[key] > 0, key
        for ttft, itl, e2el, n in zip(r["ttfts"], r["itls"], r["latencies"], r["output_lens"]):
            assert 0 < ttft <= e2el and len(itl) == n - 1 and abs(ttft + sum(itl) - e2el) < 1e-6
        # static batching: at concurrency 2 the third request starts when the first batch has finished
        if c == 2:
            assert r["start_times"][0] == r["start_times"][1] < r["start_times"][2]

    # --dummy from a config alone, for the Kimi family's peer shape (bench/shapes/serve/kimi_linear_48b.json):
    # the kimi_linear fixture's config (KDA + MLA + MoE), random weights, the bundled tokenizer.
    kimi = os.path.join(tmp, "kimi_linear")
    os.makedirs(kimi)
    with open(os.path.join(ROOT, "tests", "fixtures", "kimi_linear", "config.json")) as f:
        config = json.load(f)
    config["vocab_size"] = 4096  # the bundled tokenizer's ids (the serve shapes' vocabularies hold them too)
    with open(os.path.join(kimi, "config.json"), "w") as f:
        json.dump(config, f)
    kimi_out = os.path.join(tmp, "hf-kimi")
    subprocess.run([sys.executable, PEER, "run", kimi, "--dummy", "--tokenizer", MODEL, "--device", "cpu",
                    "--dtype", "float32", "--requests", requests_file, "--concurrencies", "2", "--num-prompts", "3",
                    "--result-dir", kimi_out], check=True, timeout=120)
    r = json.load(open(os.path.join(kimi_out, "hf-concurrency2.json")))
    assert r["completed"] == 3 and r["output_lens"] == [3, 4, 5] and r["load_format"] == "dummy", r

    # the plot reads them as a peer curve
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plot_sweep
    curve = plot_sweep.load_curve("hf", out, 1, "median")
    assert [p["concurrency"] for p in curve["points"]] == [1, 2] and all(p["x"] > 0 for p in curve["points"]), curve
    print("hf_serve_peer: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
