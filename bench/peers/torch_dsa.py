#!/usr/bin/env python3
"""PyTorch peers of the DSA indexer and top-k benchmarks (src/kernels/cuda/dsa_indexer/bench.cu,
src/kernels/cuda/topk/bench.cu): same shapes, same shape strings, one JSON line per row:
  {"kernel": ..., "shape": ..., "impl": "torch" | "torch_fp8", "median_us": ...}
Indexer: score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) with contiguous (not paged) keys, in bf16
through torch.einsum/matmul, and in FP8 through torch._scaled_mm where its 2-D form applies (batch 1).
Top-k: torch.topk(k=2048) over [rows, len] fp32. Timing: CUDA events, L2 flushed before every launch,
median of --iters launches after warm-up.
Usage: python3 bench/peers/torch_dsa.py [--quick] [--iters N] [--filter dsa_index_scores|topk]
"""
import argparse
import json
import sys

import torch

from timing import median_us  # bench/peers/timing.py: the same timing as sparrow's





def emit(kernel, shape, impl, us, note=""):
    print(json.dumps({"kernel": kernel, "shape": shape, "impl": impl, "median_us": round(us, 3), "note": note}),
          flush=True)


def bench_topk(args):
    lens = [131072] if args.quick else [8192, 32768, 131072, 1048576]
    batches = [1] if args.quick else [1, 8, 64, 128]
    k = 2048
    for n in lens:
        for b in batches:
            x = torch.randn(b, n, device="cuda", dtype=torch.float32)
            us = median_us(lambda: torch.topk(x, k, dim=-1), args.iters)
            emit("topk", f"rows={b} len={n} k={k}", "torch", us, "torch.topk, sorted values + indices")
            del x


def indexer_bf16(q, w, keys):
    # q [B, T, H, D], w [B, T, H], keys [B, S, D] -> [B, T, S]
    logits = torch.einsum("bthd,bsd->bths", q, keys)
    return (logits.relu_() * w.unsqueeze(-1)).sum(dim=2, dtype=torch.float32)


def bench_indexer(args):
    models = [("deepseek_v3.2", 64), ("kimi_k3.1_pro", 32)]
    ctxs = [131072] if args.quick else [8192, 32768, 131072, 1048576]
    batches = [8] if args.quick else [1, 8, 64, 128]
    qtoks = [1] if args.quick else [1, 2]
    budget = 24 << 30  # skip shapes whose bf16 intermediates exceed this
    have_fp8 = hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")
    for name, heads in models:
        for ctx in ctxs:
            for b in batches:
                for t in qtoks:
                    shape = f"{name} heads={heads} ctx={ctx} batch={b} q={t}"
                    inter = b * t * heads * ctx * 2 * 2
                    if b * ctx * 128 * 2 + inter > budget:
                        print(f"# skip {shape}: intermediates too large", file=sys.stderr)
                        continue
                    keys = torch.randn(b, ctx, 128, device="cuda", dtype=torch.bfloat16)
                    q = torch.randn(b, t, heads, 128, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(b, t, heads, device="cuda", dtype=torch.bfloat16)
                    us = median_us(lambda: indexer_bf16(q, w, keys), args.iters)
                    emit("dsa_index_scores", shape, "torch", us, "bf16 einsum + relu + weighted head sum")
                    if have_fp8 and b == 1:
                        try:
                            k8 = keys[0].to(torch.float8_e4m3fn)
                            q8 = q[0].reshape(t * heads, 128).to(torch.float8_e4m3fn)
                            one = torch.ones((), device="cuda", dtype=torch.float32)
                            wf = w[0].reshape(t, heads, 1).float()

                            def fp8():
                                lg = torch._scaled_mm(q8, k8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                                return (lg.view(t, heads, ctx).relu_() * wf).sum(dim=1)

                            us = median_us(fp8, args.iters)
                            emit("dsa_index_scores", shape, "torch_fp8", us, "torch._scaled_mm e4m3 + relu + head sum")
                        except Exception as ex:  # noqa: BLE001 - report and go on
                            print(f"# fp8 skipped for {shape}: {ex}", file=sys.stderr)
                    del keys, q, w
                    torch.cuda.empty_cache()
        for chunk in ([8192] if args.quick else [8192, 32768]):
            shape = f"{name} heads={heads} prefill chunk={chunk}"
            keys = torch.randn(1, chunk, 128, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, chunk, heads, 128, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(1, chunk, heads, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(chunk, chunk, device="cuda", dtype=torch.float32)
            mask = torch.ones(chunk, chunk, device="cuda", dtype=torch.bool).triu_(1)
            rb = max(1, (8 << 30) // (heads * chunk * 2 * 2))

            def prefill():
                for r0 in range(0, chunk, rb):
                    r1 = min(chunk, r0 + rb)
                    out[r0:r1] = indexer_bf16(q[:, r0:r1], w[:, r0:r1], keys)[0]
                out.masked_fill_(mask, float("-inf"))

            us = median_us(prefill, max(3, args.iters // 4))
            emit("dsa_index_scores", shape, "torch", us, "bf16 einsum in row blocks, causal -inf mask")
            del keys, q, w, out, mask
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("# no CUDA device", file=sys.stderr)
        return 77
    if "topk".find(args.filter) >= 0 or args.filter in "topk":
        bench_topk(args)
    if args.filter in "dsa_index_scores":
        bench_indexer(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
