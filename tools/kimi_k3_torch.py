#!/usr/bin/env python3
"""A trainable, batched PyTorch module of the released Kimi K3 text model: exactly the network of
tools/kimi_k3_reference.py (the float64, unbatched ground truth written from vLLM 0.33's code), without
the K3.1 Pro DSA indexer. tools/train_small_models.py trains the bundled models/kimi_k3 with it.

    python3 tools/kimi_k3_torch.py --self-check    # float64 module == kimi_k3_reference.forward (TINY_CONFIG)

  * state_dict() keys are the release checkpoint names the reference reads (language_model.model.*,
    language_model.lm_head.weight), so load_state_dict(load_file(".../model.safetensors")) loads a
    release-layout file and the trained weights save as one; the routers' e_score_correction_bias is a
    buffer (moved by load balancing, not by the optimizer).
  * forward(input_ids [B, T]) -> logits [B, T, vocab], every sequence processed from position 0 (causal).
  * KDA runs in the chunk-parallel (WY) form of kimi_k3_reference.kda_chunked, batched over sequences,
    heads and chunks; only the chunk-to-chunk state update is sequential. Inside a chunk the decays are
    factored around the chunk's middle token, e^{G_t - G_i} = e^{G_t - G_m} e^{G_m - G_i}, so that with
    gate_lower_bound -5 and chunks of 16 no factor leaves e^{+-40} (safe in float32).
  * MLA: scaled_dot_product_attention, causal, scale (qk_nope + qk_rope)^-0.5, no RoPE, sigmoid gate.
  * Latent MoE: the router is route() of the reference (grouped sigmoid top-k on score + bias, weights =
    unbiased scores of the selected, renormalised, times routed_scaling_factor); the routed experts are
    computed densely on every token and weighted by the sparse routing weights (exactly 0 for experts
    not chosen), which at this size is faster than gathering tokens per expert.
  * KDA and the router run in float32 even under autocast (as vLLM keeps g, beta, the state and the
    router logits in fp32); the rest follows the module's dtype (float64 for the self-check).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

TOOLS = Path(__file__).resolve().parent
KDA_NORM_EPS = 1e-5       # fla FusedRMSNormGated default (kda.py never passes rms_norm_eps)
L2_EPS = 1e-6             # l2norm_fwd: x / sqrt(sum x^2 + 1e-6)
KDA_CHUNK = 16


def load_reference():
    """tools/kimi_k3_reference.py as a module (tools/ is not a package)."""
    name = "kimi_k3_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / "kimi_k3_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def rms_norm(x, weight, eps):
    if x.dtype in (torch.float16, torch.bfloat16):      # under autocast: normalise in float32
        x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# The gated activation (SiLU or SiTU) is the reference's own: it is written on tensors, batched or not.
gated_act = load_reference().gated_act


def attn_res_mix(sources: list[torch.Tensor], norm_w, proj_w, eps):
    """ops/attn_res.py: softmax over the sources of (w_norm * w_q) . v_i / rms(v_i), mixing the raw v_i."""
    if len(sources) == 1:
        return sources[0]
    v = torch.stack(sources, 0)                                              # [S, B, T, H]
    query = norm_w * proj_w.reshape(-1)
    logits = (v * query).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)     # [S, B, T]
    return (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Weight(nn.Module):
    """A bare `.weight` (conv taps [P, 1, W])."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)   # no layer of K3 has a bias


# ---------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------

def kda_gate(f, A_log, dt_bias, lower_bound):
    """kimi_k3_reference.kda_gate, batched: f [B, T, h, D] -> log decay g [B, T, h, D]."""
    s = f + dt_bias.reshape(f.shape[-2:])
    a = torch.exp(A_log.reshape(-1)).view(-1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * s)
    return -a * torch.where(s > 20.0, s, torch.log1p(torch.exp(s)))


def kda_chunked(q, k, v, g, beta, chunk: int = KDA_CHUNK, state=None):
    """The gated delta rule (S <- S diag(e^{g_t}); u = beta_t (v_t - S k_t); S <- S + u k_t^T; o_t = S q_t)
    in chunk-parallel form. q, k, g [B, h, T, K], v [B, h, T, V], beta [B, h, T], state [B, h, V, K] or None.
    Returns (o [B, h, T, V], final state). See kimi_k3_reference.kda_chunked for the algebra; here the
    triangular solve is taken once per chunk as an inverse (WY form), batched over all chunks:
      U = T^-1 diag(beta) V - T^-1 diag(beta) (e^G K) S0^T,  T = I + diag(beta) A."""
    B, h, T, K = q.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:   # k = 0, beta = 0, g = 0: padded tokens leave the state alone
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N, C = (T + pad) // chunk, chunk
    q, k, g = (t.reshape(B, h, N, C, K) for t in (q, k, g))
    v, beta = v.reshape(B, h, N, C, V), beta.reshape(B, h, N, C, 1)
    G = g.cumsum(-2)                                         # per channel, from the chunk's start (<= 0)
    mid = G[..., C // 2:C // 2 + 1, :]
    up, down = torch.exp(G - mid), torch.exp(mid - G)        # e^{G_t - G_m}, e^{G_m - G_i}
    k_down = k * down
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = ((k * up) @ k_down.transpose(-1, -2)).masked_fill(~lower.tril(-1), 0.0)   # i < t
    M = ((q * up) @ k_down.transpose(-1, -2)).masked_fill(~lower, 0.0)            # i <= t
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T_inv = torch.linalg.solve_triangular(eye + beta * A, eye.expand(B, h, N, C, C), upper=False)
    eG = torch.exp(G)
    Wk = T_inv @ (beta * eG * k)                             # [B, h, N, C, K]
    Ub = T_inv @ (beta * v)                                  # [B, h, N, C, V]
    Qg = q * eG
    G_end = G[..., -1:, :]
    K_end = k * torch.exp(G_end - G)                         # k_i e^{G_C - G_i}
    decay_end = torch.exp(G_end)                             # [B, h, N, 1, K]
    S = torch.zeros(B, h, V, K, dtype=q.dtype, device=q.device) if state is None else state
    outs = []
    # unbind (not indexing inside the loop): its backward is one stack, not N full-size zero tensors.
    for ub, wk, qg, m, de, ke in zip(*(t.unbind(2) for t in (Ub, Wk, Qg, M, decay_end, K_end))):
        St = S.transpose(-1, -2)                             # [B, h, K, V]
        U = ub - wk @ St
        outs.append(qg @ St + m @ U)
        S = S * de + U.transpose(-1, -2) @ ke
    o = torch.stack(outs, 2).reshape(B, h, N * C, V)[:, :, :T]
    return o, S


class KimiDeltaAttention(nn.Module):
    """kda.py::KimiK3DeltaAttention (use_full_rank_gate): kimi_k3_reference.kda_layer, batched."""

    def __init__(self, c: dict):
        super().__init__()
        la = c["linear_attn_config"]
        assert la.get("use_full_rank_gate"), "only K3's full-rank-gate KDA is implemented"
        self.heads, self.head_dim, self.width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        self.lower_bound = la.get("gate_lower_bound")
        H, D, P = c["hidden_size"], self.head_dim, self.heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (linear(H, P) for _ in range(4))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (Weight(P, 1, self.width) for _ in range(3))
        self.f_a_proj, self.f_b_proj = linear(H, D), linear(D, P)
        self.b_proj = linear(H, self.heads)
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = RMSNorm(D, KDA_NORM_EPS)
        self.o_proj = linear(P, H)

    def conv(self, x, taps):
        """Depthwise causal conv + SiLU over T (zero history): out[t] = sum_j taps[:, j] x[t - (W-1) + j]."""
        # Shifted multiply-adds: on a CPU much faster than a depthwise conv1d's backward.
        T, W = x.shape[1], self.width
        full = F.pad(x, (0, 0, W - 1, 0))
        taps = taps.to(x.dtype).reshape(-1, W)
        return F.silu(sum(taps[:, j] * full[:, j:j + T] for j in range(W)))

    def forward(self, x):
        B, T, _ = x.shape
        h, D = self.heads, self.head_dim
        with torch.autocast(x.device.type, enabled=False):
            x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            q, k, v = (self.conv(proj(x), c.weight).view(B, T, h, D)
                       for proj, c in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                       (self.v_proj, self.v_conv1d)))
            q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * D ** -0.5
            k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
            g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, h, D), self.A_log, self.dt_bias,
                         self.lower_bound)
            beta = torch.sigmoid(self.b_proj(x))                                   # [B, T, h]
            o, _ = kda_chunked(*(t.transpose(1, 2) for t in (q, k, v, g, beta)))
            o = self.o_norm(o.transpose(1, 2)) * torch.sigmoid(self.g_proj(x).view(B, T, h, D))
            return self.o_proj(o.reshape(B, T, h * D))


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------

class MultiHeadLatentAttention(nn.Module):
    """mla.py: q LoRA, latent KV, no RoPE (k_pe shared by the heads, used as is), sigmoid output gate."""

    def __init__(self, c: dict):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.heads = c["num_attention_heads"]
        self.dn, self.dr, self.dv, self.r = (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                                             c["kv_lora_rank"])
        qk = self.heads * (self.dn + self.dr)
        self.q_lora = c.get("q_lora_rank") is not None
        if self.q_lora:
            self.q_a_proj = linear(H, c["q_lora_rank"])
            self.q_a_layernorm = RMSNorm(c["q_lora_rank"], eps)
            self.q_b_proj = linear(c["q_lora_rank"], qk)
        else:
            self.q_proj = linear(H, qk)
        self.kv_a_proj_with_mqa = linear(H, self.r + self.dr)
        self.kv_a_layernorm = RMSNorm(self.r, eps)
        self.kv_b_proj = linear(self.r, self.heads * (self.dn + self.dv))
        self.gated = bool(c.get("mla_use_output_gate"))
        if self.gated:
            self.g_proj = linear(H, self.heads * self.dv)
        self.o_proj = linear(self.heads * self.dv, H)

    def forward(self, x):
        B, T, _ = x.shape
        nh, dn, dr, dv = self.heads, self.dn, self.dr, self.dv
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, T, nh, dn + dr).transpose(1, 2)
        kv_a = self.kv_a_proj_with_mqa(x)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_a[..., :self.r])).view(B, T, nh, dn + dv)
        k_pe = kv_a[..., self.r:].unsqueeze(2).expand(B, T, nh, dr)
        k = torch.cat([kv[..., :dn], k_pe], -1).transpose(1, 2)
        v = kv[..., dn:].transpose(1, 2)
        # v zero-padded to the q/k width: SDPA's fused kernels want one head size (the CPU's falls back
        # to the slow math path otherwise); the padded columns of the output are 0 and dropped.
        pad = max(0, dn + dr - dv)
        out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)), is_causal=True, scale=(dn + dr) ** -0.5)
        out = out[..., :dv].transpose(1, 2).reshape(B, T, nh * dv)
        if self.gated:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


# ---------------------------------------------------------------------------------------------
# FFN
# ---------------------------------------------------------------------------------------------

class MLP(nn.Module):
    """model.py::KimiMLP: down(act(gate_proj x, up_proj x))."""

    def __init__(self, c: dict, n_in: int, width: int):
        super().__init__()
        self.c = c
        self.gate_proj, self.up_proj, self.down_proj = linear(n_in, width), linear(n_in, width), linear(width, n_in)

    def forward(self, x):
        return self.down_proj(gated_act(self.c, self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    def __init__(self, n_in: int, width: int):
        super().__init__()
        self.w1, self.w3, self.w2 = linear(n_in, width), linear(n_in, width), linear(width, n_in)


class MoEGate(nn.Module):
    """KimiMoE.gate + grouped_topk: kimi_k3_reference.route, batched over tokens x [N, H].
    Returns (logits, weights [N, k], expert ids [N, k]) - the last element is what
    train_small_models.RouterBalancer counts."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.zeros(c["num_experts"], c["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(c["num_experts"]))

    def forward(self, x):
        c = self.c
        with torch.autocast(x.device.type, enabled=False):   # GateLinear(out_dtype=float32)
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
            if c.get("moe_router_activation_func", "sigmoid") == "sigmoid":
                scores = torch.sigmoid(logits)
            else:
                scores = torch.softmax(logits, -1)
            biased = scores.detach() + self.e_score_correction_bias.to(dtype)   # selection only
            k, E = c["num_experts_per_token"], c["num_experts"]
            groups, keep = c.get("num_expert_group") or 1, c.get("topk_group") or 1
            if groups > 1 and E % groups == 0:
                group_scores = biased.view(-1, groups, E // groups).topk(2, -1).values.sum(-1)
                chosen = torch.zeros_like(group_scores, dtype=torch.bool)
                chosen.scatter_(1, group_scores.topk(keep, -1).indices, True)
                biased = biased.masked_fill(~chosen.repeat_interleave(E // groups, 1), float("-inf"))
            ids = biased.topk(k, -1).indices
            weights = scores.gather(1, ids)
            if c.get("moe_renormalize", True):
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights * c.get("routed_scaling_factor", 1.0), ids


class LatentMoE(nn.Module):
    """model.py::KimiMoE: kimi_k3_reference.latent_moe, with the routed experts computed densely."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        H, E, I = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
        self.latent = c.get("routed_expert_hidden_size") is not None
        Z = c["routed_expert_hidden_size"] if self.latent else H
        self.gate = MoEGate(c)
        if self.latent:
            self.routed_expert_down_proj = linear(H, Z)
            if c.get("latent_moe_use_norm"):
                self.routed_expert_norm = RMSNorm(Z, c["rms_norm_eps"])
            self.routed_expert_up_proj = linear(Z, H)
        self.experts = nn.ModuleList(Expert(Z, I) for _ in range(E))
        if c.get("num_shared_experts"):
            self.shared_experts = MLP(c, H, I * c["num_shared_experts"])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        _, weights, ids = self.gate(x)
        E = len(self.experts)
        dense = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        z = self.routed_expert_down_proj(x) if self.latent else x
        w1 = torch.cat([e.w1.weight for e in self.experts])                  # [E*I, Z]
        w3 = torch.cat([e.w3.weight for e in self.experts])
        w2 = torch.cat([e.w2.weight for e in self.experts], 1)               # [Z, E*I]
        h = gated_act(self.c, z @ w1.T, z @ w3.T).view(x.shape[0], E, -1)
        y = (h * dense.to(h.dtype).unsqueeze(-1)).reshape(x.shape[0], -1) @ w2.T
        if self.latent:
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y.view(shape)


# ---------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------

def is_kda_layer(c: dict, l: int) -> bool:
    la = c.get("linear_attn_config")
    return la is not None and (l + 1) in la["kda_layers"]          # 1-indexed


def is_moe_layer(c: dict, l: int) -> bool:
    return (c.get("num_experts") is not None and l >= c.get("first_k_dense_replace", 0)
            and l % c.get("moe_layer_freq", 1) == 0)


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, l: int):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        if c.get("attn_res_block_size") is not None:
            self.self_attention_res_norm, self.mlp_res_norm = RMSNorm(H, eps), RMSNorm(H, eps)
            self.self_attention_res_proj, self.mlp_res_proj = linear(H, 1), linear(H, 1)
        self.self_attn = KimiDeltaAttention(c) if is_kda_layer(c, l) else MultiHeadLatentAttention(c)
        if is_moe_layer(c, l):
            self.block_sparse_moe = LatentMoE(c)
        else:
            self.mlp = MLP(c, H, c["intermediate_size"])

    def ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class KimiLinearModel(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        H = c["hidden_size"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], H)
        self.layers = nn.ModuleList(DecoderLayer(c, l) for l in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        if c.get("attn_res_block_size") is not None:
            self.output_attn_res_norm = RMSNorm(H, c["rms_norm_eps"])
            self.output_attn_res_proj = linear(H, 1)

    def forward(self, input_ids):
        """model.py::KimiLinearModel.forward (kimi_k3_reference.forward): the final hidden states after norm."""
        eps, Bsz = self.c["rms_norm_eps"], self.c.get("attn_res_block_size")
        x = self.embed_tokens(input_ids)
        dtype = x.dtype                  # the residual sums stay in the weights' dtype under autocast

        def attention(layer, h):
            return layer.self_attn(layer.input_layernorm(h)).to(dtype)

        def ffn(layer, h):
            return layer.ffn(layer.post_attention_layernorm(h)).to(dtype)

        if Bsz is None:
            for layer in self.layers:
                x = x + attention(layer, x)
                x = x + ffn(layer, x)
            return self.norm(x)
        blocks, s, d = [], x, None
        for l, layer in enumerate(self.layers):
            starts_block = l % Bsz == 0
            m = -(-l // Bsz)
            if d is not None:
                s = s + d
            if starts_block:
                blocks.append(s)
            h = attn_res_mix(blocks[:m] + [s], layer.self_attention_res_norm.weight,
                             layer.self_attention_res_proj.weight, eps)
            a = attention(layer, h)
            s = a if starts_block else s + a
            h = attn_res_mix(blocks[:m + starts_block] + [s], layer.mlp_res_norm.weight,
                             layer.mlp_res_proj.weight, eps)
            d = ffn(layer, h)
        s = s + d
        x = attn_res_mix(blocks + [s], self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, eps)
        return self.norm(x)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.model = KimiLinearModel(c)
        self.lm_head = linear(c["hidden_size"], c["vocab_size"])


class KimiK3ForConditionalGeneration(nn.Module):
    """The text part of the release's KimiK3ForConditionalGeneration: .language_model.{model, lm_head}."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.text = text_config(config)
        c = self.text
        assert c.get("index_topk") is None, "K3.1 Pro's DSA indexer is not implemented here"
        assert not c.get("tie_word_embeddings"), "K3 does not tie the embedding and the output head"
        self.language_model = KimiLinearForCausalLM(c)

    def forward(self, input_ids, **_ignored):
        """input_ids [B, T] (or [T]) -> logits [B, T, vocab] (or [T, vocab])."""
        squeeze = input_ids.dim() == 1
        ids = input_ids[None] if squeeze else input_ids
        logits = self.language_model.lm_head(self.language_model.model(ids))
        return logits[0] if squeeze else logits

    @torch.no_grad()
    def generate_greedy(self, ids: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
        """Greedy continuation, recomputing the whole sequence at every step (no cache)."""
        device = next(self.parameters()).device
        out = list(ids)
        for _ in range(max_new_tokens):
            nxt = int(self(torch.tensor([out], device=device))[0, -1].argmax())
            out.append(nxt)
            if nxt == stop_id:
                break
        return out[len(ids):]

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02):
        """Training initialisation: matrices N(0, std^2) (output projections std / sqrt(2 layers)),
        norms 1, AttnRes queries 0 (uniform mixes at the start), conv taps N(0, 1/W), KDA decay
        A = exp(A_log) in [1, 16] and dt_bias ~ N(-2, 0.5^2) (decays e^g mostly in 0.3 .. 1), router bias 0."""
        c = self.text
        out_std = std / math.sqrt(2 * c["num_hidden_layers"])
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 2)[-2:]
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=generator) * math.log(16.0))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5 - 2.0)
            elif "_conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
            elif "_res_proj" in name:
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif leaf[0] in ("o_proj", "down_proj", "w2", "routed_expert_up_proj"):
                p.copy_(torch.randn(p.shape, generator=generator) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        for name, b in self.named_buffers():
            b.zero_()
        return self


def from_weights(config: dict, weights: dict[str, torch.Tensor], dtype=torch.float32) -> KimiK3ForConditionalGeneration:
    """The module with exactly these (release-named) weights, upcast to dtype; every name must match."""
    model = KimiK3ForConditionalGeneration(config).to(dtype)
    missing, unexpected = model.load_state_dict({n: t.to(dtype) for n, t in weights.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def self_check(seed: int) -> bool:
    ref = load_reference()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    weights = ref.random_weights(ref.TINY_CONFIG, gen)
    model = from_weights(ref.TINY_CONFIG, weights, torch.float64)
    assert set(model.state_dict()) == set(weights), "state_dict keys != the reference's checkpoint names"
    c = ref.text_config(ref.TINY_CONFIG)
    tokens = torch.randint(2, c["vocab_size"], (70,), generator=gen).tolist()
    ok = True
    with torch.no_grad():
        want = ref.forward(ref.TINY_CONFIG, weights, tokens)
        got = model(torch.tensor(tokens))
        err = relative_error(got, want)
        print(f"  float64 module vs kimi_k3_reference.forward, TINY_CONFIG, 70 tokens: max relative error "
              f"{err:.3e} (max |diff| {(got - want).abs().max().item():.3e}, max |logit| {want.abs().max().item():.2f})")
        ok &= err < 1e-9
        # Batched: two sequences of different content in one batch == each alone.
        other = torch.randint(2, c["vocab_size"], (70,), generator=gen)
        both = model(torch.stack([torch.tensor(tokens), other]))
        err_b = max(relative_error(both[0], want), relative_error(both[1], model(other)))
        print(f"  batch of 2 == each sequence alone: max relative error {err_b:.3e}")
        ok &= err_b < 1e-9
        # KDA chunk sizes agree (16, 7, 64), and the float32 module stays close.
        la = c["linear_attn_config"]
        nh, D = la["num_heads"], la["head_dim"]
        qkvg = [torch.randn(2, nh, 70, D, generator=gen, dtype=torch.float64) for _ in range(4)]
        q = F.normalize(qkvg[0], dim=-1) * D ** -0.5
        k = F.normalize(qkvg[1], dim=-1)
        g = -5.0 * torch.sigmoid(qkvg[3] + 1.0)
        beta = torch.rand(2, nh, 70, generator=gen, dtype=torch.float64)
        o_ref = torch.stack([ref.kda_recurrence(q[b].transpose(0, 1), k[b].transpose(0, 1), qkvg[2][b].transpose(0, 1),
                                                g[b].transpose(0, 1), beta[b].transpose(0, 1),
                                                torch.zeros(nh, D, D, dtype=torch.float64))[0].transpose(0, 1)
                             for b in range(2)])
        for chunk in (16, 7, 64):
            o, _ = kda_chunked(q, k, qkvg[2], g, beta, chunk)
            e = relative_error(o, o_ref)
            print(f"  kda_chunked (chunk {chunk}) vs kimi_k3_reference.kda_recurrence, gates near the lower "
                  f"bound: max relative error {e:.3e}")
            ok &= e < 1e-9 if chunk <= 16 else e < 1e-6
        got32 = from_weights(ref.TINY_CONFIG, weights, torch.float32)(torch.tensor(tokens))
        err32 = relative_error(got32, want)
        print(f"  float32 module vs the reference: max relative error {err32:.3e}")
        ok &= err32 < 1e-4
    print("self-check:", "passed" if ok else "FAILED")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-check", action="store_true", help="compare with tools/kimi_k3_reference.py")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.self_check:
        parser.error("nothing to do: give --self-check")
    sys.exit(0 if self_check(args.seed) else 1)


if __name__ == "__main__":
    main()
