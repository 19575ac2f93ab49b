#!/usr/bin/env python3
"""The HF transformers peer of the serving sweep (issue 8, docs/bench.md "The HF transformers peer").

What a user without a serving engine reaches for: the model loaded with transformers and the workload
run through `model.generate` in static batches of up to CONCURRENCY requests (a batch starts when the
previous one has finished; prompts left-padded; greedy, or sampling at the workload's temperature;
max_new_tokens = the longest output of the batch, min_new_tokens equal to it under --ignore-eos, each
request counted up to its own output length or its first EOS). Every step's tokens reach a streamer, whose
host timestamps give each request's TTFT (batch start -> its first new token: the request is "sent" when
its batch starts, as a client's request is sent when a concurrency slot frees), its inter-token gaps and
its end. One result file per concurrency with `vllm bench serve --save-result`'s fields, which
tools/plot_sweep.py reads as a peer (`--peer hf=DIR`).

Two modes:

  run      hf_serve_peer.py run MODEL_DIR [--dummy] --concurrencies 1,2,4 (--requests FILE | --random-...)
  capture  hf_serve_peer.py capture --port 8200 --output FILE
           a stand-in OpenAI server that records the requests `sparrow bench serve` sends (answering each
           with one token), so `run --requests FILE` replays exactly sparrow's workload:

    python3 bench/peers/hf_serve_peer.py capture --port 8200 --output reqs.jsonl &
    sparrow bench serve --base-url http://127.0.0.1:8200 --tokenizer MODEL --random-input-len 8192 \
        --random-output-len 1024 --ignore-eos --num-prompts 1024 --max-concurrency 1 --disable-tqdm
    kill %1
    python3 bench/peers/hf_serve_peer.py run MODEL --dummy --requests reqs.jsonl \
        --concurrencies 1,2,4,8 --prompts-per-concurrency 4 --result-dir out/hf

--max-concurrency 1 keeps the captured order equal to the workload's order; sparrow's random workload
of N prompts is the first N of a longer one with the same seed, so one capture of max(concurrency) x
prompts-per-concurrency prompts serves every point (point c takes the first c x K requests, as many as
`sparrow bench sweep` sends at point c; the sweep draws each point's prompts with its own seed, which
changes nothing here: generate() keeps no prefix cache, and the lengths are the same).

The requests file: JSON lines (or one JSON list) of objects with `prompt` (text, or a list of token
ids) or `messages` (chat; rendered with the tokenizer's chat template), `max_tokens` (or
`max_completion_tokens`), and optionally `ignore_eos`, `min_tokens`, `temperature`. --random-input-len /
--random-output-len / --num-prompts / --seed make a self-contained workload instead: random token-id
prompts (uniform over the vocabulary, no special ids) from Python's RNG -- the same lengths as sparrow's
random workload but NOT the same prompts (sparrow's generator is C++, src/bench/workloads.cpp).
"""
import argparse
import datetime
import json
import math
import os
import random
import sys
import threading
import time


# ----------------------------------------------------------------------------------------------------------
# Statistics as sparrow bench serve / vLLM compute them (numpy's linear percentiles, population std)
# ----------------------------------------------------------------------------------------------------------

def percentile(values, q):
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def stats(name, values_s, out, percentiles=(90, 99)):
    ms = [x * 1000.0 for x in values_s]
    mean = sum(ms) / len(ms) if ms else 0.0
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = percentile(ms, 50)
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)) if ms else 0.0
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)


# ----------------------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------------------

def load_requests(path):
    with open(path) as f:
        text = f.read()
    text = text.strip()
    if text.startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i, r in enumerate(items):
        max_tokens = r.get("max_tokens", r.get("max_completion_tokens"))
        if max_tokens is None or ("prompt" not in r and "messages" not in r):
            raise SystemExit(f"{path}: request {i} needs prompt or messages, and max_tokens")
        out.append(r)
    return out


def random_requests(args, tokenizer, vocab_size, count):
    """Token-id prompts with vLLM's random-dataset lengths (not sparrow's prompts: see the docstring)."""
    rng = random.Random(args.seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    r = args.random_range_ratio

    def draw(n, minimum):
        return rng.randint(max(minimum, math.floor(n * (1 - r))), math.ceil(n * (1 + r)))

    def token():
        while True:
            t = rng.randrange(vocab_size)
            if t not in special:
                return t

    prefix = [token() for _ in range(args.random_prefix_len)]
    out = []
    for _ in range(count):
        n_in = draw(args.random_input_len, 0 if prefix else 1)
        out.append({"prompt": prefix + [token() for _ in range(n_in)], "max_tokens": draw(args.random_output_len, 1),
                    "ignore_eos": args.ignore_eos, "temperature": args.temperature})
    return out


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------

# Config model types transformers does not register, and the registered type that implements them.
MODEL_TYPE_ALIASES = {"minimax_m3": "minimax_m3_vl_text"}


def load_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    kwargs = {"trust_remote_code": args.trust_remote_code}
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    with open(os.path.join(args.model, "config.json")) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    config = None
    if model_type in MODEL_TYPE_ALIASES:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "_comment")}
        config = CONFIG_MAPPING[MODEL_TYPE_ALIASES[model_type]](**raw)
    if args.dummy:
        if config is None:
            config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        # Random init from the config alone (transformers' own initialisation), in the serving dtype: an
        # FP8 quantization_config would need the FP8 weights it describes, so the dummy model is bf16.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device(args.device):  # initialised where it runs: no host copy of a 60 GB shape
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    else:
        if config is not None:
            kwargs["config"] = config
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **kwargs)
    model.to(args.device).eval()  # (device_map= would need accelerate)

    tokenizer = None
    tok_dir = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=args.trust_remote_code)
        tokenizer.padding_side = "left"
    except Exception as e:  # a config-only folder: token-id prompts still run
        print(f"hf_serve_peer: no tokenizer in {tok_dir} ({type(e).__name__}): only token-id prompts", file=sys.stderr)
    return model, tokenizer


def chat_messages(messages):
    """OpenAI messages as HF chat templates take them: tool-call arguments as objects, not JSON strings
    (what vLLM's and sparrow's servers do before rendering)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                                    if isinstance(c.get("function", {}).get("arguments"), str) else c
                                    for c in m["tool_calls"]])
        out.append(m)
    return out


def encode(request, tokenizer):
    if "messages" in request:
        if tokenizer is None:
            raise SystemExit("chat requests need a tokenizer")
        ids = tokenizer.apply_chat_template(chat_messages(request["messages"]), tools=request.get("tools"), add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    prompt = request["prompt"]
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise SystemExit("text prompts need a tokenizer (give --tokenizer, or token-id prompts)")
    # As vLLM's /v1/completions: the tokenizer's special tokens (BOS) are added.
    return tokenizer(prompt)["input_ids"]


class StepClock:
    """A streamer that timestamps every decoding step. generate() hands it the prompt first, then each
    step's new tokens (batch,), copied to the host -- a device sync -- just before the call."""

    def __init__(self):
        self.times, self.tokens, self.prompt_seen = [], [], False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.tokens.append(value.reshape(-1).tolist())
        self.times.append(now)

    def end(self):
        pass


def run_batch(model, batch, args, pad_id, eos_ids):
    import torch

    lengths = [len(ids) for ids, _ in batch]
    width = max(lengths)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (ids, _) in enumerate(batch):  # left padding: every prompt ends at the last column
        if ids:
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids):] = 1
    reqs = [r for _, r in batch]
    out_lens = [int(r.get("max_tokens", r.get("max_completion_tokens"))) for r in reqs]
    ignore_eos = [bool(r.get("ignore_eos", args.ignore_eos)) or int(r.get("min_tokens", 0) or 0) >= o
                  for r, o in zip(reqs, out_lens)]
    temperature = float(reqs[0].get("temperature", args.temperature) or 0.0)
    max_new = max(out_lens)
    gen = dict(max_new_tokens=max_new, pad_token_id=pad_id, streamer=StepClock(), use_cache=True)
    if all(ignore_eos):
        gen["min_new_tokens"] = max_new
    if temperature > 0:
        gen.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
    else:
        gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if eos_ids and not all(ignore_eos):
        gen["eos_token_id"] = eos_ids
    gen.update(args.generate_kwargs)
    clock = gen["streamer"]
    device = model.device
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), **gen)
    end = time.perf_counter()

    results = []
    for i, (n_in, n_out) in enumerate(zip(lengths, out_lens)):
        times = []
        for step, (t, toks) in enumerate(zip(clock.times, clock.tokens)):
            if len(times) >= n_out:
                break
            times.append(t)
            if not ignore_eos[i] and toks[i] in eos_ids:
                break
        r = {"input_len": n_in, "output_len": len(times), "start": start, "error": ""}
        if times:
            r["ttft"] = times[0] - start
            r["itl"] = [b - a for a, b in zip(times, times[1:])]
            r["latency"] = times[-1] - start
        else:
            r["error"] = "no output"
        results.append(r)
    return results, start, end


def run_point(model, tokenizer, encoded, concurrency, args):
    pad_id = None
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = getattr(model.config, "pad_token_id", None)
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0

    results = []
    t0 = time.perf_counter()
    import torch

    for b in range(0, len(encoded), concurrency):  # static batching: the next batch waits for this one
        try:
            res, _, _ = run_batch(model, encoded[b:b + concurrency], args, pad_id, eos_ids)
        except torch.OutOfMemoryError as e:  # the batch does not fit: this point and every larger one fail
            torch.cuda.empty_cache()
            why = f"out of memory at batch {concurrency}: {str(e).splitlines()[0]}"
            res = [{"input_len": len(ids), "output_len": 0, "start": time.perf_counter(), "error": why}
                   for ids, _ in encoded[b:]]
            results += res
            break
        results += res
        if args.verbose:
            print(f"  batch {b // concurrency}: {len(res)} requests, {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    duration = time.perf_counter() - t0
    return summarize(results, t0, duration, concurrency, args)


def summarize(results, t0, duration, concurrency, args):
    ok = [r for r in results if not r["error"]]
    total_in = sum(r["input_len"] for r in ok)
    total_out = sum(r["output_len"] for r in ok)
    ttfts = [r["ttft"] for r in ok]
    tpots = [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]
    itls = [g for r in ok for g in r["itl"]]
    e2els = [r["latency"] for r in ok]
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "hf-transformers",
        "label": args.label,
        "model_id": os.path.basename(os.path.normpath(args.model)),
        "tokenizer_id": args.tokenizer or args.model,
        "load_format": "dummy" if args.dummy else "auto",
        "dtype": args.dtype,
        "batching": "static (model.generate, left padding)",
        "dataset_name": "requests-file" if args.requests else "random-token-ids",
        "num_prompts": len(results),
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "seed": args.seed,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    stats("ttft", ttfts, out)
    stats("tpot", tpots, out)
    stats("itl", itls, out)
    stats("e2el", e2els, out)
    out.update({
        "input_lens": [r["input_len"] for r in results],
        "output_lens": [r["output_len"] for r in results],
        "ttfts": [r.get("ttft", 0.0) for r in results],
        "itls": [r.get("itl", []) for r in results],
        "latencies": [r.get("latency", 0.0) for r in results],
        "start_times": [r["start"] - t0 for r in results],
        "errors": [r["error"] for r in results],
    })
    return out


def cmd_run(args):
    import torch

    torch.manual_seed(args.seed)
    concurrencies = [int(c) for c in args.concurrencies.split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("--concurrencies: positive integers, e.g. 1,2,4")
    counts = {c: (args.num_prompts if args.fixed_num_prompts else c * args.prompts_per_concurrency) for c in concurrencies}
    needed = max(counts.values())
    model, tokenizer = load_model(args)
    if args.requests:
        requests = load_requests(args.requests)
        if len(requests) < needed:
            print(f"hf_serve_peer: {args.requests} has {len(requests)} requests, fewer than the {needed} the largest "
                  f"point asks for: points use at most {len(requests)}", file=sys.stderr)
    else:
        vocab = getattr(model.config, "vocab_size", None) or model.get_input_embeddings().weight.shape[0]
        requests = random_requests(args, tokenizer, vocab, needed)
    encoded = [(encode(r, tokenizer), r) for r in requests[:needed]]

    if not args.no_warmup:  # the first generate pays for kernel loading / autotuning, as a server's start-up does
        ids = encoded[0][0][:16] or [0]
        run_batch(model, [(ids, {"max_tokens": 2, "ignore_eos": True, "temperature": 0})], args,
                  0 if tokenizer is None or tokenizer.pad_token_id is None else tokenizer.pad_token_id, [])

    os.makedirs(args.result_dir, exist_ok=True)
    for c in concurrencies:
        result = run_point(model, tokenizer, encoded[:counts[c]], c, args)
        if not result["completed"]:
            print(f"{args.label} c={c}: no request completed ({result['errors'][0]}); larger batches skipped", flush=True)
            with open(os.path.join(args.result_dir, f"{args.label}-concurrency{c}.json"), "w") as f:
                json.dump(result, f)
            break
        path = os.path.join(args.result_dir, f"{args.label}-concurrency{c}.json")
        with open(path, "w") as f:
            json.dump(result, f)
        tpot = result["median_tpot_ms"]
        print(f"{args.label} c={c}: {result['completed']}/{result['num_prompts']} requests in {result['duration']:.2f} s, "
              f"TTFT median {result['median_ttft_ms']:.1f} ms, TPOT median {tpot:.2f} ms "
              f"({1000 / tpot if tpot > 0 else 0:.1f} tok/s/user), {result['total_token_throughput']:.1f} tok/s total, "
              f"{result['output_throughput']:.1f} out -> {path}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# capture: a stand-in OpenAI server that records what a load generator sends
# ----------------------------------------------------------------------------------------------------------

def cmd_capture(args):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    lock = threading.Lock()
    out = open(args.output, "w")
    count = [0]
    kept = ("prompt", "messages", "tools", "max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos",
            "temperature")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send_json(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.startswith("/v1/models"):
                self.send_json(200, {"object": "list", "data": [{"id": args.model_name, "object": "model"}]})
            else:
                self.send_json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(n) or b"{}")
            chat = self.path.startswith("/v1/chat/completions")
            if not (chat or self.path.startswith("/v1/completions")):
                return self.send_json(404, {"error": {"message": "not found"}})
            with lock:
                out.write(json.dumps({k: body[k] for k in kept if k in body}) + "\n")
                out.flush()
                count[0] += 1
                done = args.count and count[0] >= args.count
            # One token, then the usage chunk and [DONE]: a well-formed, instant stream.
            delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
            events = [{"choices": [dict(index=0, finish_reason="length", **delta)]},
                      {"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}]
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            data = data.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if done:
                threading.Thread(target=server.shutdown, daemon=True).start()

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"hf_serve_peer capture: listening on http://{args.host}:{server.server_address[1]}, writing {args.output}",
          flush=True)
    import signal
    signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    out.close()
    print(f"hf_serve_peer capture: {count[0]} requests in {args.output}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a workload through model.generate, one result file per concurrency")
    run.add_argument("model", help="model folder (HF checkpoint, or config.json only with --dummy)")
    run.add_argument("--dummy", action="store_true", help="random weights from config.json (transformers' init)")
    run.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    run.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    run.add_argument("--dtype", default="bfloat16", help="torch dtype of the weights (default bfloat16)")
    run.add_argument("--attn-implementation", default=None, help="transformers' attn_implementation (default: its own)")
    run.add_argument("--trust-remote-code", action="store_true")
    run.add_argument("--concurrencies", default="1,2,4,8,16,32,64,128,256", help="batch sizes, one result file each")
    run.add_argument("--prompts-per-concurrency", type=int, default=10,
                     help="point c runs the first c x K requests (sparrow bench sweep's default K, 10)")
    run.add_argument("--num-prompts", type=int, default=None, help="the same number of requests at every point")
    run.add_argument("--requests", help="requests file (JSON lines or list), e.g. from `capture`")
    run.add_argument("--random-input-len", type=int, default=1024)
    run.add_argument("--random-output-len", type=int, default=128)
    run.add_argument("--random-range-ratio", type=float, default=0.0)
    run.add_argument("--random-prefix-len", type=int, default=0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--ignore-eos", action="store_true", help="every output has its full length (min_new_tokens)")
    run.add_argument("--temperature", type=float, default=0.0, help="for requests that give none (0: greedy)")
    run.add_argument("--generate-kwargs", type=json.loads, default={}, help="more model.generate arguments, as JSON")
    run.add_argument("--no-warmup", action="store_true", help="skip the short generate before the first point")
    run.add_argument("--label", default="hf", help="the curve's name and the result files' prefix")
    run.add_argument("--result-dir", default=".", help="where <label>-concurrency<N>.json go")
    run.add_argument("--verbose", action="store_true")

    cap = sub.add_parser("capture", help="record the requests a load generator sends (a stand-in OpenAI server)")
    cap.add_argument("--host", default="127.0.0.1")
    cap.add_argument("--port", type=int, default=8200)
    cap.add_argument("--output", required=True, help="JSON lines, one request each, in arrival order")
    cap.add_argument("--count", type=int, default=0, help="stop after this many requests (default: on SIGTERM)")
    cap.add_argument("--model-name", default="capture", help="the id /v1/models reports")

    args = ap.parse_args()
    if args.cmd == "capture":
        return cmd_capture(args)
    args.fixed_num_prompts = args.num_prompts is not None
    if args.num_prompts is None:
        args.num_prompts = 0
    return cmd_run(args)


if __name__ == "__main__":
    main()
