#!/usr/bin/env python3
"""PyTorch peer of sparrow's MLA decode kernels (src/kernels/cuda/mla/bench.cu): the same sparse (top-2048)
and dense MLA decode in the absorbed form, as gather + bf16 matmuls + softmax, on identical shapes over an
identically laid out paged cache (FP8 FlashMLA layout, 656 B/token, or bf16, 1152 B/token; block 64).
Prints one JSON line per shape: {"kernel","shape","impl":"torch","median_us"}.

usage: python3 bench/peers/torch_mla.py [--quick] [--iters 10]
"""
import argparse
import json
import sys

import torch

from timing import median_us  # bench/peers/timing.py: the same timing as sparrow's

MODELS = [("deepseek_v3.2", 128), ("kimi_k3.1_pro", 96), ("kimi_k3.1_pro", 12)]
TOPK, BLOCK = 2048, 64




def make_cache(fp8, rows):
    """A pool of `rows` cache rows; returns a function that dequantises gathered row ids to bf16 [.., 576]."""
    if fp8:
        pool = torch.randint(0, 256, (rows, 656), dtype=torch.uint8, device="cuda")
        pool[:, :512] &= 0x7E  # no NaN codes, no negative zero games
        pool[:, 512:528] = torch.full((rows, 4), 1.0 / 448, device="cuda").view(torch.uint8)
        pool[:, 528:] = (torch.randn(rows, 64, device="cuda").to(torch.bfloat16)).view(torch.uint8)

        def gather(ids):
            r = pool[ids]  # [..., 656]
            lat = r[..., :512].view(torch.float8_e4m3fn).to(torch.float32)
            scale = r[..., 512:528].contiguous().view(torch.float32)  # [..., 4]
            lat = (lat.view(*lat.shape[:-1], 4, 128) * scale.unsqueeze(-1)).view(*lat.shape[:-1], 512)
            rope = r[..., 528:].contiguous().view(torch.bfloat16)
            return torch.cat([lat.to(torch.bfloat16), rope], dim=-1)
    else:
        pool = torch.randn(rows, 576, device="cuda").to(torch.bfloat16)

        def gather(ids):
            return pool[ids]
    return gather


def attend(q, keys, mask, scale):
    # q [R, H, 576] bf16, keys [R, K, 576] bf16, mask [R, K] bool (True = use)
    logits = torch.matmul(q, keys.transpose(1, 2)).float() * scale  # [R, H, K]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1).to(torch.bfloat16)
    return torch.matmul(p, keys[..., :512]), lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    contexts = [32768] if args.quick else [8192, 32768, 131072]
    batches = [64, 128] if args.quick else [1, 2, 8, 32, 64, 128]
    scale = 192 ** -0.5
    gen = torch.Generator(device="cpu").manual_seed(1234)
    for fp8 in (True, False):
        fmt = " fp8" if fp8 else " bf16"
        for ctx in contexts:
            for batch in batches:
                pages = ctx // BLOCK
                total_pages = batch * pages
                # scattered pages: block table entry = a permutation of the pool's pages
                table = torch.randperm(total_pages, generator=gen).view(batch, pages).cuda()
                try:
                    gather = make_cache(fp8, total_pages * BLOCK)
                except torch.OutOfMemoryError:
                    continue
                for qn in (1, 2):
                    rows = batch * qn
                    seq = torch.arange(batch, device="cuda").repeat_interleave(qn)
                    lens = ctx - (qn - 1 - torch.arange(qn, device="cuda")).repeat(batch)
                    idx = (torch.rand(rows, TOPK, generator=gen) * (lens.cpu()[:, None] - 1)).long().cuda()
                    for name, heads in MODELS:
                        if args.quick and not ((heads == 12 and batch == 64) or (heads == 128 and batch == 128)):
                            continue
                        tail = f" ctx={ctx} batch={batch} q={qn}"
                        q = torch.randn(rows, heads, 576, device="cuda").to(torch.bfloat16)

                        def sparse():
                            ids = table[seq[:, None], idx // BLOCK] * BLOCK + idx % BLOCK
                            return attend(q, gather(ids), idx >= 0, scale)

                        def dense():
                            tok = torch.arange(ctx, device="cuda")
                            out = []
                            for s in range(batch):  # one sequence at a time keeps the logits small
                                ids = table[s, tok // BLOCK] * BLOCK + tok % BLOCK
                                keys = gather(ids)[None].expand(qn, -1, -1)
                                mask = tok[None, :] < lens[s * qn:(s + 1) * qn, None]
                                out.append(attend(q[s * qn:(s + 1) * qn], keys, mask, scale))
                            return out

                        jobs = []
                        if batch <= 64:
                            jobs.append(("dense_mla_decode", f"{name} heads={heads}{tail}{fmt}", dense))
                        jobs.append(("sparse_mla_decode", f"{name} heads={heads}{tail} topk={TOPK}{fmt}", sparse))
                        for kernel, shape, fn in jobs:
                            try:
                                us = median_us(fn, args.iters)
                            except torch.OutOfMemoryError:
                                torch.cuda.empty_cache()
                                continue
                            print(json.dumps({"kernel": kernel, "shape": shape, "impl": "torch", "median_us": round(us, 3)}))
                            sys.stdout.flush()
                del gather
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
