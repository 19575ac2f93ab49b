#!/usr/bin/env python3
"""PyTorch peers of sparrow's MoE expert benchmark (src/kernels/cuda/moe/bench.cu, kernel "moe_experts"): the
same models, token counts, routing rule (top_k distinct experts per token, uniform; weights uniform in
[0.1, 1)) and shape strings, bf16 experts, one JSON line per row:
  {"kernel", "shape", "impl", "median_us", "bytes", "flops", "note"}
with bytes and FLOPs counted as bench.cu counts them (the distinct experts' weights, x in, out, the routing;
2 * pairs * 3 * hidden * inter + 4 * pairs * inter + 2 * pairs * hidden).

impl "torch": what a user without a fused kernel writes: sort the (token, slot) pairs by expert, then one
loop over the experts with tokens (counts read on the host), gather, x @ gate_up[e].T, GLU,
@ down[e].T, times the routing weight, index_add_ into an fp32 output.
impl "torch_grouped_mm": the same with both products as one grouped GEMM each (torch.nn.functional.grouped_mm
or torch._grouped_mm, where this torch has it; checked against "torch" once, skipped with a note otherwise).
Timing: CUDA events, L2 flushed before every launch, median of --iters launches after warm-up.
Usage: python3 bench/peers/torch_moe.py [--quick] [--iters N] [--filter moe_experts]
Exits 0 with a '#' note on stderr when torch, CUDA or memory is missing.
"""
import argparse
import json
import sys

try:
    import torch
    import torch.nn.functional as F
except Exception as ex:  # noqa: BLE001 - report and exit cleanly
    print(f"# torch_moe: torch unavailable ({ex})", file=sys.stderr)
    sys.exit(0)

from timing import median_us  # bench/peers/timing.py: the same timing as sparrow's

# name, hidden, moe_intermediate, experts, top_k, glu (bench.cu's kModels)
MODELS = [
    ("deepseek_v3.2", 7168, 2048, 256, 8, "silu"),
    ("kimi_k3.1_pro", 7168, 2048, 896, 8, "silu"),
    ("minimax_m3.1", 6144, 3072, 128, 4, "clamped"),
]
TOKENS = [1, 8, 64, 128, 256, 4096, 16384]
ALPHA, LIMIT = 1.702, 7.0  # MiniMax's swiglu_alpha / swiglu_limit defaults
HBM, PEAK = 4.3e12, 790e12




def glu(gu, inter, kind):
    g, u = gu[:, :inter], gu[:, inter:]
    if kind == "silu":
        return F.silu(g) * u
    g = g.clamp(max=LIMIT)
    u = u.clamp(min=-LIMIT, max=LIMIT)
    return (u + 1) * g * torch.sigmoid(ALPHA * g)


def make_routing(tokens, experts, top_k, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # top_k distinct experts per token, uniform: the first top_k of a random permutation (ranks of noise).
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int64)
    w = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    distinct = int(torch.unique(ids).numel())
    return ids.cuda(), w.to(torch.float32).cuda(), distinct


def moe_loop(x, ids, w, gate_up, down, inter, kind):
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # host sync: the loop needs them
    tok = order // top_k
    wsorted = w.reshape(-1)[order]
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        idx = tok[start:start + c]
        h = glu(x[idx] @ gate_up[e].t(), inter, kind)
        y = (h @ down[e].t()).float() * wsorted[start:start + c, None]
        out.index_add_(0, idx, y)
        start += c
    return out.to(torch.bfloat16)


def grouped_fn():
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        fn = getattr(torch, "_grouped_mm", None)
    return fn


def moe_grouped(gmm, x, ids, w, gate_up, down, inter, kind):
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    tok = order // top_k
    xs = x[tok]
    h = glu(gmm(xs, gate_up.transpose(-2, -1), offs=offs), inter, kind)
    y = gmm(h, down.transpose(-2, -1), offs=offs).float() * w.reshape(-1)[order][:, None]
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(torch.bfloat16)


def emit(shape, impl, us, nbytes, flops, note):
    sec = us * 1e-6
    note = f"{note}; {100 * nbytes / HBM / sec:.0f}% of 4.3 TB/s, {100 * flops / PEAK / sec:.0f}% of 790 TFLOP/s"
    print(json.dumps({"kernel": "moe_experts", "shape": shape, "impl": impl, "median_us": round(us, 3),
                      "bytes": nbytes, "flops": flops, "note": note}), flush=True)


def bench(args):
    models = MODELS[:1] if args.quick else MODELS
    token_counts = [8, 4096] if args.quick else TOKENS
    gmm = grouped_fn()
    if gmm is None:
        print("# torch_moe: no grouped_mm in this torch: torch_grouped_mm rows skipped", file=sys.stderr)
    for name, hidden, inter, experts, top_k, kind in models:
        max_t = max(token_counts)
        need = experts * 3 * hidden * inter * 2 + max_t * top_k * (hidden + 2 * inter) * 2 * 3 + (2 << 30)
        free, _ = torch.cuda.mem_get_info()
        if need > free:
            print(f"# torch_moe: {name} skipped: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free", file=sys.stderr)
            continue
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda")
        down = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device="cuda")
        for e in range(experts):  # in slices: no fp32 temporary of the whole 79 GB
            gate_up[e].uniform_(-hidden ** -0.5, hidden ** -0.5)
            down[e].uniform_(-inter ** -0.5, inter ** -0.5)
        x_all = torch.empty(max_t, hidden, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        for tokens in token_counts:
            ids, w, distinct = make_routing(tokens, experts, top_k, 0x6D6F65 * 1000003 + tokens)
            x = x_all[:tokens]
            shape = f"{name} experts={experts} top_k={top_k} hidden={hidden} inter={inter} tokens={tokens}"
            pairs = tokens * top_k
            nbytes = distinct * 3 * hidden * inter * 2 + 2 * tokens * hidden * 2 + pairs * 8
            flops = 2 * pairs * 3 * hidden * inter + 4 * pairs * inter + 2 * pairs * hidden
            touched = f"{distinct} of {experts} experts touched"
            iters = args.iters if tokens < 4096 else max(3, args.iters // 2)
            try:
                us = median_us(lambda: moe_loop(x, ids, w, gate_up, down, inter, kind), iters)
                emit(shape, "torch", us, nbytes, flops,
                     f"bf16, sort + per-expert torch matmuls + index_add_; {touched}")
            except torch.OutOfMemoryError:
                print(f"# torch_moe: {shape}: torch loop out of memory", file=sys.stderr)
                torch.cuda.empty_cache()
            if gmm is not None:
                try:
                    # The grouped form must compute what the loop does (checked once per shape, untimed).
                    ref = moe_loop(x, ids, w, gate_up, down, inter, kind).float()
                    got = moe_grouped(gmm, x, ids, w, gate_up, down, inter, kind).float()
                    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    del ref, got
                    if not err < 2e-2:
                        raise RuntimeError(f"differs from the loop (relative error {err:.3g})")
                    us = median_us(lambda: moe_grouped(gmm, x, ids, w, gate_up, down, inter, kind), iters)
                    emit(shape, "torch_grouped_mm", us, nbytes, flops,
                         f"bf16, sort + gather + two grouped_mm + index_add_; {touched}")
                except torch.OutOfMemoryError:
                    print(f"# torch_moe: {shape}: grouped_mm out of memory", file=sys.stderr)
                    torch.cuda.empty_cache()
                except Exception as ex:  # noqa: BLE001 - unsupported here: report and go on
                    msg = (str(ex).splitlines() or [type(ex).__name__])[0][:200]
                    print(f"# torch_moe: {shape}: grouped_mm skipped: {msg}", file=sys.stderr)
        del gate_up, down, x_all
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    if args.filter and args.filter not in "moe_experts":
        return 0
    if not torch.cuda.is_available():
        print("# torch_moe: no CUDA device", file=sys.stderr)
        return 0
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
