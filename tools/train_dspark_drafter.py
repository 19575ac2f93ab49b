#!/usr/bin/env python3
"""Trains a DSpark speculative-decoding drafter (K3DSparkForCausalLM, vLLM 0.33's K3DSparkConfig) for the bundled
Kimi K3 model, so that speculative decoding's "dspark" method (docs/speculative.md) has real acceptance end to end.

The drafter is exactly what src/model/dspark.h runs and tools/make_dspark_fixture.py describes in float64 (that
file's Drafter is the reference this module is checked against, --check): for an anchor a (the bonus token t_a,
the newest token the target sampled; the context rows are positions 0 .. a-1)

  context   c_p = RMSNorm(context_proj([s_{t1}(p) ; ... ; s_{tn}(p)]); context_norm), s_t(p) the target's stream
            after layer t: with AttnRes, the current block's partial sum including layer t's attention and
            feed-forward outputs (make_dspark_fixture.target_with_aux); each draft layer's context row at p is
            [RMSNorm(kv_c; kv_a_layernorm) | rope(k_pe, p)] of kv_a_proj_with_mqa(c_p)
  block     tokens [t_a, mask x (N-1)] at positions a .. a+N-1 (the target's embedding), per layer
            x += MLA(RMSNorm x) (non-causal: every block query sees context rows 0..a-1 and the block's N rows;
            GPT-J RoPE on the 16 rope dims, theta 50000), x += MLP(RMSNorm x); base_i = lm_head(final_norm x)
            (the target's head, frozen); query i predicts t_{a+1+i}
  Markov    logits_i = base_i + markov_w2 . markov_w1[prev_i], prev_0 = t_a, prev_i = t_{a+i} (teacher forcing;
            at inference the previous draft)

Training (the target frozen, float32, no grad): each step takes windows of --context tokens, runs the target once
over them capturing the streams and its own greedy predictions y_p = argmax logits_p, and trains all anchors of
the step in one drafter forward: every window carries --anchors anchors, each a block of up to N = --block queries
(the block length drawn per anchor from 1..N, so that num_speculative_tokens below N is trained too: the rows of
a shorter block are invisible to the others), all as one query set with a boolean attention mask (a block's
queries see the context rows < a and their own block's rows). Labels are the target's greedy tokens y_{a+i}
(distillation: the drafter learns what the target will accept, not the text), the loss the position-weighted
cross-entropy of the Markov-corrected logits.

Data: the bundled model's own training sources (tools/train_small_models.training_texts / encode_corpus, as
tools/train_mtp_drafter.py builds them: the standard library's code and tools/chat_corpus.py's conversations,
tokenized with models/kimi_k3/tokenizer.json), in two kinds of windows: real text, and the target's own greedy
continuations of short prompts cut from the corpus (a pool generated at start, --pool windows), which is what a
drafter sees at inference (the context after the prompt is the target's own greedy output).

  python3 tools/train_dspark_drafter.py --minutes 8 [--device cuda] [--out models/kimi_k3/dspark]
  python3 tools/train_dspark_drafter.py --check        # the module == make_dspark_fixture.Drafter (float64)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import kimi_k3_torch as k3  # noqa: E402
import train_small_models as small  # noqa: E402

TARGET = ROOT / "models" / "kimi_k3"
MASK_TOKEN = "<|media_pad|>"      # a special token the text never contains (no media in this model's data)


def drafter_config(target_cfg: dict, args, mask_id: int) -> dict:
    c = k3.text_config(target_cfg)
    H = c["hidden_size"]
    return {
        "architectures": ["K3DSparkForCausalLM"], "model_type": "k3_dspark",
        "hidden_size": H, "num_hidden_layers": args.layers, "num_attention_heads": c["num_attention_heads"],
        "q_lora_rank": c["q_lora_rank"], "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"], "intermediate_size": args.intermediate,
        "hidden_act": c["hidden_act"], "activation_situ_beta": c.get("activation_situ_beta"),
        "activation_situ_linear_beta": c.get("activation_situ_linear_beta"),
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "rope_theta": 50000.0,
        "max_position_embeddings": c["max_position_embeddings"],
        "vocab_size": c["vocab_size"], "draft_vocab_size": c["vocab_size"],
        "target_layer_ids": list(args.target_layers), "num_target_layers": len(args.target_layers),
        "target_hidden_size": H, "markov_rank": args.markov_rank,
        "dspark_noise_token_id": mask_id, "logit_scale": 1.0, "sample_from_anchor": True,
        "n_routed_experts": 0, "n_shared_experts": 0, "num_experts_per_tok": 0,
        "mla_use_nope": False, "mla_use_output_gate": False, "mla_use_qk_norm": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------------
# Target: kimi_k3_torch's forward, re-run to capture the AttnRes streams
# ---------------------------------------------------------------------------------------------

def target_streams(model: k3.KimiK3ForConditionalGeneration, ids: torch.Tensor, layer_ids: list[int]):
    """KimiLinearModel.forward (AttnRes branch) of tools/kimi_k3_torch.py, capturing s + d after each layer of
    layer_ids (make_dspark_fixture.target_with_aux). Returns (logits [B, T, V], aux [B, T, H * len(ids)])."""
    m = model.language_model.model
    eps, Bsz = m.c["rms_norm_eps"], m.c["attn_res_block_size"]
    x = m.embed_tokens(ids)
    blocks, s, d, aux = [], x, None, {}
    for l, layer in enumerate(m.layers):
        starts_block = l % Bsz == 0
        mm = -(-l // Bsz)
        if d is not None:
            s = s + d
        if starts_block:
            blocks.append(s)
        h = k3.attn_res_mix(blocks[:mm] + [s], layer.self_attention_res_norm.weight,
                            layer.self_attention_res_proj.weight, eps)
        a = layer.self_attn(layer.input_layernorm(h))
        s = a if starts_block else s + a
        h = k3.attn_res_mix(blocks[:mm + starts_block] + [s], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        d = layer.ffn(layer.post_attention_layernorm(h))
        if l in layer_ids:
            aux[l] = s + d
    s = s + d
    x = k3.attn_res_mix(blocks + [s], m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps)
    logits = model.language_model.lm_head(m.norm(x))
    return logits, torch.cat([aux[t] for t in layer_ids], -1)


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, total: int) -> torch.Tensor:
    """Greedy continuation of a batch of equal-length prompts to `total` tokens (recomputing, no cache)."""
    seq = prompts
    while seq.shape[1] < total:
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------

def rope_gptj(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-J (interleaved) rotary embedding of make_dspark_fixture.rope_gptj, batched: x [..., R] with
    positions broadcastable to x.shape[:-1] (pairs (2i, 2i+1) rotated by position * theta^(-2i/R))."""
    R = x.shape[-1]
    inv_freq = (theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)).to(x.device)
    angle = (positions.to(torch.float64)[..., None] * inv_freq).to(x.dtype)   # [..., R/2]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def linear(n_in, n_out):
    return nn.Linear(n_in, n_out, bias=False)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.nh, self.dn, self.dr, self.dv, self.r = (c["num_attention_heads"], c["qk_nope_head_dim"],
                                                      c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"])
        self.theta = float(c["rope_parameters"]["rope_theta"])
        self.q_a_proj = linear(H, c["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"], eps)
        self.q_b_proj = linear(c["q_lora_rank"], self.nh * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = linear(H, self.r + self.dr)
        self.kv_a_layernorm = RMSNorm(self.r, eps)
        self.kv_b_proj = linear(self.r, self.nh * (self.dn + self.dv))
        self.o_proj = linear(self.nh * self.dv, H)

    def rows(self, x, positions):
        """The MLA cache rows [RMSNorm(kv_c) | rope(k_pe)] of x [B, S, H] at positions [B, S]."""
        kv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(kv[..., :self.r]), rope_gptj(kv[..., self.r:], positions, self.theta)], -1)

    def forward(self, h, positions, ctx_rows, mask):
        """h [B, Q, H] block rows at positions [B, Q]; ctx_rows [B, T, r + dr]; mask [B, Q, T + Q] (True: seen)."""
        B, Q, _ = h.shape
        nh, dn, dr, dv, r = self.nh, self.dn, self.dr, self.dv, self.r
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))).view(B, Q, nh, dn + dr)
        q = torch.cat([q[..., :dn], rope_gptj(q[..., dn:], positions[..., None], self.theta)], -1)
        rows = torch.cat([ctx_rows, self.rows(h, positions)], 1)                  # [B, K, r + dr]
        K = rows.shape[1]
        kv = self.kv_b_proj(rows[..., :r]).view(B, K, nh, dn + dv)               # per head [k_nope ; v]
        k = torch.cat([kv[..., :dn], rows[..., None, r:].expand(B, K, nh, dr)], -1)
        v = F.pad(kv[..., dn:], (0, max(0, dn + dr - dv)))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=(dn + dr) ** -0.5)
        return self.o_proj(out[..., :dv].transpose(1, 2).reshape(B, Q, nh * dv))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = linear(H, I), linear(H, I), linear(I, H)

    def forward(self, x):
        return self.down_proj(k3.gated_act(self.c, self.gate_proj(x), self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)     # weight [vocab, rank]
        self.markov_w2 = linear(rank, vocab)           # weight [vocab, rank]

    def forward(self, prev):
        return self.markov_w2(self.markov_w1(prev))


class DSpark(nn.Module):
    """K3DSparkModel; state_dict() names are the checkpoint's (no "model." prefix, no embedding / head)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        H, n = c["hidden_size"], c["num_target_layers"]
        self.context_proj = linear(c["target_hidden_size"] * n, H)
        self.context_norm = RMSNorm(H, c["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.final_norm = RMSNorm(H, c["rms_norm_eps"])
        self.markov_head = MarkovHead(c["vocab_size"], c["markov_rank"])

    @torch.no_grad()
    def init_weights(self, generator, final_norm=None, std=0.02):
        out_std = std / math.sqrt(2 * len(self.layers))
        for name, p in self.named_parameters():
            if name == "markov_head.markov_w1.weight":
                p.copy_(torch.randn(p.shape, generator=generator))
            elif name == "markov_head.markov_w2.weight":
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=generator) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        if final_norm is not None:        # start from the target's own output norm (its head reads it)
            self.final_norm.weight.copy_(final_norm)
        return self

    def forward(self, aux, seq, anchors, lengths, embed, lm_head, n_block):
        """aux [B, T, H*n] the target's streams, seq [B, T] tokens, anchors [B, A] positions a (>= 1, a + n_block
        - 1 < T), lengths [B, A] block lengths 1..n_block. Returns the Markov-corrected logits [B, A, N, V]
        (teacher forcing: prev_i = seq[a + i]) for N = n_block; rows i >= length are padding."""
        c = self.c
        B, T = seq.shape
        A, N = anchors.shape[1], n_block
        dev = seq.device
        offs = torch.arange(N, device=dev)
        pos = anchors[..., None] + offs                                          # [B, A, N]
        mask_id = c["dspark_noise_token_id"]
        tokens = torch.where(offs == 0, seq.gather(1, anchors)[..., None], torch.full_like(pos, mask_id))
        x = embed[tokens].reshape(B, A * N, -1)
        # what each query (anchor k, row i) sees: context rows s < a_k, and the rows j < length_k of its block
        ctx_seen = torch.arange(T, device=dev) < anchors[..., None]              # [B, A, T]
        row_ok = offs < lengths[..., None]                                       # [B, A, N]
        same = torch.eye(A, dtype=torch.bool, device=dev)                        # [A, A]
        blk_seen = same[None, :, None, :, None] & row_ok[:, None, None, :, :]    # [B, A, 1, A, N]
        mask = torch.cat([ctx_seen[:, :, None, :].expand(B, A, N, T).reshape(B, A * N, T),
                          blk_seen.expand(B, A, N, A, N).reshape(B, A * N, A * N)], -1)
        cx = self.context_norm(self.context_proj(aux))
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        qpos = pos.reshape(B, A * N)
        for layer in self.layers:
            attn = layer.self_attn
            x = x + attn(layer.input_layernorm(x), qpos, attn.rows(cx, ctx_pos), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = (self.final_norm(x) @ lm_head.T).view(B, A, N, -1) * c.get("logit_scale", 1.0)
        prev = seq.gather(1, pos.clamp(max=T - 1).reshape(B, A * N)).view(B, A, N)
        return logits + self.markov_head(prev) * c.get("logit_scale", 1.0)


# ---------------------------------------------------------------------------------------------
# Check against the float64 reference of tools/make_dspark_fixture.py
# ---------------------------------------------------------------------------------------------

def check(args):
    import make_dspark_fixture as fx
    torch.manual_seed(0)
    target, tcfg, tokenizer = load_target(torch.device("cpu"))
    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    # make_dspark_fixture.Drafter's MLP is SiLU: the structure is compared with SiLU (SiTU is the target's own
    # kimi_k3_reference.gated_act, which sparrow's dense MLP runs for the target already)
    cfg = dict(drafter_config(tcfg, args, mask_id), hidden_act="silu")
    drafter = DSpark(cfg).double().init_weights(torch.Generator().manual_seed(3), std=0.2)
    with torch.no_grad():   # random, not small: the comparison must see every term
        for name, p in drafter.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
    W = {n: p.detach().to(torch.bfloat16) for n, p in drafter.state_dict().items()}
    drafter.load_state_dict({n: w.double() for n, w in W.items()})
    tw = load_file(str(TARGET / "model.safetensors"))
    embed, head = tw["language_model.model.embed_tokens.weight"], tw["language_model.lm_head.weight"]
    ids = tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n").ids
    layer_ids = cfg["target_layer_ids"]
    ref_logits, ref_aux, _ = fx.target_with_aux(tcfg, tw, ids, layer_ids)
    target64 = k3.from_weights(tcfg, tw, torch.float64)
    with torch.no_grad():
        logits, aux = target_streams(target64, torch.tensor([ids]), layer_ids)
    aux_ref = torch.cat([ref_aux[t] for t in layer_ids], -1)
    e1 = (aux[0] - aux_ref).abs().max().item()
    e2 = (logits[0] - ref_logits).abs().max().item()
    print(f"  target streams vs make_dspark_fixture.target_with_aux: max |diff| aux {e1:.2e}, logits {e2:.2e}")
    ok = e1 < 1e-9 and e2 < 1e-9
    ref = fx.Drafter(cfg, W, embed, head)
    T, N = len(ids), 4
    anchors = torch.tensor([[1, 5, 9, T - N]])
    lengths = torch.tensor([[4, 2, 3, 4]])
    with torch.no_grad():
        got = drafter(aux, torch.tensor([ids]), anchors, lengths, embed.double(), head.double(), N)[0]
    for k, (a, n) in enumerate(zip(anchors[0].tolist(), lengths[0].tolist())):
        ctx = ref.context(aux_ref[:a])
        base = ref.base_logits(ctx, [ids[a]] + [mask_id] * (n - 1), a)
        want = torch.stack([base[i] + ref.markov_bias(ids[a + i]) for i in range(n)])
        err = (got[k, :n] - want).abs().max().item()
        print(f"  anchor {a}, block {n}: drafter module vs make_dspark_fixture.Drafter: max |diff| {err:.2e} "
              f"(max |logit| {want.abs().max().item():.1f})")
        ok &= err < 1e-9
    print("check:", "passed" if ok else "FAILED")
    return ok


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def load_target(device):
    tcfg = json.loads((TARGET / "config.json").read_text())
    model = k3.from_weights(tcfg, load_file(str(TARGET / "model.safetensors")), torch.float32).to(device)
    model.requires_grad_(False)
    return model, tcfg, Tokenizer.from_file(str(TARGET / "tokenizer.json"))


def make_pool(target, corpus, args, generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the target's own greedy continuations: prompts of P tokens cut from the corpus (P varied
    per chunk), continued to --context tokens. Returns (seq [n, T], prompt length per window [n])."""
    T, seqs, starts = args.context, [], []
    prompt_lengths = [4, 8, 16, 32, 64, 128]
    t0 = time.time()
    for k in range(max(1, args.pool // args.pool_chunk)):
        P = prompt_lengths[k % len(prompt_lengths)]
        prompts = small.sample_batch(corpus, args.pool_chunk, P, generator).to(device)
        seqs.append(greedy_continue(target, prompts, T))
        starts.append(torch.full((args.pool_chunk,), P, dtype=torch.long))
        print(f"    pool chunk {k}: {args.pool_chunk} windows, prompt {P}, {time.time() - t0:.0f}s", flush=True)
        if time.time() - t0 > args.pool_seconds:
            break
    return torch.cat(seqs), torch.cat(starts).to(device)


def sample_anchors(lo: torch.Tensor, T: int, A: int, N: int, probs: torch.Tensor, generator, device):
    """A anchors per window in [lo, T - N] and block lengths 1..N drawn from probs."""
    B = lo.shape[0]
    u = torch.rand(B, A, generator=generator).to(device)
    anchors = lo[:, None] + (u * (T - N + 1 - lo[:, None])).long()
    lengths = torch.multinomial(probs, B * A, replacement=True, generator=generator).view(B, A).to(device) + 1
    return anchors, lengths


def train(args):
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(args.seed)
    target, tcfg, tokenizer = load_target(device)
    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    cfg = drafter_config(tcfg, args, mask_id)
    layer_ids = cfg["target_layer_ids"]
    lm = target.language_model
    embed, head = lm.model.embed_tokens.weight.detach(), lm.lm_head.weight.detach()
    drafter = DSpark(cfg).init_weights(torch.Generator().manual_seed(args.seed),
                                       final_norm=lm.model.norm.weight.detach().cpu()).to(device)
    if args.init:
        drafter.load_state_dict({n: t.float() for n, t in load_file(str(args.init / "model.safetensors")).items()})
        print(f"  initialised from {args.init}")
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"== drafter: {n_params:,} parameters, target layers {layer_ids}, mask token {mask_id} ({MASK_TOKEN})")

    t0 = time.time()
    code, chats = small.training_texts(small.FAMILIES["kimi_k3"], small.TEMPLATES, args.seed, args.code_megabytes,
                                       args.conversations)
    corpus = small.encode_corpus(tokenizer, code, chats)[0]
    print(f"  corpus: {corpus.code.numel():,} code tokens, {corpus.chats.numel():,} chat tokens "
          f"({time.time() - t0:.0f}s)", flush=True)
    pool, pool_lo = make_pool(target, corpus, args, generator, device) if args.pool else (None, None)

    N, T, A = args.block, args.context, args.anchors
    probs = torch.tensor([float(x) for x in args.length_probs.split(",")])[:N]
    weights = torch.tensor([args.position_decay ** i for i in range(N)], device=device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = last = time.time()
    step, hist, log = 0, [], []
    while True:
        progress = (time.time() - start) / (args.minutes * 60.0)
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = small.learning_rate(progress, args.lr)
        n_pool = int(round(args.batch_size * args.pool_fraction)) if pool is not None else 0
        real = small.sample_batch(corpus, args.batch_size - n_pool, T, generator).to(device)
        lo = torch.ones(real.shape[0], dtype=torch.long, device=device)
        if n_pool:
            pick = torch.randint(pool.shape[0], (n_pool,), generator=generator).to(device)
            seq, lo = torch.cat([pool[pick], real]), torch.cat([pool_lo[pick], lo])
        else:
            seq = real
        with torch.no_grad():
            tlogits, aux = target_streams(target, seq, layer_ids)
            y = tlogits.argmax(-1)                                               # the target's greedy tokens
        anchors, lengths = sample_anchors(lo, T, A, N, probs, generator, device)
        logits = drafter(aux, seq, anchors, lengths, embed, head, N)
        pos = anchors[..., None] + torch.arange(N, device=device)
        labels = y.gather(1, pos.reshape(seq.shape[0], -1)).view(pos.shape)
        valid = (torch.arange(N, device=device) < lengths[..., None]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                             reduction="none").view(labels.shape)
        w = valid * weights
        loss = (ce * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels).float()
            full = lengths == N                                                  # blocks of the whole length
            acc = [(hit[..., i] * valid[..., i]).sum().item() / valid[..., i].sum().clamp(min=1).item()
                   for i in range(N)]
            run = hit[full].cumprod(-1).sum(-1)                                  # accepted drafts, teacher-forced
            hist.append((loss.item(), [(ce[..., i] * valid[..., i]).sum().item() / valid[..., i].sum().item()
                                       for i in range(N)], acc, 1 + run.mean().item()))
        if time.time() - last >= args.print_every or step == 1:
            k = hist[-20:]
            mean = lambda f: sum(f(h) for h in k) / len(k)  # noqa: E731
            entry = {"step": step, "seconds": round(time.time() - start), "loss": round(mean(lambda h: h[0]), 4),
                     "ce": [round(mean(lambda h: h[1][i]), 3) for i in range(N)],
                     "top1": [round(mean(lambda h: h[2][i]), 3) for i in range(N)],
                     "tf_accept_len": round(mean(lambda h: h[3]), 3)}
            log.append(entry)
            print(f"    step {step:5d} {entry['seconds']:5d}s loss {entry['loss']:.3f} ce/pos {entry['ce']} "
                  f"top1/pos {entry['top1']} teacher-forced acceptance length (N={N}) {entry['tf_accept_len']}",
                  flush=True)
            last = time.time()
    k = hist[-50:]
    final = {"steps": step, "seconds": round(time.time() - start),
             "loss": round(sum(h[0] for h in k) / len(k), 4),
             "ce": [round(sum(h[1][i] for h in k) / len(k), 3) for i in range(N)],
             "top1": [round(sum(h[2][i] for h in k) / len(k), 3) for i in range(N)],
             "tf_accept_len": round(sum(h[3] for h in k) / len(k), 3)}
    print(f"  final (mean of the last {len(k)} steps): {final}")
    return drafter, cfg, {"final": final, "log": log}


def save(drafter, cfg, info, out: Path, args):
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.bfloat16).contiguous() for n, p in sorted(drafter.state_dict().items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    info = dict(info, command="python3 tools/train_dspark_drafter.py " + " ".join(sys.argv[1:]),
                args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                torch=torch.__version__)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"  wrote {out}: {len(tensors)} tensors, {(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=TARGET / "dspark")
    parser.add_argument("--check", action="store_true", help="compare the module with make_dspark_fixture.Drafter")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--context", type=int, default=256, help="window (tokens)")
    parser.add_argument("--batch-size", type=int, default=64, help="windows per step")
    parser.add_argument("--anchors", type=int, default=48, help="anchors per window")
    parser.add_argument("--block", type=int, default=4, help="N, the longest block trained")
    parser.add_argument("--length-probs", default="0.1,0.3,0.2,0.4", help="block lengths 1..N drawn with these")
    parser.add_argument("--position-decay", type=float, default=0.8, help="loss weight of query i: decay^i")
    parser.add_argument("--pool", type=int, default=3072, help="greedy-continuation windows generated at start")
    parser.add_argument("--pool-seconds", type=float, default=1e9, help="stop generating the pool after this")
    parser.add_argument("--init", type=Path, help="start from this drafter folder's weights")
    parser.add_argument("--pool-chunk", type=int, default=512)
    parser.add_argument("--pool-fraction", type=float, default=0.5, help="share of each step's windows from the pool")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--markov-rank", type=int, default=32)
    parser.add_argument("--target-layers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 4])
    parser.add_argument("--code-megabytes", type=float, default=4.0)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--print-every", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check:
        sys.exit(0 if check(args) else 1)
    drafter, cfg, info = train(args)
    save(drafter, cfg, info, args.out, args)


if __name__ == "__main__":
    main()
