#!/usr/bin/env python3
"""Peers of sparrow's KDA prefill benchmark (src/kernels/cuda/kda/bench.cu): the same shapes, the same shape
strings, one JSON line per row with the fields of sparrow's rows:
  {"kernel": "kda_delta_rule", "shape": ..., "impl": ..., "median_us": ..., "bytes": ..., "flops": ..., "note": ...}
Impls:
  fla        fla's chunk_kda (PyPI fla-core / flash-linear-attention, module fla.ops.kda) with bf16 q, k, v, beta
             and fp32 g and state; if that module is missing but fla.ops.gated_delta_rule is there, its
             chunk_gated_delta_rule with one gate per head instead of per channel (the note says so)
  fla_fp32   the same with fp32 q, k, v, beta (where the library takes them)
  torch      transformers' reference chunk_kimi_delta_attention (pure PyTorch, fp32), only where its
             [heads, T, 64, 128] decay tensors fit (--torch-budget-gb); it is a readable reference, not a kernel
All run with the kernel's own L2 norm of q and k (sparrow's bench passes normalize_qk = true), a nonzero fp32
starting state, and the final state returned. bytes and flops are sparrow's counts for the shape (fp32
inputs; the chunk form's FLOPs), so the table's columns line up. If fla is not installed, each shape gets an
"fla" line with median_us null and note "not installed: ..." and the script still exits 0.
Timing: CUDA events, L2 flushed (a 256 MiB write) before every launch, median of --iters launches after
warm-up.
Usage: python3 bench/peers/kda_peers.py [--quick] [--iters N] [--torch-budget-gb G]
"""
import argparse
import inspect
import json
import sys

import torch

from timing import median_us  # bench/peers/timing.py: the same timing as sparrow's

HEAD_DIM = 128
CHUNK = 64
# Multiply-adds of the chunk form per token and head (bench.cu): 2.5 C D + 3 D^2 + C^2 / 6.
CHUNK_MACS_PER_TOKEN = 2.5 * CHUNK * HEAD_DIM + 3.0 * HEAD_DIM * HEAD_DIM + CHUNK * CHUNK / 6.0




def shape_of(heads, batch, count):
    shape = f"kimi_k3.1_pro heads={heads} d=128 prefill tokens={count}"
    return shape + (f" batch={batch}" if batch > 1 else "")


def counts_of(heads, batch, count):
    """sparrow's bytes and FLOPs for the shape (src/kernels/cuda/kda/bench.cu)."""
    tokens = batch * count
    width = heads * HEAD_DIM
    state = width * HEAD_DIM
    nbytes = tokens * (5 * width + heads) * 4 + batch * state * 4 * 2
    flops = 2.0 * CHUNK_MACS_PER_TOKEN * tokens * heads
    return float(nbytes), flops


def emit(heads, batch, count, impl, us, note):
    nbytes, flops = counts_of(heads, batch, count)
    row = {"kernel": "kda_delta_rule", "shape": shape_of(heads, batch, count), "impl": impl,
           "median_us": None if us is None else round(us, 3), "bytes": nbytes, "flops": flops, "note": note}
    print(json.dumps(row), flush=True)


def inputs(heads, batch, count, dtype):
    """Random inputs in the ranges of sparrow's bench: q, k, v in [-1, 1], g in (-0.1, 0], beta in (0.1, 0.9)."""
    shape = (batch, count, heads, HEAD_DIM)
    q = torch.empty(shape, device="cuda", dtype=dtype).uniform_(-1, 1)
    k = torch.empty(shape, device="cuda", dtype=dtype).uniform_(-1, 1)
    v = torch.empty(shape, device="cuda", dtype=dtype).uniform_(-1, 1)
    g = torch.empty(shape, device="cuda", dtype=torch.float32).uniform_(-0.1, 0)
    beta = torch.empty((batch, count, heads), device="cuda", dtype=dtype).uniform_(0.1, 0.9)
    h0 = torch.empty((batch, heads, HEAD_DIM, HEAD_DIM), device="cuda", dtype=torch.float32).uniform_(-0.01, 0.01)
    return q, k, v, g, beta, h0


def find_fla():
    """(callable, description, per_channel) or (None, reason, False)."""
    try:
        from fla.ops.kda import chunk_kda  # noqa: PLC0415
        return chunk_kda, "fla.ops.kda.chunk_kda", True
    except Exception as ex:  # noqa: BLE001 - any import failure means: not usable
        kda_error = f"{type(ex).__name__}: {ex}"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: PLC0415
        return chunk_gated_delta_rule, f"fla.ops.gated_delta_rule.chunk_gated_delta_rule (no fla.ops.kda: {kda_error})", False
    except Exception as ex:  # noqa: BLE001
        return None, f"{kda_error}; fla.ops.gated_delta_rule: {type(ex).__name__}: {ex}", False


def call_kwargs(fn, **kwargs):
    """The keyword arguments the installed version's signature takes (older and newer fla differ)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def bench_fla(args, shapes):
    fn, desc, per_channel = find_fla()
    if fn is None:
        for heads, batch, count in shapes:
            emit(heads, batch, count, "fla", None, f"not installed: {desc}")
        return
    print(f"# fla: {desc}", file=sys.stderr)
    for heads, batch, count in shapes:
        for dtype, impl in ((torch.bfloat16, "fla"), (torch.float32, "fla_fp32")):
            try:
                q, k, v, g, beta, h0 = inputs(heads, batch, count, dtype)
                if not per_channel:
                    g = g[..., 0].contiguous()  # one gate per head: the closest form the fallback takes
                kwargs = call_kwargs(fn, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

                def run():
                    with torch.inference_mode():
                        fn(q, k, v, g, beta, **kwargs)

                us = median_us(run, args.iters)
                what = "bf16 q/k/v/beta" if dtype == torch.bfloat16 else "fp32 q/k/v/beta"
                note = f"{desc}, {what}, fp32 g and state, l2norm in kernel"
                if not per_channel:
                    note += "; per-head scalar gates, not KDA's per-channel ones"
                emit(heads, batch, count, impl, us, note)
            except Exception as ex:  # noqa: BLE001 - report the shape and go on
                emit(heads, batch, count, impl, None, f"failed: {type(ex).__name__}: {str(ex)[:200]}")
            finally:
                q = k = v = g = beta = h0 = None
                torch.cuda.empty_cache()


def find_torch_reference():
    """transformers' pure-PyTorch chunk_kimi_delta_attention (its decorator dispatches to fla when fla is
    installed; inspect.unwrap reaches the PyTorch function it wraps)."""
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as mkl  # noqa: PLC0415
    except Exception as ex:  # noqa: BLE001
        return None, f"transformers kimi_linear not importable: {type(ex).__name__}: {ex}"
    fn = inspect.unwrap(mkl.chunk_kimi_delta_attention)
    if getattr(fn, "__module__", "") != mkl.__name__:
        return None, f"could not reach the PyTorch chunk_kimi_delta_attention (got {fn!r})"
    return fn, f"transformers {getattr(sys.modules.get('transformers'), '__version__', '?')} chunk_kimi_delta_attention"


def bench_torch(args, shapes):
    fn, desc = find_torch_reference()
    if fn is None:
        print(f"# torch reference skipped: {desc}", file=sys.stderr)
        return
    budget = args.torch_budget_gb * (1 << 30)
    for heads, batch, count in shapes:
        # Its largest intermediates: the [B, H, T/64, 64, 64, 128] fp32 decay mask and two products of that size.
        peak = 3 * batch * heads * count * CHUNK * HEAD_DIM * 4
        if peak > budget:
            print(f"# torch skipped for {shape_of(heads, batch, count)}: ~{peak / 2**30:.0f} GiB of intermediates",
                  file=sys.stderr)
            continue
        try:
            q, k, v, g, beta, h0 = inputs(heads, batch, count, torch.float32)

            def run():
                with torch.inference_mode():
                    fn(q, k, v, g, beta, chunk_size=CHUNK, initial_state=h0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)

            us = median_us(run, max(3, args.iters // 4))
            emit(heads, batch, count, "torch", us, f"{desc}: fp32 PyTorch reference, chunk 64, l2norm in the function")
        except Exception as ex:  # noqa: BLE001
            emit(heads, batch, count, "torch", None, f"failed: {type(ex).__name__}: {str(ex)[:200]}")
        finally:
            q = k = v = g = beta = h0 = None
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--torch-budget-gb", type=float, default=40.0)
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    if args.filter and args.filter not in "kda_delta_rule":
        return 0
    if not torch.cuda.is_available():
        print("# no CUDA device", file=sys.stderr)
        return 77
    prompts = [8192] if args.quick else [8192, 32768, 131072]
    shapes = []
    for heads in (12, 96):
        shapes += [(heads, 1, count) for count in prompts]
        if not args.quick:
            shapes.append((heads, 8, 8192))
    bench_fla(args, shapes)
    bench_torch(args, [s for s in shapes if s[2] == 8192])
    return 0


if __name__ == "__main__":
    sys.exit(main())
