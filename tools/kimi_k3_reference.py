#!/usr/bin/env python3
"""Float64 reference of the *released* Kimi K3 text model, as vLLM 0.33.0 implements it, and a tiny
fixture generator for it. transformers has no Kimi K3, so this file is the ground truth that sparrow's
C++ implementation is tested against. Every formula names the vLLM 0.33.0 file and function it follows;
paths are relative to vllm/ (models/kimi_k3/nvidia/... unless said otherwise).

  python3 tools/kimi_k3_reference.py --self-check         # consistency checks of the reference itself
  python3 tools/kimi_k3_reference.py --out DIR [--seed N] [--variant k3|k3_1_pro|k3_1_pro_gpu]
      # config.json, generation_config.json, model.safetensors, prompts.json, reference.safetensors,
      # greedy.json, fixture.json (see VARIANTS); k3_mtp also mtp.json and mtp_reference.safetensors

The model, per token sequence processed from position 0 (prefill, causal):
  embedding -> for each layer: AttnRes mix -> input_layernorm -> KDA or MLA -> AttnRes mix ->
  post_attention_layernorm -> dense SiTU MLP or latent MoE -> ... -> final AttnRes mix -> model.norm -> lm_head.
There is no residual stream x += f(x) when attn_res_block_size is set; see forward().

Kimi K3.1 Pro = K3 plus a DeepSeek-V3.2 "lightning indexer" (DSA) on every MLA layer, present iff
text_config.index_topk is not null (fields index_n_heads, index_head_dim, index_topk). vLLM 0.33.0's
kimi_k3/nvidia code has no indexer (mla.py builds MLA with indexer=None), so the indexer follows
transformers 5.17.0, models/deepseek_v32/modeling_deepseek_v32.py::DeepseekV32Indexer.forward and
DeepseekV32Attention.forward (how the top-k masks the keys), WITHOUT its RoPE: K3 has no RoPE anywhere,
so no part of the indexer's q or k is rotated. See dsa_indexer(). Its weights are
language_model.model.layers.N.self_attn.indexer.{wq_b,wk,weights_proj}.weight, k_norm.{weight,bias}
(INFERRED: transformers' module names under the K3 self_attn prefix; no K3.1 Pro checkpoint was read).
A bf16 implementation (transformers) computes the indexer scores in fp32 from bf16 projections and a
bf16 LayerNorm; here everything is float64, and seeds with near-ties in the selection are rejected.

Where vLLM rounds to bf16 (the model dtype) and this reference does NOT (everything here is float64,
computed on the stored weights upcast to float64; a C++ test must allow for these roundings):
  * AttnRes, ops/attn_res.py::_attn_res_kernel: the partial sum s <- bf16(s + d) before attention, and
    s <- bf16(s + a) after attention (HAS_DELTA path; also the final s + d in KimiLinearModel.forward);
    the mix, the RMSNorm that follows it, and the final h are computed in fp32 and stored as bf16.
  * Every linear layer (bf16 weights, fp32 accumulation) writes bf16: all projections, kv_b_proj,
    o_proj, f_a/f_b, expert GEMMs, routed_expert_down/up_proj, lm_head. Every RMSNorm writes bf16
    (q_a/kv_a_layernorm, routed_expert_norm, model.norm). SituAndMul writes bf16.
  * MLA (mla.py): attention runs on bf16 q/k/v (fp32 softmax inside the kernel), its output is bf16,
    and attn_out * sigmoid(gate) (_gate_sigmoid_mul) is bf16.
  * KDA (kda.py::_forward, prefill path): conv outputs (causal_conv1d_fn) are bf16; l2norm_fwd writes
    bf16 q,k (the decode kernels fused_recurrent*.py normalise in fp32 instead); g (chunk cumsum) and
    beta are fp32; the state is fp32 inside the kernel and stored in the mamba ssm cache dtype;
    core_attn_out is bf16 before o_norm; o_norm (FusedRMSNormGated) writes bf16.
  * Router (model.py::KimiMoE, GateLinear out_dtype=float32): logits fp32 from bf16 x; weights fp32.
  * Real checkpoint only: routed experts are MXFP4 with FP8/MXFP8 activations (not modelled here).

INFERRED (not stated by the code):
  * Checkpoint layout of the non-layer text weights: language_model.model.embed_tokens.weight,
    language_model.model.norm.weight, language_model.model.output_attn_res_{norm,proj}.weight and
    language_model.lm_head.weight, i.e. vLLM's own module paths (KimiK3ForConditionalGeneration
    .language_model = KimiLinearForCausalLM{.model, .lm_head}). The layers are stored as
    language_model.model.layers.N.*: mtp.py::KimiK3MTP.load_weights strips "language_model." and
    then needs "model.layers.{L+i}." (its _rewrite_spec_layer_name), and
    get_spec_layer_idx_from_weight_name's comment names the "language_model.model.layers.{i}." prefix.
    hf_to_vllm_mapper's "language_model.layers." -> "language_model.model.layers." rule is taken to be
    a compatibility path for another export: it has no counterpart for embed_tokens / norm, and a
    "language_model.embed_tokens.weight" would make AutoWeightsLoader (model_executor/models/utils.py)
    raise "There is no module or parameter named ...". The fixture does not use that layout.
  * Unquantized routed experts are stored as experts.E.w{1,2,3}.weight (the .weight_packed rename in
    KimiLinearModel.load_weights applies to the MXFP4 checkpoint only). Conv taps as [P,1,W] and A_log
    as [heads] (load_weights also accepts [P,W] and the old [1,1,heads,1]; forward() accepts all).
  * The fixture's config values are invented (tiny); the release's are unknown (see real-models.md 1.1).

Where shared/docs/real-models.md section 1 and the code disagree or the notes are loose (code wins):
  * 1.1 says "dense MLP on layers l < first_k_dense_replace (and l % freq != 0)". The code
    (KimiDecoderLayer.__init__, is_moe_layer) makes layer l MoE iff num_experts is set AND
    l >= first_k_dense_replace AND l % moe_layer_freq == 0; dense otherwise (an OR, not an AND).
  * 1.2 does not round the final s <- s + d; the code does (same HAS_DELTA path of attn_res).
  * 1.7 reads as if the checkpoint stored language_model.layers.*; the MTP loader shows that
    language_model.model.layers.* is the layout the release uses (see INFERRED above).
  * 1.5: routed_scaling_factor multiplies the top-k weights inside the router
    (fused_moe/layer.py: apply_routed_scale_to_output is False for KimiMoE), before the latent
    RMSNorm, so with latent_moe_use_norm the norm cancels it exactly except for eps ("most of" in 1.5).
  * 1.5 omits the group-limited top-k for num_expert_group > 1
    (fused_moe/router/grouped_topk_router.py::grouped_topk): group score = sum of the top-2 biased
    scores of the group, keep topk_group groups, then top-k inside them. Implemented here.
  * Checked and agreeing: L2 eps 1e-6 inside the sqrt (fused_recurrent.py, l2norm.py::l2norm_fwd),
    q scale head_dim^-0.5, o_norm eps fixed at 1e-5 (fla/ops/kda.py::FusedRMSNormGated default;
    kda.py never passes rms_norm_eps), SiTU = beta*tanh(g/beta)*sigmoid(g)*lambda*tanh(u/lambda)
    (layers/activation.py::SituAndMul.forward_native), MLA scale (qk_nope+qk_rope)^-0.5, no RoPE.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

F64 = torch.float64
TEXT = "language_model."            # every text weight of the multimodal checkpoint
MODEL = TEXT + "model."             # embed_tokens, layers.N.*, norm, output_attn_res_* (INFERRED)
LM_HEAD = TEXT + "lm_head.weight"   # (INFERRED)
KDA_NORM_EPS = 1e-5                 # fla/ops/kda.py::FusedRMSNormGated(eps=1e-5), not rms_norm_eps
L2_EPS = 1e-6                       # fused_recurrent.py: x / sqrt(sum x^2 + 1e-6); l2norm_fwd(eps=1e-6)
SOFTPLUS_THRESHOLD = 20.0           # fused_recurrent.py / chunk.py: softplus(x) = x for x > 20
INDEX_K_NORM_EPS = 1e-6             # transformers DeepseekV32Indexer.__init__: nn.LayerNorm(head_dim, eps=1e-6)
GREEDY_TOKENS = 40
MIN_GAP = 3e-5                      # default: reject seeds with a relative top-k / greedy gap below this
# AttnRes query scale: logits of order 0.5. At 1.5 the random network's depth mix is sharp enough to amplify
# a 1e-7 relative perturbation of its input ~250-fold, beyond what fp32 reorderings may differ by in the tests.
ATTN_RES_GAIN = 0.5


def text_config(config: dict) -> dict:
    """The release config.json is KimiK3Config {model_type kimi_k3, text_config: KimiLinearConfig}."""
    return config.get("text_config", config)


class Params:
    """Weights by checkpoint name, upcast to float64 on access."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(F64)


class Gaps:
    """Smallest relative gap seen per decision site (top-k boundaries, greedy choice), to reject seeds
    whose decisions a bf16/fp32 implementation could flip (the same policy as make_fixtures.py)."""

    def __init__(self):
        self.smallest: dict[str, tuple[float, str]] = {}

    def note(self, site: str, values: torch.Tensor, k: int, where: str, first_row: int = 0):
        """values [rows, n]: relative gap between the k-th and (k+1)-th largest of each row; rows are
        reported counting from first_row."""
        if k >= values.shape[-1]:
            return
        top = values.sort(-1, descending=True).values
        scale = top.masked_fill(~top.isfinite(), 0.0).abs().amax(-1).clamp_min(1e-30)
        gap = (top[:, k - 1] - top[:, k]) / scale            # masked (-inf) entries give an infinite gap
        row = int(gap.argmin())
        if float(gap[row]) < self.smallest.get(site, (math.inf, ""))[0]:
            self.smallest[site] = (float(gap[row]), f"{where} row {row + first_row}")


# ---------------------------------------------------------------------------------------------
# Basic operations
# ---------------------------------------------------------------------------------------------

def linear(x, weight):
    """y = x W^T; no layer of K3 has a bias (every Linear in model.py/mla.py/kda.py has bias=False)."""
    return x @ weight.T


def rms_norm(x, weight, eps):
    """layers/layernorm.py::RMSNorm: x / sqrt(mean(x^2) + eps) * w (plain weight, not Gemma's 1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x, weight, bias, eps):
    """torch.nn.LayerNorm (elementwise affine, with bias): (x - mean) / sqrt(var + eps) * w + b, with the
    biased variance (mean of squared deviations)."""
    centered = x - x.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight + bias


def gated_act(c: dict, gate, up):
    """model.py::KimiMLP -> layers/activation.py::SituAndMul.forward_native (hidden_act "situ"):
    beta*tanh(g/beta)*sigmoid(g) * (lambda*tanh(u/lambda) if lambda is set, else u), beta defaulting to
    1.0 (KimiMLP: `activation_situ_beta or 1.0`). The MoE path (fused_moe/activation.py, situ_and_mul)
    and the specialized decode (cutedsl/common/primitives.py::situ) compute the same function."""
    if c["hidden_act"] == "silu":
        return F.silu(gate) * up
    assert c["hidden_act"] == "situ", c["hidden_act"]
    beta = c.get("activation_situ_beta") or 1.0
    lam = c.get("activation_situ_linear_beta")
    if lam is not None and lam > 0:
        up = lam * torch.tanh(up / lam)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up


def attn_res_mix(sources: list[torch.Tensor], norm_w, proj_w, eps):
    """ops/attn_res.py::_attn_res_kernel: per token, logit_i = sum_c (w_norm*w_q)[c] * v_i[c] /
    sqrt(mean_c(v_i^2) + eps), alpha = softmax over the sources, result = sum_i alpha_i v_i (the raw
    sources are mixed; only the logit sees them normalised). One source gives that source (alpha = 1)."""
    v = torch.stack(sources, 0)                                        # [S, T, H]
    query = norm_w * proj_w.reshape(-1)
    logits = (v * query).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)   # [S, T]
    return (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0)


# ---------------------------------------------------------------------------------------------
# K3.1 Pro: DSA indexer (transformers 5.17.0 deepseek_v32), no RoPE
# ---------------------------------------------------------------------------------------------

def has_indexer(c: dict) -> bool:
    """K3.1 Pro: an indexer on every MLA layer iff text_config.index_topk is not null."""
    return c.get("index_topk") is not None


def dsa_index_scores(c: dict, W: Params, p: str, x, q_latent):
    """The indexer's causal scores I [T, T] (-inf for s > t). transformers 5.17.0
    models/deepseek_v32/modeling_deepseek_v32.py::DeepseekV32Indexer.forward, minus apply_rotary_pos_emb
    (K3 has no RoPE; the same as cos = 1, sin = 0 there), with x the mixer input (hidden_states: the
    input_layernorm output) and q_latent = q_a_layernorm(q_a_proj(x)) (q_resid):
      q[t,h,:] = wq_b(q_latent)[t] viewed [T, index_n_heads, index_head_dim]
      k[s,:]   = LayerNorm(wk(x))[s]     (k_norm = nn.LayerNorm(index_head_dim, eps=1e-6), with bias)
      w[t,h]   = weights_proj(x)[t,h] * index_n_heads^-0.5
      I[t,s]   = sum_h w[t,h] * relu(q[t,h,:] . k[s,:] * index_head_dim^-0.5)   (softmax_scale)
    and I[t,s] = -inf for s > t (the causal attention_mask, bool -> masked_fill)."""
    T, nh, hd = x.shape[0], c["index_n_heads"], c["index_head_dim"]
    q = linear(q_latent, W(p + "wq_b.weight")).view(T, nh, hd)
    k = layer_norm(linear(x, W(p + "wk.weight")), W(p + "k_norm.weight"), W(p + "k_norm.bias"), INDEX_K_NORM_EPS)
    scores = F.relu(torch.einsum("thd,sd->ths", q, k) * hd ** -0.5)
    weights = linear(x, W(p + "weights_proj.weight")) * nh ** -0.5
    index = torch.einsum("th,ths->ts", weights, scores)
    return index.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


def dsa_indexer(c: dict, W: Params, p: str, x, q_latent, gaps: Gaps | None = None, where: str = ""):
    """Which keys each query token's MLA reads: a bool [T, T] mask, selected[t, s] (always s <= t).
    transformers DeepseekV32Indexer.forward returns I.topk(min(index_topk, T)) per row (I from
    dsa_index_scores); a masked key that topk picks (rows with t+1 < index_topk) stays masked, because
    DeepseekV32Attention.forward ANDs the causal mask with the top-k scatter (attention_mask & ~index_mask).
    So row t reads all its t+1 keys when t+1 <= index_topk, else its index_topk highest-scoring ones.
    Ties (exact ones occur: relu makes whole scores 0) go to the earlier key (a stable sort), so that the
    selection of row t does not depend on T; torch.topk leaves them unspecified, and fixture seeds with
    near-ties are rejected anyway: gaps records the relative gap at the top-k boundary of the rows that
    drop keys (site indexer_topk)."""
    T, topk = x.shape[0], c["index_topk"]
    index = dsa_index_scores(c, W, p, x, q_latent)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    picked = index.sort(dim=-1, descending=True, stable=True).indices[:, :min(topk, T)]
    chosen = torch.zeros(T, T, dtype=torch.bool).scatter(1, picked, True)
    if gaps is not None and T > topk:
        gaps.note("indexer_topk", index[topk:], topk, f"{where}, {T} tokens,", first_row=topk)
    return chosen & causal


# ---------------------------------------------------------------------------------------------
# MLA (mla.py::MultiHeadLatentAttention), no RoPE, sigmoid output gate
# ---------------------------------------------------------------------------------------------

def mla_attention(c: dict, W: Params, p: str, x, gaps: Gaps | None = None, where: str = ""):
    """With a K3.1 Pro indexer (has_indexer), each query attends only to the keys dsa_indexer selects
    (transformers DeepseekV32Attention.forward: attention_mask & ~index_mask on the eager path)."""
    T, nh = x.shape[0], c["num_attention_heads"]
    dn, dr, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    eps = c["rms_norm_eps"]
    # _forward_q_lora: fused_qkv_a_g_proj = [q_a_proj | kv_a_proj_with_mqa | g_proj] (linear.py::
    # KimiK3MergedQKVGateLinear); _apply_q_lora_attention: fused_q_kv_rmsnorm, then q_b_proj.
    q_latent = None
    if c.get("q_lora_rank") is not None:
        q_latent = rms_norm(linear(x, W(p + "q_a_proj.weight")), W(p + "q_a_layernorm.weight"), eps)
        q = linear(q_latent, W(p + "q_b_proj.weight"))
    else:                                                              # _forward_full_rank_q (Kimi Linear)
        q = linear(x, W(p + "q_proj.weight"))
    q = q.view(T, nh, dn + dr)                                         # per head [nope | pe]
    kv_a = linear(x, W(p + "kv_a_proj_with_mqa.weight"))
    latent = rms_norm(kv_a[:, :r], W(p + "kv_a_layernorm.weight"), eps)
    k_pe = kv_a[:, r:]                       # shared by all heads; rotary_emb is None (use_rope=False)
    # _forward_prefill_fused: kv_b_proj(latent) viewed [T, heads, nope + v] and split; K = [k_nope | k_pe].
    kv = linear(latent, W(p + "kv_b_proj.weight")).view(T, nh, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe.unsqueeze(1).expand(T, nh, dr)], -1)
    v = kv[..., dn:]
    scores = torch.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5   # self.scale = qk_head_dim**-0.5
    keys = torch.ones(T, T, dtype=torch.bool).tril()                  # causal
    if has_indexer(c):
        assert q_latent is not None, "the indexer reads the q-LoRA latent: q_lora_rank must be set"
        keys = dsa_indexer(c, W, p + "indexer.", x, q_latent, gaps, where)
    probs = scores.masked_fill(~keys, float("-inf")).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs, v).reshape(T, nh * dv)
    if c.get("mla_use_output_gate"):                                   # forward: _gate_sigmoid_mul
        out = out * torch.sigmoid(linear(x, W(p + "g_proj.weight")))
    return linear(out, W(p + "o_proj.weight"))


# ---------------------------------------------------------------------------------------------
# KDA (kda.py::KimiK3DeltaAttention, use_full_rank_gate)
# ---------------------------------------------------------------------------------------------

def kda_gate(f, A_log, dt_bias, lower_bound):
    """Per-channel log decay g [T, heads, D] (ops/third_party/kda/chunk.py::
    kda_gate_chunk_cumsum_vector_kernel, fused_recurrent.py::fused_recurrent_kda_fwd_kernel):
    s = f + dt_bias; lb*sigmoid(exp(A_log_h)*s) if gate_lower_bound is set, else -exp(A_log_h)*softplus(s)."""
    s = f + dt_bias.reshape(1, *f.shape[1:])
    a = torch.exp(A_log.reshape(-1)).view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * s)
    return -a * torch.where(s > SOFTPLUS_THRESHOLD, s, torch.log1p(torch.exp(s)))


def causal_conv_silu(x, taps, history):
    """Depthwise causal conv + SiLU (mamba/ops/causal_conv1d.py, activation "silu", no bias): out[t] =
    silu(sum_j taps[:, j] * x[t - (W-1) + j]); the last tap weighs the current token. history holds the
    W-1 inputs before x (zeros at the sequence start: the conv state). Returns (out, new history)."""
    width = taps.shape[-1]
    full = torch.cat([history, x], 0)
    out = sum(taps[:, j] * full[j:j + x.shape[0]] for j in range(width))
    return F.silu(out), full[full.shape[0] - (width - 1):]


def kda_recurrence(q, k, v, g, beta, state):
    """The gated delta rule, token by token (fused_recurrent.py::fused_recurrent_kda_fwd_kernel), per head
    with the state S [heads, V, K]: S <- S * exp(g_t) (per K column); u = beta_t (v_t - S k_t);
    S <- S + u k_t^T; o_t = S q_t. q [T,h,K] already normalised and scaled, beta [T,h]."""
    out = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t]).unsqueeze(1)
        u = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hvk,hk->hv", state, k[t]))
        state = state + u.unsqueeze(-1) * k[t].unsqueeze(1)
        out.append(torch.einsum("hvk,hk->hv", state, q[t]))
    return torch.stack(out, 0), state


def kda_layer(c: dict, W: Params, p: str, x, cache=None):
    """kda.py::KimiK3DeltaAttention.forward/_forward. cache = (conv histories, recurrent state) carried
    from an earlier call (a continued prefill); None starts from zeros. Returns (output, cache)."""
    la = c["linear_attn_config"]
    nh, D, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    assert la.get("use_full_rank_gate"), "only K3's full-rank-gate KDA is implemented"
    T, P = x.shape[0], nh * D
    # in_proj_qkvgfab = [q | k | v | g | f_a | b] from the separate checkpoint projections.
    q, k, v, g2 = (linear(x, W(p + f"{n}_proj.weight")) for n in "qkvg")
    f = linear(linear(x, W(p + "f_a_proj.weight")), W(p + "f_b_proj.weight"))
    beta = torch.sigmoid(linear(x, W(p + "b_proj.weight")))            # [T, heads]
    histories, state = cache if cache is not None else ([torch.zeros(width - 1, P, dtype=F64)] * 3,
                                                        torch.zeros(nh, D, D, dtype=F64))
    convolved, new_histories = [], []
    for name, val, hist in zip("qkv", (q, k, v), histories):
        out, h = causal_conv_silu(val, W(p + f"{name}_conv1d.weight").reshape(P, width), hist)
        convolved.append(out.view(T, nh, D))
        new_histories.append(h)
    q, k, v = convolved
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * D ** -0.5   # scale = K**-0.5
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
    g = kda_gate(f.view(T, nh, D), W(p + "A_log"), W(p + "dt_bias"), la.get("gate_lower_bound"))
    o, state = kda_recurrence(q, k, v, g, beta, state)
    # o_norm = FusedRMSNormGated(head_dim, activation="sigmoid"): RMSNorm over each head's D (eps 1e-5)
    # times o_norm.weight, times sigmoid of the full-rank gate g_proj(x).
    o = rms_norm(o, W(p + "o_norm.weight"), KDA_NORM_EPS) * torch.sigmoid(g2.view(T, nh, D))
    return linear(o.reshape(T, P), W(p + "o_proj.weight")), (new_histories, state)


# ---------------------------------------------------------------------------------------------
# FFN: dense SiTU MLP and the latent MoE
# ---------------------------------------------------------------------------------------------

def mlp(c: dict, W: Params, p: str, x):
    """model.py::KimiMLP: down(act(gate_proj x, up_proj x)); gate_up_proj = [gate_proj | up_proj]."""
    return linear(gated_act(c, linear(x, W(p + "gate_proj.weight")), linear(x, W(p + "up_proj.weight"))),
                  W(p + "down_proj.weight"))


def route(c: dict, W: Params, p: str, x, gaps: Gaps | None, where: str):
    """KimiMoE.gate (GateLinear, fp32 logits) + fused_moe/router/grouped_topk_router.py::grouped_topk
    (FusedTopKBiasRouter for one group gives the same): sigma = sigmoid(logits) (or softmax); select by
    sigma + e_score_correction_bias; weights = sigma of the selected (unbiased), renormalised when
    moe_renormalize, times routed_scaling_factor. Returns (weights [T,k], expert ids [T,k])."""
    logits = linear(x, W(p + "gate.weight"))
    if c.get("moe_router_activation_func", "sigmoid") == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, -1)
    biased = scores + W(p + "gate.e_score_correction_bias")
    k, E = c["num_experts_per_token"], c["num_experts"]
    groups, keep = c.get("num_expert_group") or 1, c.get("topk_group") or 1
    if groups > 1 and E % groups == 0:                  # GroupedTopk._compute_routing: valid_grouping()
        group_scores = biased.view(-1, groups, E // groups).topk(2, -1).values.sum(-1)
        if gaps is not None:
            gaps.note("router_groups", group_scores, keep, where)
        chosen = torch.zeros_like(group_scores, dtype=torch.bool)
        chosen.scatter_(1, group_scores.topk(keep, -1).indices, True)
        biased = biased.masked_fill(~chosen.repeat_interleave(E // groups, 1), float("-inf"))
    if gaps is not None:
        gaps.note("router_topk", biased, k, where)
    ids = biased.topk(k, -1).indices
    weights = scores.gather(1, ids)
    if c.get("moe_renormalize", True):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * c.get("routed_scaling_factor", 1.0), ids


def latent_moe(c: dict, W: Params, p: str, x, gaps: Gaps | None = None, where: str = ""):
    """model.py::KimiMoE.forward + latent_moe_runner.py / fused_moe/runner/moe_runner.py: routed experts
    run on z = routed_expert_down_proj x; their weighted sum is RMSNorm'd (routed_expert_norm, when
    latent_moe_use_norm) and routed_expert_up_proj'd (KimiRoutedOutputTransform); the shared experts
    (width moe_intermediate_size * num_shared_experts) read the original x and are added."""
    weights, ids = route(c, W, p, x, gaps, where)
    latent = c.get("routed_expert_hidden_size") is not None
    z = linear(x, W(p + "routed_expert_down_proj.weight")) if latent else x
    y = torch.zeros_like(z)
    for e in range(c["num_experts"]):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        e_p = p + f"experts.{e}."                       # w1 = gate, w3 = up, w2 = down
        h = gated_act(c, linear(z[rows], W(e_p + "w1.weight")), linear(z[rows], W(e_p + "w3.weight")))
        y.index_add_(0, rows, weights[rows, slot].unsqueeze(-1) * linear(h, W(e_p + "w2.weight")))
    if latent:
        if c.get("latent_moe_use_norm"):
            y = rms_norm(y, W(p + "routed_expert_norm.weight"), c["rms_norm_eps"])
        y = linear(y, W(p + "routed_expert_up_proj.weight"))
    if c.get("num_shared_experts"):
        y = y + mlp(c, W, p + "shared_experts.", x)
    return y


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------

def is_kda_layer(c: dict, l: int) -> bool:
    """configs/kimi_linear.py::KimiLinearConfig.is_kda_layer: kda_layers is 1-indexed."""
    la = c.get("linear_attn_config")
    return la is not None and (l + 1) in la["kda_layers"]


def is_moe_layer(c: dict, l: int) -> bool:
    """model.py::KimiDecoderLayer.__init__ (is_moe_layer)."""
    return (c.get("num_experts") is not None and l >= c.get("first_k_dense_replace", 0)
            and l % c.get("moe_layer_freq", 1) == 0)


def attention(c, W, l, x, gaps=None):
    p = f"{MODEL}layers.{l}.self_attn."
    return kda_layer(c, W, p, x)[0] if is_kda_layer(c, l) else mla_attention(c, W, p, x, gaps, f"layer {l}")


def ffn(c, W, l, x, gaps=None):
    if is_moe_layer(c, l):
        return latent_moe(c, W, f"{MODEL}layers.{l}.block_sparse_moe.", x, gaps, f"layer {l}")
    return mlp(c, W, f"{MODEL}layers.{l}.mlp.", x)


def forward(config: dict, weights: dict[str, torch.Tensor], tokens: list[int], *,
            gaps: Gaps | None = None, hidden: list | None = None,
            embedded: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """float64 logits [T, vocab] of one sequence processed from position 0 (model.py::KimiLinearModel
    .forward, KimiDecoderLayer.forward/_pre_attn_norm/_post_attn_norm, KimiLinearForCausalLM
    .compute_logits, which applies model.norm before lm_head). `hidden`, when given, receives the state
    before model.norm, what the MTP layer reads (real-models.md 1.2: the norm is compute_logits').
    `embedded`, when given, maps positions to rows [hidden] that replace the looked-up embedding there:
    an image's placeholder tokens take the vision tower's embeddings, as vLLM's
    merge_multimodal_embeddings places them (tools/make_kimi_k3_vision_fixture.py)."""
    c, W = text_config(config), Params(weights)
    L, B, eps = c["num_hidden_layers"], c.get("attn_res_block_size"), c["rms_norm_eps"]
    x = W(MODEL + "embed_tokens.weight")[torch.tensor(tokens)]
    for position, row in (embedded or {}).items():
        x[position] = row.to(F64)                   # x is the lookup's own copy: the table is untouched
    if B is None:
        # No AttnRes: the standard pre-norm residual stack (the `not self.use_attn_res` branches).
        for l in range(L):
            pre = f"{MODEL}layers.{l}."
            x = x + attention(c, W, l, rms_norm(x, W(pre + "input_layernorm.weight"), eps), gaps)
            x = x + ffn(c, W, l, rms_norm(x, W(pre + "post_attention_layernorm.weight"), eps), gaps)
    else:
        # AttnRes. blocks[j]: block slot j (blocks[0] = the embedding, blocks[j>0] = the sum of every
        # sublayer output of layers (j-1)B .. jB-1); s: the partial sum of the current block (prefix_sum);
        # d: the pending output of the previous MLP (hidden_states between layers).
        blocks, s, d = [], x, None
        for l in range(L):
            pre = f"{MODEL}layers.{l}."
            starts_block = l % B == 0                       # is_block_write_layer
            m = -(-l // B)                                  # prev_valid_blocks = cdiv(l, B)
            # _pre_attn_norm: attn_res(prefix_sum, delta=d, ..., block_write_idx=l//B if starts_block)
            if d is not None:
                s = s + d                                   # vLLM: s <- bf16(s + d)
            if starts_block:
                blocks.append(s)                            # slot l//B (== m) is written, not read here
            h = attn_res_mix(blocks[:m] + [s], W(pre + "self_attention_res_norm.weight"),
                             W(pre + "self_attention_res_proj.weight"), eps)
            a = attention(c, W, l, rms_norm(h, W(pre + "input_layernorm.weight"), eps), gaps)
            # _post_attn_norm: a new block's partial sum starts at a; otherwise s <- bf16(s + a).
            s = a if starts_block else s + a
            h = attn_res_mix(blocks[:m + starts_block] + [s], W(pre + "mlp_res_norm.weight"),
                             W(pre + "mlp_res_proj.weight"), eps)
            d = ffn(c, W, l, rms_norm(h, W(pre + "post_attention_layernorm.weight"), eps), gaps)
        # KimiLinearModel.forward: attn_res(prefix_sum, d, blocks, output_attn_res_*, no output norm,
        # num_blocks = cdiv(L, B)): every slot plus the final partial sum.
        s = s + d
        x = attn_res_mix(blocks + [s], W(MODEL + "output_attn_res_norm.weight"),
                         W(MODEL + "output_attn_res_proj.weight"), eps)
    if hidden is not None:
        hidden.append(x)
    return linear(rms_norm(x, W(MODEL + "norm.weight"), eps), W(LM_HEAD))


def mtp_forward(config: dict, weights: dict[str, torch.Tensor], next_tokens: list[int], hidden: torch.Tensor, *,
                gaps: Gaps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-token-prediction layer (mtp.py::KimiK3MultiTokenPredictorLayer, real-models.md 1.6) over
    positions 0 .. T-1 of one sequence: position p takes the token after it, next_tokens[p], and a state
    hidden[p] (the target's before model.norm, or the layer's own output for a drafted position):
      x = eh_proj([RMSNorm(embed(t); enorm) ; RMSNorm(h; hnorm)])   the embedding zeroed at position 0
      x = x + MLA(input_layernorm(x)); x = x + latent MoE(post_attention_layernorm(x))   AttnRes off
      logits = shared_head.head(RMSNorm(x; shared_head.norm))
    Returns (logits [T, vocab], x [T, hidden])."""
    c, W = text_config(config), Params(weights)
    L, eps = c["num_hidden_layers"], c["rms_norm_eps"]
    pre = f"{MODEL}layers.{L}."
    e = W(MODEL + "embed_tokens.weight")[torch.tensor(next_tokens)].clone()
    e[0] = 0.0
    x = linear(torch.cat([rms_norm(e, W(pre + "enorm.weight"), eps), rms_norm(hidden, W(pre + "hnorm.weight"), eps)], -1),
               W(pre + "eh_proj.weight"))
    x = x + mla_attention(c, W, pre + "self_attn.", rms_norm(x, W(pre + "input_layernorm.weight"), eps), gaps, "mtp")
    x = x + latent_moe(c, W, pre + "block_sparse_moe.", rms_norm(x, W(pre + "post_attention_layernorm.weight"), eps),
                       gaps, "mtp")
    return linear(rms_norm(x, W(pre + "shared_head.norm.weight"), eps), W(pre + "shared_head.head.weight")), x


# ---------------------------------------------------------------------------------------------
# The tiny fixture model
# ---------------------------------------------------------------------------------------------

# 8 layers, KDA:MLA like K3 (layers 2, 5, 7 0-indexed are MLA). attn_res_block_size 3: slots are written
# at layers 0, 3, 6 and the last block (layers 6, 7) is partial, with a non-writing layer in it.
TINY_TEXT_CONFIG = dict(
    model_type="kimi_linear",
    vocab_size=256, hidden_size=64, num_hidden_layers=8, rms_norm_eps=1e-6,
    attn_res_block_size=3,
    linear_attn_config=dict(kda_layers=[1, 2, 4, 5, 7], full_attn_layers=[3, 6, 8], num_heads=4,
                            head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                            use_full_rank_gate=True),
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True, mla_use_output_gate=True,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    intermediate_size=96, first_k_dense_replace=1, moe_layer_freq=1,
    num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, routed_expert_hidden_size=32,
    num_shared_experts=1, latent_moe_use_norm=True, routed_scaling_factor=2.5,
    moe_router_activation_func="sigmoid", moe_renormalize=True, use_grouped_topk=True,
    num_expert_group=1, topk_group=1, topk_method="noaux_tc",
    num_nextn_predict_layers=0, tie_word_embeddings=False, max_position_embeddings=4096,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)
TINY_CONFIG = dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"],
                   text_config=TINY_TEXT_CONFIG)
FP32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "_conv1d.weight")
PROMPT_LENGTHS = [12, 40, 70]

# K3.1 Pro: TINY plus an indexer on the MLA layers 2, 5, 7; top-16 < the 40- and 70-token prompts.
# 8 index heads, not 4: a key whose q.k is <= 0 in every head scores exactly 0 (relu), which with 4
# heads happens for 1 key in 16, and such exact ties sat at the top-16 boundary in all of seeds 1..20.
TINY_PRO_TEXT_CONFIG = dict(TINY_TEXT_CONFIG, index_n_heads=8, index_head_dim=16, index_topk=16)
TINY_PRO_CONFIG = dict(TINY_CONFIG, text_config=TINY_PRO_TEXT_CONFIG)

# K3.1 Pro in shapes sparrow's GPU kernels take: kv_lora_rank 512 + qk_rope_head_dim 64 (the 576-wide
# MLA cache row), indexer 32 heads x 128 with top-64, KDA head_dim 64, conv width 4. q_lora_rank 64,
# qk_nope/v_head_dim 32, 2 KDA heads and routed_expert_hidden_size 64 (instead of 128, 64/64, 4, 128)
# keep model.safetensors near 11 MB; the kernels do not constrain those.
GPU_PRO_TEXT_CONFIG = dict(
    TINY_PRO_TEXT_CONFIG,
    vocab_size=256, hidden_size=128,
    # 4 layers (KDA, KDA, MLA, KDA) in AttnRes blocks of 2: bf16's rounding grows with depth, and 8 layers of
    # a random network would put the GPU beyond its bf16 tolerance (the variant's notes).
    num_hidden_layers=4, attn_res_block_size=2,
    linear_attn_config=dict(TINY_TEXT_CONFIG["linear_attn_config"], kda_layers=[1, 2, 4], full_attn_layers=[3],
                            num_heads=2, head_dim=64),
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
    qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
    intermediate_size=256, moe_intermediate_size=64, routed_expert_hidden_size=64,
    index_n_heads=32, index_head_dim=128, index_topk=64,
    num_experts_per_token=8,  # every expert routed: bf16 on the GPU cannot flip a routing choice
)
GPU_PRO_CONFIG = dict(TINY_CONFIG, text_config=GPU_PRO_TEXT_CONFIG)

# K3 with its multi-token-prediction layer (layer 8: MLA, since 9 is not a KDA layer, and the latent MoE).
MTP_CONFIG = dict(TINY_CONFIG, text_config=dict(TINY_TEXT_CONFIG, num_nextn_predict_layers=1))
MTP_DRAFTS = 3

K3_DESCRIPTION = ("released Kimi K3 text model (AttnRes, KDA + MLA without RoPE, latent MoE, SiTU) "
                  "as vLLM 0.33.0 implements it; reference in float64 on the stored weights, "
                  "no bf16 rounding of activations")
PRO_DESCRIPTION = ("Kimi K3.1 Pro text model: the released K3 (AttnRes, KDA + MLA without RoPE, latent MoE, "
                   "SiTU) as vLLM 0.33.0 implements it, plus a DeepSeek-V3.2 DSA indexer on every MLA layer as "
                   "transformers 5.17.0 DeepseekV32Indexer/DeepseekV32Attention implement it, without RoPE; "
                   "reference in float64 on the stored weights, no bf16 rounding of activations")

# --variant: config, prompt lengths, default greedy length and near-tie threshold, weight gains
# (random_weights), notes for fixture.json.
VARIANTS = {
    "k3": dict(config=TINY_CONFIG, prompt_lengths=PROMPT_LENGTHS, greedy_tokens=GREEDY_TOKENS, min_gap=MIN_GAP,
               gain=1.5, head_gain=2.0, description=K3_DESCRIPTION, notes=None),
    "k3_1_pro": dict(config=TINY_PRO_CONFIG, prompt_lengths=PROMPT_LENGTHS, greedy_tokens=GREEDY_TOKENS,
                     min_gap=MIN_GAP, gain=1.5, head_gain=2.0, description=PRO_DESCRIPTION,
                     notes="the k3 config plus index_n_heads 8, index_head_dim 16, index_topk 16: the 40- and "
                           "70-token prompts (and the greedy continuations) exceed the top-k budget. 8 index "
                           "heads rather than 4: with 4, a key with q.k <= 0 in every head scores exactly 0 "
                           "(relu) for about 1 key in 16, and such exact ties fell on the top-16 boundary in "
                           "every seed 1..20. Weight gains are the k3 ones"),
    "k3_mtp": dict(config=MTP_CONFIG, prompt_lengths=PROMPT_LENGTHS, greedy_tokens=16, min_gap=MIN_GAP,
                   gain=1.5, head_gain=2.0, description=K3_DESCRIPTION + "; with its multi-token-prediction layer "
                   "(mtp.py::KimiK3MultiTokenPredictorLayer) and what it drafts (mtp.json, mtp_reference.safetensors)",
                   notes="the k3 config with num_nextn_predict_layers 1: layer 8 is the MTP layer (MLA and the latent "
                         "MoE), drawn after the model's weights. mtp.json: for each prompt the greedy next token and "
                         f"{MTP_DRAFTS} greedy drafts; mtp_reference.safetensors: the layer's logits at every prompt "
                         "position (position p reads the token after it, the last the greedy next token); their "
                         "decisions (and the layer's routing) are checked for near-ties like the model's"),
    "k3_1_pro_gpu": dict(config=GPU_PRO_CONFIG, prompt_lengths=[20, 100, 140], greedy_tokens=24, min_gap=1e-5,
                         gain=1.0, head_gain=2.0, description=PRO_DESCRIPTION,
                         notes="shapes the GPU kernels take (kv_lora_rank 512, qk_rope_head_dim 64, indexer "
                               "32 heads x 128 with top-64, KDA head_dim 64, conv 4); the 100- and 140-token "
                               "prompts (the lengths tests/cuda/kimi_gpu_test.cpp expects) exceed the top-64 budget. q_lora_rank 64, qk_nope_head_dim 32, "
                               "v_head_dim 32, 2 KDA heads and routed_expert_hidden_size 64 (rather than 128, "
                               "64, 64, 4, 128) (and hidden 128, 4 heads, vocabulary 256) keep the fixture near the other GPU fixtures' ~5 MB. 24 greedy tokens (not 40) and a "
                               "near-tie threshold of 1e-5 (not 3e-5, as for tests/fixtures/kimi_k3_gpu): the "
                               "top-64 of up to 173 keys scored by 32 heads has relative gaps of ~1e-5 at its "
                               "boundary in some of the ~500 rows checked. All 8 experts routed (top-8), as in tests/fixtures/"
                               "kimi_linear_gpu, so that bf16 on the GPU cannot flip a routing choice. Weight gains "
                               "are 1.0, not k3's 1.5, and there are 4 layers, not 8: with 8 layers at gain 1.5 this random "
                               "network amplifies bf16 rounding of its activations to 5-10% in its logits (rounding "
                               "every linear output, norm and AttnRes mix of tools/kimi_k3_reference.py to bf16 moves "
                               "them that much), beyond the GPU test's 4% bf16 tolerance"),
}


def random_weights(config: dict, gen: torch.Generator, gain=1.5, head_gain=2.0) -> dict[str, torch.Tensor]:
    """float64 weights by checkpoint name. Matrices N(0, gain^2/fan_in) (lm_head: head_gain), the
    embedding N(0, 1), norm scales 1 + N(0, 0.1^2), AttnRes queries N(0, ATTN_RES_GAIN^2/H) (logits of order 0.5).
    KDA decay: A = exp(A_log) in [1, 4], dt_bias ~ N(-2, 1), f_b gain 0.3, so exp(g) spans ~0.1..1
    and the state remembers over many tokens. K3.1 Pro indexer (drawn after each MLA layer's own weights,
    so a config without one draws exactly the K3 stream): wq_b, wk, weights_proj like any matrix,
    k_norm weight 1 + N(0, 0.1^2) and bias N(0, 0.1^2)."""
    c = text_config(config)
    H, V, eps_std = c["hidden_size"], c["vocab_size"], 0.1
    out: dict[str, torch.Tensor] = {}

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=F64) * std + mean

    def mat(name, rows, cols, g=gain):
        out[name] = normal((rows, cols), g / math.sqrt(cols))

    def norm(name, n):
        out[name] = normal((n,), eps_std, 1.0)

    out[MODEL + "embed_tokens.weight"] = normal((V, H), 1.0)
    la = c["linear_attn_config"]
    nh, dn, dr, dv = (c[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))

    def mla_weights(a):
        mat(a + "q_a_proj.weight", c["q_lora_rank"], H)
        norm(a + "q_a_layernorm.weight", c["q_lora_rank"])
        mat(a + "q_b_proj.weight", nh * (dn + dr), c["q_lora_rank"])
        mat(a + "kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + dr, H)
        norm(a + "kv_a_layernorm.weight", c["kv_lora_rank"])
        mat(a + "kv_b_proj.weight", nh * (dn + dv), c["kv_lora_rank"])
        mat(a + "g_proj.weight", nh * dv, H)
        mat(a + "o_proj.weight", H, nh * dv)
        if has_indexer(c):                          # drawn last: a K3 config draws the same stream
            ix, inh, ihd = a + "indexer.", c["index_n_heads"], c["index_head_dim"]
            mat(ix + "wq_b.weight", inh * ihd, c["q_lora_rank"])
            mat(ix + "wk.weight", ihd, H)
            norm(ix + "k_norm.weight", ihd)
            out[ix + "k_norm.bias"] = normal((ihd,), eps_std)
            mat(ix + "weights_proj.weight", inh, H)

    def moe_weights(m):
        Z, I = c["routed_expert_hidden_size"], c["moe_intermediate_size"]
        mat(m + "gate.weight", c["num_experts"], H)
        out[m + "gate.e_score_correction_bias"] = normal((c["num_experts"],), 0.05)
        mat(m + "routed_expert_down_proj.weight", Z, H)
        norm(m + "routed_expert_norm.weight", Z)
        mat(m + "routed_expert_up_proj.weight", H, Z)
        for e in range(c["num_experts"]):
            mat(m + f"experts.{e}.w1.weight", I, Z)
            mat(m + f"experts.{e}.w3.weight", I, Z)
            mat(m + f"experts.{e}.w2.weight", Z, I)
        S = I * c["num_shared_experts"]
        mat(m + "shared_experts.gate_proj.weight", S, H)
        mat(m + "shared_experts.up_proj.weight", S, H)
        mat(m + "shared_experts.down_proj.weight", H, S)

    nh_k, D, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = nh_k * D
    for l in range(c["num_hidden_layers"]):
        pre = f"{MODEL}layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            norm(pre + n + ".weight", H)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            out[pre + n + ".weight"] = normal((1, H), ATTN_RES_GAIN / math.sqrt(H))
        a = pre + "self_attn."
        if is_kda_layer(c, l):
            for n in "qkvg":
                mat(a + f"{n}_proj.weight", P, H)
                if n != "g":
                    out[a + f"{n}_conv1d.weight"] = normal((P, 1, width), 1.0 / math.sqrt(width))
            mat(a + "f_a_proj.weight", D, H)
            mat(a + "f_b_proj.weight", P, D, 0.3)
            mat(a + "b_proj.weight", nh_k, H)
            out[a + "A_log"] = torch.rand(nh_k, generator=gen, dtype=F64) * math.log(4.0)
            out[a + "dt_bias"] = normal((P,), 1.0, -2.0)
            norm(a + "o_norm.weight", D)
            mat(a + "o_proj.weight", H, P)
        else:
            mla_weights(a)
        if is_moe_layer(c, l):
            moe_weights(pre + "block_sparse_moe.")
        else:
            mat(pre + "mlp.gate_proj.weight", c["intermediate_size"], H)
            mat(pre + "mlp.up_proj.weight", c["intermediate_size"], H)
            mat(pre + "mlp.down_proj.weight", H, c["intermediate_size"])
    norm(MODEL + "norm.weight", H)
    norm(MODEL + "output_attn_res_norm.weight", H)
    out[MODEL + "output_attn_res_proj.weight"] = normal((1, H), ATTN_RES_GAIN / math.sqrt(H))
    mat(LM_HEAD, V, H, head_gain)
    if c.get("num_nextn_predict_layers"):
        # The MTP layer (real-models.md 1.6), drawn last so that configs without one draw the same stream:
        # MLA (as the model's MLA layers), the latent MoE, its norms, eh_proj and the shared head.
        pre = f"{MODEL}layers.{c['num_hidden_layers']}."
        for n in ("input_layernorm", "post_attention_layernorm", "enorm", "hnorm", "shared_head.norm"):
            norm(pre + n + ".weight", H)
        mat(pre + "eh_proj.weight", H, 2 * H)
        mla_weights(pre + "self_attn.")
        moe_weights(pre + "block_sparse_moe.")
        mat(pre + "shared_head.head.weight", V, H, head_gain)
    return out


def storage_dtype(name: str) -> torch.dtype:
    """bf16 like the release (real-models.md 1.8), fp32 for what vLLM keeps in fp32 (kda.py: A_log,
    dt_bias, conv1d params_dtype=float32; model.py: e_score_correction_bias)."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Self-checks
# ---------------------------------------------------------------------------------------------

def kda_chunked(q, k, v, g, beta, state, chunk: int):
    """The same recurrence in chunk-parallel form (the algebra of chunk.py's WY representation), written
    independently of kda_recurrence. Inside a chunk, with G_t = sum_{i<=t} g_i (per channel):
      S_t = S0 e^{G_t} + sum_{i<=t} u_i (k_i e^{G_t - G_i})^T,
      (I + diag(beta) A) U = diag(beta) (V - (e^G * K) S0^T),  A[t,i] = sum_c k_t k_i e^{G_t - G_i}, i < t,
      O = (e^G * Q) S0^T + M U,  M[t,i] = sum_c q_t k_i e^{G_t - G_i}, i <= t."""
    outs = []
    for a in range(0, q.shape[0], chunk):
        qc, kc, vc, gc, bc = (t[a:a + chunk].transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
        C = qc.shape[1]
        G = gc.cumsum(1)                                                    # [h, C, K]
        diff = G.unsqueeze(2) - G.unsqueeze(1)                              # [h, t, i, K]
        incl = torch.ones(C, C, dtype=torch.bool).tril()
        decay = torch.exp(diff.masked_fill(~incl[None, :, :, None], -math.inf))
        A = torch.einsum("htc,hic,htic->hti", kc, kc, decay).masked_fill(~incl.tril(-1), 0.0)
        M = torch.einsum("htc,hic,htic->hti", qc, kc, decay)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("htk,hvk->htv", torch.exp(G) * kc, state))
        U = torch.linalg.solve_triangular(torch.eye(C, dtype=F64) + bc.unsqueeze(-1) * A, rhs, upper=False)
        outs.append((torch.einsum("htk,hvk->htv", torch.exp(G) * qc, state) + M @ U).transpose(0, 1))
        last = torch.exp(G[:, -1:] - G)                                    # e^{G_C - G_i}
        state = state * torch.exp(G[:, -1]).unsqueeze(1) + torch.einsum("hiv,hik->hvk", U, kc * last)
    return torch.cat(outs, 0), state


def self_check(seed: int) -> bool:
    gen = torch.Generator().manual_seed(seed)
    W64 = random_weights(TINY_CONFIG, gen)
    c, W = TINY_TEXT_CONFIG, Params(W64)
    tokens = torch.randint(2, c["vocab_size"], (70,), generator=gen).tolist()
    results = []

    def report(name, err, tol=1e-12):
        results.append(err <= tol)
        print(f"  [{'PASS' if err <= tol else 'FAIL'}] {name}: max |diff| = {err:.3e} (tol {tol:g})")

    # (a) KDA: token-by-token == chunked form, and == a prefill split in two (state carried).
    x = torch.randn(70, c["hidden_size"], generator=gen, dtype=F64)
    la = c["linear_attn_config"]
    nh, D = la["num_heads"], la["head_dim"]
    q = F.normalize(torch.randn(70, nh, D, generator=gen, dtype=F64), dim=-1) * D ** -0.5
    k = F.normalize(torch.randn(70, nh, D, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(70, nh, D, generator=gen, dtype=F64)
    g = kda_gate(torch.randn(70, nh, D, generator=gen, dtype=F64), W(f"{MODEL}layers.0.self_attn.A_log"),
                 W(f"{MODEL}layers.0.self_attn.dt_bias"), la["gate_lower_bound"])
    beta = torch.rand(70, nh, generator=gen, dtype=F64)
    s0 = torch.randn(nh, D, D, generator=gen, dtype=F64)
    o_ref, s_ref = kda_recurrence(q, k, v, g, beta, s0)
    for chunk in (16, 7):
        o_ch, s_ch = kda_chunked(q, k, v, g, beta, s0, chunk)
        report(f"(a) KDA recurrence == chunked form (chunk {chunk}, 70 tokens), outputs",
               (o_ch - o_ref).abs().max().item())
        report(f"(a) KDA recurrence == chunked form (chunk {chunk}), final state", (s_ch - s_ref).abs().max().item())
    p = f"{MODEL}layers.0.self_attn."
    whole, (_, s_whole) = kda_layer(c, W, p, x)
    first, cache = kda_layer(c, W, p, x[:29])
    second, (_, s_split) = kda_layer(c, W, p, x[29:], cache)
    report("(a) KDA layer over 70 tokens == 29 + 41 continued from the saved conv/recurrent state",
           max((torch.cat([first, second]) - whole).abs().max().item(), (s_split - s_whole).abs().max().item()))

    # (b) causality: the logits of a prefix equal the first rows of the full prompt's logits.
    full = forward(TINY_CONFIG, W64, tokens)
    for n in (1, 12, 41):
        report(f"(b) causality: logits of the {n}-token prefix == rows [:{n}] of the 70-token forward",
               (forward(TINY_CONFIG, W64, tokens[:n]) - full[:n]).abs().max().item())

    # (c) attn_res_block_size null: forward() is the pre-norm residual stack; recompute it the way vLLM
    # writes it (hidden_states and residual kept apart, fused add + RMSNorm before each sublayer).
    plain_cfg = dict(TINY_CONFIG, text_config=dict(c, attn_res_block_size=None))
    plain_w = {n: t for n, t in W64.items() if "attn_res" not in n and "_res_" not in n}
    got = forward(plain_cfg, plain_w, tokens[:40])
    eps, Wp = c["rms_norm_eps"], Params(plain_w)
    hidden, residual = Wp(MODEL + "embed_tokens.weight")[torch.tensor(tokens[:40])], None
    for l in range(c["num_hidden_layers"]):
        pre = f"{MODEL}layers.{l}."
        residual = hidden if residual is None else hidden + residual
        hidden = attention(c, Wp, l, rms_norm(residual, Wp(pre + "input_layernorm.weight"), eps))
        residual = hidden + residual
        hidden = ffn(c, Wp, l, rms_norm(residual, Wp(pre + "post_attention_layernorm.weight"), eps))
    want = linear(rms_norm(hidden + residual, Wp(MODEL + "norm.weight"), eps), Wp(LM_HEAD))
    report("(c) attn_res_block_size null == explicit (hidden, residual) pre-norm stack, 40 tokens",
           (got - want).abs().max().item())
    print(f"  (logits with AttnRes: std {full.std().item():.3f}; without: std {got.std().item():.3f}; "
          f"AttnRes changes them by up to {(full[:40] - got).abs().max().item():.3f})")

    # (d)-(g) K3.1 Pro: the TINY config plus a top-16 indexer on the MLA layers (2, 5, 7).
    pro_w = random_weights(TINY_PRO_CONFIG, gen)
    plain_pro_w = {n: t for n, t in pro_w.items() if ".indexer." not in n}
    no_index = forward(TINY_CONFIG, plain_pro_w, tokens)
    for topk in (len(tokens), 100):
        wide = dict(TINY_PRO_CONFIG, text_config=dict(TINY_PRO_TEXT_CONFIG, index_topk=topk))
        report(f"(d) index_topk {topk} >= 70 tokens: K3.1 Pro logits == same weights without the indexer",
               (forward(wide, pro_w, tokens) - no_index).abs().max().item())
    pro_full = forward(TINY_PRO_CONFIG, pro_w, tokens)
    for n in (1, 12, 16, 17, 41):
        report(f"(e) causality with the top-16 indexer: {n}-token prefix == rows [:{n}] of the 70-token forward",
               (forward(TINY_PRO_CONFIG, pro_w, tokens[:n]) - pro_full[:n]).abs().max().item())
    report("(f) top-16 indexer: rows [:16] (every key selected) == the forward without the indexer",
           (pro_full[:16] - no_index[:16]).abs().max().item())
    changed = (pro_full[16:] - no_index[16:]).abs().max().item()
    results.append(changed > 1e-3)
    print(f"  [{'PASS' if changed > 1e-3 else 'FAIL'}] (f) top-16 indexer: rows [16:] differ from the forward "
          f"without it: max |diff| = {changed:.3e} (must be > 1e-3)")
    # (g) dsa_indexer == transformers' DeepseekV32Indexer.forward with the identity rotation (cos 1, sin 0).
    try:
        from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    except ImportError as error:
        print(f"  [SKIP] (g) transformers DeepseekV32Indexer not importable: {error}")
    else:
        pc, T = TINY_PRO_TEXT_CONFIG, len(tokens)
        hf_cfg = DeepseekV32Config(hidden_size=pc["hidden_size"], q_lora_rank=pc["q_lora_rank"],
                                   qk_rope_head_dim=8, index_n_heads=pc["index_n_heads"],
                                   index_head_dim=pc["index_head_dim"], index_topk=pc["index_topk"])
        hf = DeepseekV32Indexer(hf_cfg, 2).to(F64)
        ip = f"{MODEL}layers.2.self_attn.indexer."
        hf.load_state_dict({n: pro_w[ip + n] for n in hf.state_dict()})
        xi = torch.randn(T, pc["hidden_size"], generator=gen, dtype=F64)
        qi = torch.randn(T, pc["q_lora_rank"], generator=gen, dtype=F64)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        ident = (torch.ones(1, T, 8, dtype=F64), torch.zeros(1, T, 8, dtype=F64))
        idx = hf(xi[None], qi[None], ident, causal[None], None)[0].long()
        hf_mask = torch.zeros(T, T, dtype=torch.bool).scatter(1, idx, True) & causal
        ours = dsa_indexer(pc, Params(pro_w), ip, xi, qi)
        # transformers scores in fp32 (q.float(), k.float()) and leaves ties to torch.topk: compare the
        # rows whose top-k boundary is clear (relative gap > 1e-5); rows t < 16 keep every key.
        top = dsa_index_scores(pc, Params(pro_w), ip, xi, qi).sort(-1, descending=True).values
        k = pc["index_topk"]
        clear = torch.ones(T, dtype=torch.bool)
        clear[k:] = (top[k:, k - 1] - top[k:, k]) > 1e-5 * top[k:, 0].abs().clamp_min(1e-30)
        report(f"(g) dsa_indexer == transformers DeepseekV32Indexer (cos 1, sin 0), top-16: mismatched "
               f"(query, key) pairs over the {int(clear.sum())} of {T} rows without a near-tie",
               float((hf_mask != ours)[clear].sum()), 0.0)
        # The forward returns indices only; check the scores I with transformers' own modules and
        # attributes (wq_b, k_norm with its eps, weights_proj, softmax_scale, n_heads) in its formula.
        with torch.no_grad():
            hq = hf.wq_b(qi).view(T, pc["index_n_heads"], pc["index_head_dim"])
            hk = hf.k_norm(hf.wk(xi))
            hs = F.relu(torch.matmul(hq.transpose(0, 1), hk.T) * hf.softmax_scale)        # [H, T, T]
            hw = hf.weights_proj(xi) * hf.n_heads ** -0.5
            hI = torch.matmul(hw.unsqueeze(-2), hs.permute(1, 0, 2)).squeeze(-2).masked_fill(~causal, -math.inf)
        ours_I = dsa_index_scores(pc, Params(pro_w), ip, xi, qi)
        report("(g) dsa_index_scores == the transformers modules (wq_b, nn.LayerNorm k_norm, weights_proj, "
               "softmax_scale, n_heads^-0.5) composed as in DeepseekV32Indexer.forward",
               (ours_I[causal] - hI[causal]).abs().max().item())
    print("self-check:", "all passed" if all(results) else "FAILED")
    return all(results)


# ---------------------------------------------------------------------------------------------
# Fixture
# ---------------------------------------------------------------------------------------------

def greedy_gap(row: torch.Tensor) -> float:
    top = row.sort(descending=True).values
    return float((top[0] - top[1]) / row.abs().max().clamp_min(1e-30))


def generation_config(config: dict) -> dict:
    """generation_config.json in the format of the other fixtures (tests/fixtures/kimi_k3)."""
    c = text_config(config)
    return {"_from_model_config": True, "bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"],
            "output_attentions": False, "output_hidden_states": False, "transformers_version": "5.17.0",
            "use_cache": True}


def build_fixture(out: Path, variant: str, first_seed: int, max_tries: int, greedy_tokens: int | None,
                  min_gap: float | None, command: str):
    v = VARIANTS[variant]
    config, prompt_lengths = v["config"], v["prompt_lengths"]
    greedy_tokens = v["greedy_tokens"] if greedy_tokens is None else greedy_tokens
    min_gap = v["min_gap"] if min_gap is None else min_gap
    rejected = []
    for seed in range(first_seed, first_seed + max_tries):
        gen = torch.Generator().manual_seed(seed)
        stored = {n: t.to(storage_dtype(n)).contiguous()
                  for n, t in random_weights(config, gen, v["gain"], v["head_gain"]).items()}
        vocab = text_config(config)["vocab_size"]
        prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
        gaps = Gaps()
        logits = [forward(config, stored, p, gaps=gaps) for p in prompts]
        completions, greedy = [], (math.inf, "")

        def near_ties():
            found = dict(gaps.smallest, greedy_top1_top2=greedy)
            return found, [f"{site} gap {gap:.2e} ({where})" for site, (gap, where) in found.items() if gap < min_gap]

        # A seed with a near-tie so far is rejected whatever follows: stop generating at the first one.
        found, problems = near_ties()
        for i, prompt in enumerate(prompts):
            ids = list(prompt)
            for step in range(greedy_tokens):
                if problems:
                    break
                last = logits[i][-1] if step == 0 else forward(config, stored, ids, gaps=gaps)[-1]
                if greedy_gap(last) < greedy[0]:
                    greedy = (greedy_gap(last), f"prompt {i} step {step}")
                ids.append(int(last.argmax()))
                found, problems = near_ties()
            completions.append(ids[len(prompt):])
        mtp = None
        if not problems and text_config(config).get("num_nextn_predict_layers"):
            mtp = {"next": [], "drafts": [], "logits": {}}
            for i, prompt in enumerate(prompts):
                hidden: list = []
                forward(config, stored, prompt, hidden=hidden)
                next_token = completions[i][0]
                tokens, states = prompt[1:] + [next_token], hidden[0]
                mtp_logits, x = mtp_forward(config, stored, tokens, states, gaps=gaps)
                mtp["logits"][f"mtp_logits.{i}"] = mtp_logits.float().contiguous()
                drafts = []
                for d in range(MTP_DRAFTS):
                    if greedy_gap(mtp_logits[-1]) < greedy[0]:
                        greedy = (greedy_gap(mtp_logits[-1]), f"mtp prompt {i} draft {d}")
                    drafts.append(int(mtp_logits[-1].argmax()))
                    # One more position: the draft, and the layer's own output state at the position before.
                    tokens, states = tokens + [drafts[-1]], torch.cat([states, x[-1:]], 0)
                    mtp_logits, x = mtp_forward(config, stored, tokens, states, gaps=gaps)
                mtp["next"].append(next_token)
                mtp["drafts"].append(drafts)
            found, problems = near_ties()
        if problems:
            rejected.append({"seed": seed, "why": problems})
            print(f"seed {seed} rejected: {'; '.join(problems)}", flush=True)
            continue
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
        save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
        # The reference must be what the files mean: reload and rerun on the stored values.
        reloaded = load_file(out / "model.safetensors")
        assert all(torch.equal(reloaded[n], t) for n, t in stored.items()) and reloaded.keys() == stored.keys()
        again = [forward(json.loads((out / "config.json").read_text()), reloaded, p) for p in prompts]
        assert all(torch.equal(a, b) for a, b in zip(again, logits))
        (out / "prompts.json").write_text(json.dumps({"prompts": prompts}) + "\n")
        (out / "greedy.json").write_text(json.dumps({"completions": completions}) + "\n")
        save_file({f"logits.{i}": l.float().contiguous() for i, l in enumerate(logits)},
                  out / "reference.safetensors")
        if mtp:
            save_file(mtp["logits"], out / "mtp_reference.safetensors")
            (out / "mtp.json").write_text(json.dumps({"next": mtp["next"], "drafts": mtp["drafts"]}) + "\n")
        stats = [{"tokens": len(p), "mean": l.mean().item(), "std": l.std().item(), "min": l.min().item(),
                  "max": l.max().item(), "mean_top1_probability": l.softmax(-1).amax(-1).mean().item()}
                 for p, l in zip(prompts, logits)]
        info = {
            "family": "kimi_k3", "variant": variant, "generator": "tools/kimi_k3_reference.py",
            "command": command, "description": v["description"],
            **({"notes": v["notes"]} if v["notes"] else {}),
            "storage": "bfloat16 (float32: A_log, dt_bias, e_score_correction_bias, conv taps)",
            "seed": seed, "rejected_seeds": rejected, "prompt_lengths": prompt_lengths,
            "greedy_tokens": greedy_tokens, "weight_gain": v["gain"], "head_gain": v["head_gain"],
            "torch": torch.__version__, "min_gap_threshold": min_gap,
            "smallest_relative_gaps": {s: {"gap": g, "where": w} for s, (g, w) in sorted(found.items())},
            "logits": stats,
        }
        (out / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{out}: seed {seed}, {len(stored)} tensors, {size / 1024:.0f} KiB")
        for s in stats:
            print(f"  prompt of {s['tokens']:2d}: logits mean {s['mean']:+.3f} std {s['std']:.3f} "
                  f"min {s['min']:+.2f} max {s['max']:+.2f}, mean top-1 prob {s['mean_top1_probability']:.2f}")
        for site, (gap, where) in sorted(found.items()):
            print(f"  smallest relative gap {gap:.2e}  {site} ({where})")
        return
    raise SystemExit(f"no seed in {first_seed}..{first_seed + max_tries - 1} is free of near-ties")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the fixture into this folder")
    parser.add_argument("--self-check", action="store_true", help="run the reference's self-checks")
    parser.add_argument("--seed", type=int, default=1, help="first seed tried (default 1)")
    parser.add_argument("--max-tries", type=int, default=20, help="seeds tried before giving up")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="k3",
                        help="fixture model: k3 (tiny K3), k3_1_pro (tiny K3 + DSA indexer), "
                             "k3_1_pro_gpu (K3.1 Pro in GPU-kernel shapes); default k3")
    parser.add_argument("--greedy-tokens", type=int, default=None,
                        help="greedy.json length (default: the variant's)")
    parser.add_argument("--min-gap", type=float, default=None,
                        help="reject seeds with a relative router / indexer top-k or greedy gap below this "
                             f"(default: the variant's, {MIN_GAP:g} except k3_1_pro_gpu)")
    args = parser.parse_args()
    if not args.out and not args.self_check:
        parser.error("give --out DIR and/or --self-check")
    torch.set_num_threads(1)
    ok = self_check(args.seed) if args.self_check else True
    if args.out:
        build_fixture(args.out, args.variant, args.seed, args.max_tries, args.greedy_tokens, args.min_gap,
                      " ".join(["python3", "tools/kimi_k3_reference.py"] + sys.argv[1:]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
