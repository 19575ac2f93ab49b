#!/usr/bin/env python3
"""Times FlashMLA (the peer) on sparrow's MLA shapes; one JSON line per measurement.

Run on the GPU machine after bench/peers/build_flashmla.sh (FlashMLA is imported from FLASHMLA_DIR,
default /tmp/flashmla-build):

    python3 bench/peers/flashmla_peer.py [--quick] [--kernels sparse_mla_decode,dense_mla_decode,sparse_mla_prefill]
                                         [--deadline-s 200] [--out file.jsonl]

Kernels and what is timed (FlashMLA's public Python API, csrc/api/*.h for the limits quoted in notes):
  sparse_mla_decode   flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...): top-k sparse attention over
                      the FP8 "FlashMLA layout" paged cache (656 B/token: 512 e4m3 + 4 fp32 scales + 64 bf16 rope),
                      d_qk 576, d_v 512, one KV head. FlashMLA takes only 64 or 128 query heads here, so other head
                      counts are padded up (said in "note"). Times the split-KV kernel plus its combine kernel; the
                      tile-scheduler metadata is made once per shape (by the warm-up) and reused, as in serving.
  dense_mla_decode    flash_mla_with_kvcache with a bf16 paged cache (1152 B/token), block table, all of ctx attended;
                      causal for q=2 (MTP). Any head count.
  sparse_mla_prefill  flash_mla_sparse_fwd(q [s_q,h,576], kv [s_kv,1,576] bf16, indices [s_q,1,topk]): the decode grid
                      with the batch's B*Q query tokens flattened into s_q (how serving stacks use it for bf16 KV),
                      plus real prefill chunks (batch=1 q=4096). Heads padded to 64/128 as for decode.

Shapes: DeepSeek-V3.2 (128 heads), Kimi K3.1 Pro (96 heads) and its TP8 slice (12 heads); contexts 8K/32K/128K;
batch 1/2/8/32/64/128; q tokens 1 and 2; top-2048; page block 64. Each sequence's pages are a random
permutation of a shared pool; each query's top-k are distinct random positions of its context.

Timing: CUDA events around one call, median of 50 calls after 3 warm-ups; before each call the L2 is flushed
(a 256 MiB write) and the stream is held by a short device-side sleep so the host's Python overhead does not
leak into the measured window.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

MODELS = [("deepseek_v3.2", 128), ("kimi_k3.1_pro", 96), ("kimi_k3.1_pro_tp8", 12)]
CONTEXTS = [8192, 32768, 131072]
BATCHES = [1, 2, 8, 32, 64, 128]
QS = [1, 2]
TOPK = 2048
BLOCK = 64
D_QK, D_V, D_NOPE, D_ROPE = 576, 512, 512, 64
FP8_BYTES_PER_TOKEN = 512 + 4 * 4 + 64 * 2  # 656
PREFILL_CHUNK = 4096
KERNELS = ["sparse_mla_decode", "dense_mla_decode", "sparse_mla_prefill"]


def padded_heads(h):
    """FlashMLA's sparse kernels accept 64 or 128 query heads (csrc/api/sparse_decode.h, sparse_fwd.h)."""
    return 64 if h <= 64 else 128


class Timer:
    def __init__(self, iters, flush_bytes=256 << 20):
        self.iters = iters
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
        self.has_sleep = hasattr(torch.cuda, "_sleep")

    def median_us(self, fn, warmup=3):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            self.flush.fill_(i & 0xFF)  # evict the operands from the 50 MB L2
            if self.has_sleep:
                torch.cuda._sleep(100_000)  # ~50 us at 1.98 GHz: lets the host enqueue the call ahead of the GPU
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def make_pools(max_tokens, gen):
    """One FP8 and one bf16 paged pool big enough for the largest batch x context."""
    nblocks = max_tokens // BLOCK
    fp8 = torch.empty((nblocks, BLOCK, FP8_BYTES_PER_TOKEN), dtype=torch.uint8, device="cuda")
    # e4m3 bytes below 0x78 are finite and positive (0x7F/0xFF are NaN); magnitudes up to 240.
    fp8[..., :D_NOPE] = torch.randint(0, 0x78, (nblocks, BLOCK, D_NOPE), dtype=torch.uint8, device="cuda", generator=gen)
    fp8[..., D_NOPE:D_NOPE + 16].view(torch.float32).fill_(1.0 / 448.0)
    fp8[..., D_NOPE + 16:].view(torch.bfloat16).copy_(
        torch.randn((nblocks, BLOCK, D_ROPE), device="cuda", generator=gen).to(torch.bfloat16))
    bf16 = torch.empty((nblocks, BLOCK, 1, D_QK), dtype=torch.bfloat16, device="cuda")
    bf16.normal_(0, 0.1, generator=gen)
    return fp8.view(torch.float8_e4m3fn).view(nblocks, BLOCK, 1, FP8_BYTES_PER_TOKEN), bf16


def random_topk_positions(rows, ctx, topk, gen):
    """rows x topk distinct random positions in [0, ctx) (chunked to bound the scratch memory)."""
    out = torch.empty((rows, topk), dtype=torch.int64, device="cuda")
    step = max(1, (1 << 27) // ctx)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out[r:r + n] = torch.rand((n, ctx), device="cuda", generator=gen).topk(topk, dim=-1).indices
    return out


def emit(rows_out, kernel, name, heads, ctx, batch, q, dtype, us, note):
    row = {"kernel": kernel, "shape": f"{name} heads={heads} ctx={ctx} batch={batch} q={q} topk={TOPK} {dtype}"
           if kernel != "dense_mla_decode" else f"{name} heads={heads} ctx={ctx} batch={batch} q={q} {dtype}",
           "impl": "flashmla", "median_us": round(us, 2) if us is not None else None, "note": note}
    line = json.dumps(row)
    print(line, flush=True)
    if rows_out:
        rows_out.write(line + "\n")
        rows_out.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one context, batches 1 and 64, q=1")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--models", default=",".join(m for m, _ in MODELS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--deadline-s", type=float, default=0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--out", default="", help="also append the JSON lines to this file")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    sys.path.insert(0, os.environ.get("FLASHMLA_DIR", "/tmp/flashmla-build"))
    import flash_mla  # noqa: E402

    t0 = time.time()
    kernels = args.kernels.split(",")
    models = [m for m in MODELS if m[0] in args.models.split(",")]
    contexts, batches, qs = (CONTEXTS[:1], [1, 64], [1]) if args.quick else (CONTEXTS, BATCHES, QS)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    timer = Timer(args.iters)
    rows_out = open(args.out, "a") if args.out else None
    fp8_pool, bf16_pool = make_pools(max(batches) * max(contexts), gen)
    nblocks_pool = bf16_pool.shape[0]
    kv_flat = bf16_pool.view(nblocks_pool * BLOCK, 1, D_QK)  # the prefill kernel's [s_kv, h_kv, d] view
    print(f"# flashmla_peer: {torch.cuda.get_device_name()}, pools {fp8_pool.numel() / 2**30:.1f} GiB fp8 + "
          f"{bf16_pool.numel() * 2 / 2**30:.1f} GiB bf16, setup {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    checked = set()

    def late():
        return args.deadline_s and time.time() - t0 > args.deadline_s

    def finite_note(kernel, out):
        if kernel in checked:
            return ""
        checked.add(kernel)
        return "" if bool(torch.isfinite(out.float()).all()) else "; OUTPUT NOT FINITE"

    for ctx in contexts:
        for batch in batches:
            for q in qs:
                if late():
                    print("# flashmla_peer: deadline reached, stopping", file=sys.stderr, flush=True)
                    return
                nb = ctx // BLOCK
                # Each sequence's pages: a random permutation of the pool's blocks (as an allocator would leave them).
                block_table = torch.randperm(nblocks_pool, device="cuda", generator=gen)[:batch * nb].view(batch, nb)
                pos = random_topk_positions(batch * q, ctx, TOPK, gen).view(batch, q, TOPK)
                page = torch.gather(block_table, 1, (pos // BLOCK).view(batch, -1)).view(batch, q, TOPK)
                token_idx = (page * BLOCK + pos % BLOCK).to(torch.int32)  # FlashMLA: block * page_size + offset
                block_table_i32 = block_table.to(torch.int32)
                seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                for name, heads in models:
                    hp = padded_heads(heads)
                    pad_note = f"heads padded {heads}->{hp} (FlashMLA sparse kernels take 64 or 128)" if hp != heads else ""
                    scale = D_QK ** -0.5
                    if "sparse_mla_decode" in kernels:
                        qt = torch.randn((batch, q, hp, D_QK), device="cuda", generator=gen).to(torch.bfloat16)
                        meta, _ = flash_mla.get_mla_metadata()
                        fn = lambda: flash_mla.flash_mla_with_kvcache(
                            qt, fp8_pool, None, None, D_V, meta, None, softmax_scale=scale,
                            is_fp8_kvcache=True, indices=token_idx)
                        try:
                            us = timer.median_us(fn)
                            note = "; ".join(x for x in ["fp8 kv (FlashMLA V3.2 layout), split-kv + combine", pad_note] if x)
                            note += finite_note("sparse_mla_decode", fn()[0])
                        except Exception as e:  # noqa: BLE001 - a peer's refusal is a result, not a crash
                            us, note = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        emit(rows_out, "sparse_mla_decode", name, heads, ctx, batch, q, "fp8", us, note)
                    if "dense_mla_decode" in kernels:
                        qt = torch.randn((batch, q, heads, D_QK), device="cuda", generator=gen).to(torch.bfloat16)
                        meta, _ = flash_mla.get_mla_metadata()
                        fn = lambda: flash_mla.flash_mla_with_kvcache(
                            qt, bf16_pool, block_table_i32, seqlens, D_V, meta, None, softmax_scale=scale,
                            causal=q > 1)
                        try:
                            us = timer.median_us(fn)
                            note = "bf16 paged kv, all ctx tokens" + ("; causal over the q tokens" if q > 1 else "")
                            note += finite_note("dense_mla_decode", fn()[0])
                        except Exception as e:  # noqa: BLE001
                            us, note = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        emit(rows_out, "dense_mla_decode", name, heads, ctx, batch, q, "bf16", us, note)
                    if "sparse_mla_prefill" in kernels:
                        qt = torch.randn((batch * q, hp, D_QK), device="cuda", generator=gen).to(torch.bfloat16)
                        idx = token_idx.view(batch * q, 1, TOPK)
                        fn = lambda: flash_mla.flash_mla_sparse_fwd(qt, kv_flat, idx, scale, D_V)
                        try:
                            us = timer.median_us(fn)
                            note = "; ".join(x for x in [f"bf16 kv; s_q=batch*q={batch * q} query tokens flattened", pad_note] if x)
                            note += finite_note("sparse_mla_prefill", fn()[0])
                        except Exception as e:  # noqa: BLE001
                            us, note = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        emit(rows_out, "sparse_mla_prefill", name, heads, ctx, batch, q, "bf16", us, note)
        # A real prefill chunk at this context: 4096 query tokens of one sequence.
        if "sparse_mla_prefill" in kernels and not args.quick and not late():
            nb = ctx // BLOCK
            block_table = torch.randperm(nblocks_pool, device="cuda", generator=gen)[:nb].view(1, nb)
            pos = random_topk_positions(PREFILL_CHUNK, ctx, TOPK, gen).view(1, -1)
            page = torch.gather(block_table, 1, pos // BLOCK)
            idx = (page * BLOCK + pos % BLOCK).to(torch.int32).view(PREFILL_CHUNK, 1, TOPK)
            for name, heads in models:
                hp = padded_heads(heads)
                pad_note = f"heads padded {heads}->{hp} (FlashMLA sparse kernels take 64 or 128)" if hp != heads else ""
                qt = torch.randn((PREFILL_CHUNK, hp, D_QK), device="cuda", generator=gen).to(torch.bfloat16)
                fn = lambda: flash_mla.flash_mla_sparse_fwd(qt, kv_flat, idx, D_QK ** -0.5, D_V)
                try:
                    us = timer.median_us(fn)
                    note = "; ".join(x for x in [f"bf16 kv; prefill chunk of {PREFILL_CHUNK} query tokens", pad_note] if x)
                except Exception as e:  # noqa: BLE001
                    us, note = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                emit(rows_out, "sparse_mla_prefill", name, heads, ctx, 1, PREFILL_CHUNK, "bf16", us, note)
    print(f"# flashmla_peer: done in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
