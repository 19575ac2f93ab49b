#!/usr/bin/env python3
"""Builds the DSpark drafter's fixture for MiniMax-M3.1 (Qwen3DSparkModel, the DFlash Qwen3 backbone with a Markov
head): a tiny random draft model for the target tests/fixtures/minimax_m3, and what it drafts for a set of prompts,
from an independent float64 reference written from vLLM 0.33.0's code (read, not copied). Paths below are relative
to vllm/:

  model_executor/models/qwen3_dspark.py     Qwen3DSparkModel / Qwen3DSparkForCausalLM (compute_draft_logits,
                                            map_draft_to_target, load_weights: d2t, no "model." prefix on disk),
                                            DSparkMarkovHead (markov_w1 Embedding over the target vocab,
                                            markov_w2 ParallelLMHead over the draft vocab)
  model_executor/models/qwen3_dflash.py     DFlashQwen3Attention, DFlashQwen3DecoderLayer, DFlashQwen3Model
                                            (_project_context_kv, _normalize_context_k,
                                            precompute_and_store_context_kv, forward), _resolve_layer_attention
                                            (use_swa / swa_window_size, causal), DFlashQwen3ForCausalLM
                                            .combine_hidden_states (fc only)
  v1/worker/gpu/spec_decode/dspark/speculator.py   DSparkSpeculator._sample_sequential (greedy Markov chain)
  v1/worker/gpu/spec_decode/dflash/speculator.py   _prepare_dflash_inputs_kernel (SAMPLE_FROM_ANCHOR positions)
  v1/worker/gpu/spec_decode/dspark/utils.py        load_dspark_model (the target's embed_tokens is shared)
  v1/worker/gpu/spec_decode/utils.py               get_parallel_drafting_token_id (dflash_config.mask_token_id)
  v1/worker/gpu/spec_decode/eagle/eagle3_utils.py  get_eagle3_aux_layers_from_config (aux id = t + 1)
  model_executor/models/interfaces.py              _maybe_add_hidden_state (captures hidden_states + residual)
  models/minimax_m3/nvidia/model.py                MiniMaxM3Model.forward (capture after layer idx as id idx + 1)
  v1/attention/backends/flashinfer.py              FlashInferImpl: sliding_window w -> window_left = w - 1;
                                                   FlashInferMetadataBuilder: non-causal draft runs go to the
                                                   prefill wrapper, planned with causal=False and window_left
  v1/attention/backends/flash_attn.py              _maybe_symmetrize_window ((w-1, 0) -> (w-1, w-1) non-causal)
and shared/docs/real-models.md section 3. The target is run by HF transformers (MiniMaxM3VLForCausalLM, as
tools/make_fixtures.py builds tests/fixtures/minimax_m3), upcast to float64.

  python3 tools/make_qwen3_dspark_fixture.py --out tests/fixtures/minimax_m3_dspark

What the reference computes, for a prompt t_0 .. t_{n-1} (positions 0 .. n-1), everything in float64 on the stored
weights (the target's fp16, the drafter's bf16, upcast), no intermediate rounding (vLLM rounds every GEMM / norm
output to bf16 and keeps the drafter's KV cache in fp8 in the article's setup; a C++ test must allow for that):

  Target (transformers MiniMaxM3VLForCausalLM on tests/fixtures/minimax_m3: 3 layers, the dense GQA layer 0 and
    the MSA layers 1-2 with a 3 x 8 = 24 key budget, MoE). transformers computes RMSNorm, the router sigmoid, the
    rotary cos/sin, the indexer scores and the eager softmax in float32 even for a float64 model; those islands are
    lifted to float64 in-process (lift_float32_islands(): Tensor.float() and softmax(dtype=float32) leave float64
    tensors in float64, and the rotary embedding is evaluated in float64), so the whole forward is float64.
    bonus = argmax of the target's logits at position n-1 (its greedy next token t_n).
    aux_t[p] for t in dflash_config.target_layer_ids = [0, 1]: the target's residual stream after decoder layer t.
      get_eagle3_aux_layers_from_config maps DFlash's t to the capture id t + 1; MiniMaxM3Model.forward calls
      _maybe_add_hidden_state(aux, idx + 1, hidden_states, residual) after layer idx, which stores
      hidden_states + residual = the full stream after layer idx. In transformers that is
      output_hidden_states' hidden_states[t + 1] (hidden_states[0] is the embedding; the last entry is replaced by
      the final-normed state, which is why target_layer_ids must stay below the last layer).
    aux[p] = [aux_0[p] | aux_1[p]]  (concatenated in target_layer_ids order, [n, 2*64]).

  Drafter (DFlashQwen3Model), H = 64, 2 layers, 4 query heads, 2 kv heads, head_dim 16, MLP 96, eps 1e-6:
    Qwen3 RMSNorm: RMSNorm(x; w) = x / sqrt(mean(x^2) + eps) * w  (plain w, NOT the target's Gemma 1 + w).
    c[p] = RMSNorm(fc(aux[p]); hidden_norm)     combine_hidden_states applies fc only; _project_context_kv applies
                                                hidden_norm (ops.rms_norm with _hidden_norm_weight) before the K/V
                                                projection. c does NOT pass through any input_layernorm.
    context rows of layer j (precompute_and_store_context_kv, at the target positions p = 0 .. n-1):
      K_j[p] = rope(RMSNorm_per_head(k_proj_j c[p]; k_norm_j), p),  V_j[p] = v_proj_j c[p]
    query block (_prepare_dflash_inputs_kernel with SAMPLE_FROM_ANCHOR, N = num_speculative_tokens = 4):
      tokens [bonus, m, m, m] with m = dflash_config.mask_token_id = 3, at positions n, n+1, n+2, n+3
      (query_pos = last_valid_pos + 1 + query_off); query i predicts the token at n + 1 + i (sample_pos).
      x = embed_tokens(tokens), the TARGET's model.embed_tokens (load_dspark_model shares it; no mask_embedding),
      then per layer j (DFlashQwen3DecoderLayer, residual form):
        h = RMSNorm(x; input_layernorm_j)
        q = rope(RMSNorm_per_head(q_proj h; q_norm)), k = rope(RMSNorm_per_head(k_proj h; k_norm)), v = v_proj h;
        the block's own 4 K/V rows join the n context rows (the block's rows are written to the cache too);
        GQA: query head g reads kv head g // 2; scale head_dim^-0.5; no sink, no v_scale, no bias;
        NON-CAUSAL (layer_types absent, no is_causal / dflash_config.causal: _dflash_layer_causal -> False), with
        the sliding window of use_swa / swa_window_size = w = 16 on every layer: a query at position q sees the key
        at position k iff  k >= q - (w - 1)  (w keys ending at its own position, plus every block key to its
        right; no right limit). INFERRED, not read off one line of vLLM: FlashInferImpl turns the layer's
        sliding_window w into window_left = w - 1 and FlashInferMetadataBuilder plans the non-causal draft batch
        through BatchPrefillWithPagedKVCacheWrapper.plan(causal=False, window_left=w-1); FlashInfer's kernel (not in the
        wheel; include/flashinfer/attention/variants.cuh) masks with
        kv_idx + qo_len + window_left >= kv_len + qo_idx, i.e. key index >= the query's end-aligned absolute
        index - window_left, and applies no causal limit when causal is false. FlashAttention's non-causal path
        (_maybe_symmetrize_window) uses (w-1, w-1) instead, i.e. also k <= q + (w - 1); the block is 4 wide, so no
        block key is ever more than 3 < w - 1 to the right and both conventions give the same numbers here
        (the fixture's "sensitivity" records this). Which kernel FLASHINFER_TS / XQA picks per GPU and whether
        the XQA draft mask honours the window was not traced.
        x = x + o_proj(attention)
        x = x + down_proj(silu(gate_proj h2) * up_proj h2),  h2 = RMSNorm(x; post_attention_layernorm_j)
      hN = RMSNorm(x; norm); base_logits = hN @ lm_head^T over the 200 DRAFT ids (the drafter's own lm_head,
      compute_draft_logits: no d2t scatter; logit_scale 1).
    RoPE (get_rope, is_neox_style default True, rope_parameters without partial_rotary_factor): NeoX rotate-half
      over all 16 dims, inv_freq_i = theta^(-2i/16), i = 0..7, theta 1e6: (x_i, x_{i+8}) ->
      (x_i cos - x_{i+8} sin, x_{i+8} cos + x_i sin), angle = position * inv_freq_i.
    Markov greedy drafts (DSparkSpeculator._sample_sequential with draft_logits None, DSparkMarkovHead):
      prev = bonus (a target id, the anchor's input id); for i = 0..3:
        logits_i = base_logits_i + markov_w2 @ markov_w1[prev]     markov_w1 rows are TARGET ids [256, 8],
                                                                  markov_w2 rows are DRAFT ids [200, 8]
        d_i = argmax over the 200 draft ids;  prev = d_i + d2t[d_i]  (map_draft_to_target: a target id)
      The drafts are the target ids prev; draft_ids are the d_i.

The reference is checked in-process: transformers' float64 target reproduces the float32 logits stored in
tests/fixtures/minimax_m3/reference.safetensors and the first token of greedy.json; hidden_states[t + 1] is exactly
what a forward hook sees leaving decoder layer t; the NeoX rotation equals multiplication by e^{i angle} of the
complex pairs (x_i, x_{i+8}); the drafter's query-block forward equals transformers' own Qwen3 modules
(Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding) run on the 4 block tokens over a DynamicCache holding the
context K/V, with an additive mask written from FlashInfer's index predicate rather than from positions; the greedy
argmax in draft space, mapped by d2t, equals the argmax of the logits scattered into the target vocab (vLLM's
probabilistic path / DFlash compute_logits); the stored weights reloaded from disk give the same drafts.

Weights: random from --seed (linear N(0, 1/fan_in), norms 1 + N(0, 0.1^2), markov N(0, 0.5^2)), stored in bf16
under the released checkpoint's names, without the "model." prefix (Qwen3DSparkForCausalLM.load_weights adds it to
everything but lm_head and d2t) and without embed_tokens (shared with the target). d2t [200] int64 (vLLM:
target_id = draft_id + d2t[draft_id]) comes from a random sorted subset of 200 of the 256 target ids that contains
every case's bonus token (drawn from the same seed). A seed is rejected when any draft decision (top1 - top2 of
logits_i) is below --min-gap (absolute, default 0.05). It is also rejected as uninformative when the Markov bias
changes fewer than --min-markov-changes (default 3) of the draft argmaxes, when the drafts at the mask positions are
the same tokens in every case, when indexing markov_w1 by draft ids instead of target ids would give the same
drafts, when ignoring the sliding window would give the same drafts, or when no draft's draft id differs from its
target id (d2t unexercised).

Prompts: --prompt-lengths (default 6, 14, 20, 40, 70, 100: below the window, straddling it, past the window and past
the target's 24-key MSA budget), tokens uniform in 2..255 (0 and 1 are bos / eos) from --prompt-seed. A prompt seed
is rejected when a target next-token margin is below --min-gap, or when any top-k in the target (MSA blocks, MoE
experts) has a relative k / k+1 gap below tools/make_fixtures.py's 3e-5 (its GapMonitor), so the bonus and the aux
states do not hinge on rounding.

Writes into --out: config.json (the drafter's config), model.safetensors, fixture.json {generator, command, target,
description, notes, storage, seed, rejected_seeds, prompt_seed, rejected_prompt_seeds, min_gap_threshold,
target_topk_min_relative_gap, torch, transformers, num_speculative_tokens, target_check, self_checks, sensitivity,
cases: [{prompt, bonus, drafts, draft_ids, min_gap, draft_gaps, bonus_gap, base_argmax}]},
dspark_reference.safetensors float32: aux.<i> [n_i, 128], base_logits.<i> [4, 200] (draft vocab, before the
Markov bias), markov_logits.<i> [4, 200] (with it, along the greedy chain).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM3VLForCausalLM
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm3

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from make_fixtures import DEFAULT_MIN_GAP as TOPK_MIN_REL_GAP, GapMonitor  # noqa: E402
from dspark_fixture_util import RandomWeights, check_close  # noqa: E402

F64 = torch.float64
TARGET = "tests/fixtures/minimax_m3"
NUM_SPECULATIVE_TOKENS = 4
PROMPT_LENGTHS = [6, 14, 20, 40, 70, 100]
# Stored target logits are transformers' float32 forward; ours is float64. Relative to the row's largest |logit|.
TARGET_REL_TOL = 2e-5

CONFIG = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 4096, "vocab_size": 256, "draft_vocab_size": 200, "target_hidden_size": 64,
    "markov_rank": 8, "sample_from_anchor": True, "block_size": 4, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1], "use_swa": True, "swa_window_size": 16},
}

DESCRIPTION = ("DSpark speculative drafter for MiniMax-M3.1 (Qwen3DSparkModel, vLLM 0.33.0 "
               "model_executor/models/qwen3_dspark.py on the DFlash Qwen3 backbone of qwen3_dflash.py): fc + "
               "hidden_norm on the target's residual stream after layers 0 and 1, 2 Qwen3 GQA layers (q/k norm, "
               "NeoX RoPE theta 1e6) non-causal over the context rows and the 4-token query block [bonus, mask x3] "
               "within a 16-key sliding window, SiLU MLP, its own lm_head over a 200-id draft vocabulary with d2t, "
               "the target's embedding, and a rank-8 Markov head (markov_w1 by target id, markov_w2 over draft ids) "
               "applied sequentially for greedy drafts. Reference in float64 on the stored weights, no rounding of "
               "activations (tools/make_qwen3_dspark_fixture.py docstring)")


# ---------------------------------------------------------------------------------------------
# Target: transformers' MiniMax-M3 in float64
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def lift_float32_islands(counts: dict):
    """While active, transformers' float32 islands keep float64 inputs in float64: Tensor.float() returns a float64
    tensor unchanged (RMSNorm, router sigmoid, indexer scores), softmax(dtype=float32) of a float64 tensor runs in
    float64 (eager attention), and MiniMaxM3VLRotaryEmbedding evaluates inv_freq and cos/sin in float64."""
    original_float, original_softmax = torch.Tensor.float, F.softmax
    original_rotary = mm3.MiniMaxM3VLRotaryEmbedding.forward

    def float_(self, *args, **kwargs):
        if self.dtype == F64:
            counts["float"] = counts.get("float", 0) + 1
            return self
        return original_float(self, *args, **kwargs)

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == F64 and dtype == torch.float32:
            counts["softmax"] = counts.get("softmax", 0) + 1
            dtype = F64
        return original_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    def rotary(self, x, position_ids):
        rp = self.config.rope_parameters
        assert rp["rope_type"] == "default" and self.attention_scaling == 1.0
        dim = int(self.config.head_dim * rp.get("partial_rotary_factor", 1.0))
        inv_freq = float(rp["rope_theta"]) ** (-torch.arange(0, dim, 2, dtype=F64) / dim)
        freqs = position_ids.to(F64)[..., None] * inv_freq                     # [B, S, dim/2]
        emb = torch.cat([freqs, freqs], -1)
        counts["rotary"] = counts.get("rotary", 0) + 1
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    torch.Tensor.float, F.softmax = float_, softmax
    mm3.MiniMaxM3VLRotaryEmbedding.forward = rotary
    try:
        yield counts
    finally:
        torch.Tensor.float, F.softmax = original_float, original_softmax
        mm3.MiniMaxM3VLRotaryEmbedding.forward = original_rotary


def load_target(folder: Path):
    """transformers' MiniMaxM3VLForCausalLM on the fixture, every parameter float64 and equal to the file's value."""
    # eager experts: transformers' default grouped_mm experts kernel has no float64 path.
    model, info = MiniMaxM3VLForCausalLM.from_pretrained(folder, dtype=F64, attn_implementation="eager",
                                                         experts_implementation="eager", output_loading_info=True)
    problems = {kind: sorted(names)[:5] for kind, names in info.items() if kind != "error_msgs" and names}
    if problems or info.get("error_msgs"):
        raise SystemExit(f"loading {folder}: {problems} {info.get('error_msgs', '')}")
    stored = load_file(folder / "model.safetensors")
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert p.dtype == F64, name
        assert torch.equal(p.detach(), stored[name].to(F64)), f"{name} differs from the file"
    return model.eval()


@torch.no_grad()
def target_forward(model, prompt: list[int], layer_ids: list[int], counts: dict):
    """Returns (logits [n, V], [aux_t [n, H] for t in layer_ids]) of one float64 forward, checking that
    hidden_states[t + 1] is what leaves decoder layer t and hidden_states[0] the embedding."""
    seen = {}
    hooks = [model.model.layers[t].register_forward_hook(
        lambda mod, args, out, t=t: seen.__setitem__(t, (out[0] if isinstance(out, tuple) else out).clone()))
        for t in layer_ids]
    try:
        with lift_float32_islands(counts):
            out = model(input_ids=torch.tensor([prompt]), use_cache=False, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    hs = out.hidden_states
    assert len(hs) == model.config.num_hidden_layers + 1 and max(layer_ids) + 1 < len(hs) - 1
    assert torch.equal(hs[0][0], model.model.embed_tokens.weight[torch.tensor(prompt)])
    for t in layer_ids:
        assert hs[t + 1].dtype == F64 and torch.equal(hs[t + 1][0], seen[t][0]), f"hidden_states[{t + 1}] != layer {t}"
    return out.logits[0], [hs[t + 1][0] for t in layer_ids]


def validate_target(model, folder: Path, layer_ids: list[int]) -> dict:
    """The float64 target against the float32 logits and greedy tokens stored with the target fixture."""
    prompts = json.loads((folder / "prompts.json").read_text())["prompts"]
    stored = load_file(folder / "reference.safetensors")
    greedy = json.loads((folder / "greedy.json").read_text())["completions"]
    report, counts = [], {}
    for i, prompt in enumerate(prompts):
        logits, _ = target_forward(model, prompt, layer_ids, counts)
        want = stored[f"logits.{i}"].to(F64)
        err = (logits - want).abs().max().item()
        scale = want.abs().max().item()
        argmax_same = torch.equal(logits.argmax(-1), want.argmax(-1))
        ok = err <= TARGET_REL_TOL * scale and argmax_same and int(logits[-1].argmax()) == greedy[i][0]
        print(f"  [{'PASS' if ok else 'FAIL'}] target prompt {i} ({len(prompt)} tokens): float64 logits vs stored "
              f"float32: max |diff| {err:.2e} (max |logit| {scale:.2f}, relative {err / scale:.1e}, tol "
              f"{TARGET_REL_TOL:.0e}), argmax equal at every position: {argmax_same}, next token == greedy.json")
        if not ok:
            raise SystemExit(f"self-check failed: target prompt {i}")
        report.append({"prompt_length": len(prompt), "max_abs_diff": err, "max_abs_logit": scale})
    for key in ("float", "softmax", "rotary"):
        if not counts.get(key):
            raise SystemExit(f"self-check failed: the float64 lift of transformers' {key} island never ran")
    return {"compared": f"{folder.relative_to(REPO)}/reference.safetensors logits.<i> (transformers float32 on the "
                        f"fp16 weights) against this tool's float64 forward, all positions, and greedy.json's "
                        f"first token", "relative_tolerance": TARGET_REL_TOL, "prompts": report}


def draw_prompts(model, cfg: dict, lengths: list[int], first_seed: int, tries: int, min_gap: float):
    """Prompts from the first prompt seed whose target decisions (bonus margin, MSA / MoE top-k gaps) are clear."""
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    rejected = []
    for seed in range(first_seed, first_seed + tries):
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, cfg["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
        monitor, targets, counts = GapMonitor(), [], {}
        with monitor:
            for prompt in prompts:
                logits, aux = target_forward(model, prompt, layer_ids, counts)
                top = logits[-1].topk(2).values
                targets.append({"prompt": prompt, "bonus": int(logits[-1].argmax()),
                                "bonus_gap": float(top[0] - top[1]), "aux": torch.cat(aux, -1)})
        why = [f"prompt {i} target margin {t['bonus_gap']:.3f}" for i, t in enumerate(targets)
               if t["bonus_gap"] < min_gap]
        why += [f"top-k gap {gap:.2e} in {site} ({detail})" for site, (gap, detail) in monitor.smallest.items()
                if gap < TOPK_MIN_REL_GAP]
        if not why:
            gaps = {site: gap for site, (gap, _) in monitor.smallest.items()}
            return seed, rejected, targets, gaps
        rejected.append({"prompt_seed": seed, "why": why})
        print(f"prompt seed {seed} rejected: {'; '.join(why)}")
    raise SystemExit(f"no prompt seed in {first_seed}..{first_seed + tries - 1} has clear target decisions")


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------

def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 / vLLM RMSNorm over the last dim: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX (rotate-half, is_neox_style=True) rotary embedding over the whole last dim of x [T, ..., D]:
    pairs (i, i + D/2) rotated by positions * theta^(-2i/D)."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=F64) / D)
    angle = positions.to(F64)[:, None] * inv_freq[None, :]                      # [T, D/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (D // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


# Which keys a block query sees. "flashinfer" is the reference (see the docstring); the others are what an
# implementation could plausibly get wrong, used only to measure what the fixture discriminates.
MASK_RULES = {
    "flashinfer": lambda q, k, w: k >= q - (w - 1),
    "flash_attn_symmetric": lambda q, k, w: (k >= q - (w - 1)) & (k <= q + (w - 1)),
    "no_window": lambda q, k, w: torch.ones_like(k >= q),
    "window_w_not_w_minus_1": lambda q, k, w: k >= q - w,
    "causal_block": lambda q, k, w: (k >= q - (w - 1)) & (k <= q),
}


class Drafter:
    """Qwen3DSparkModel in float64, with the target's embedding."""

    def __init__(self, cfg: dict, weights: dict, embed: torch.Tensor):
        self.c = cfg
        self.W = {n: w.to(F64) if w.is_floating_point() else w for n, w in weights.items()}
        self.embed = embed.to(F64)
        self.eps = cfg["rms_norm_eps"]
        self.theta = float(cfg["rope_parameters"]["rope_theta"])
        self.window = cfg["dflash_config"]["swa_window_size"] if cfg["dflash_config"].get("use_swa") else None
        self.d2t = weights["d2t"]
        assert self.window is not None

    def to_target(self, draft_id: int) -> int:
        """map_draft_to_target: draft_id + d2t[draft_id]."""
        return draft_id + int(self.d2t[draft_id])

    def heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], n_heads, self.c["head_dim"])

    def context(self, aux: torch.Tensor):
        """combine_hidden_states (fc) + precompute_and_store_context_kv (hidden_norm, k/v_proj, k_norm, rope):
        per layer the n context (K, V) rows [n, kv_heads, head_dim] at positions 0 .. n-1."""
        W, nkv = self.W, self.c["num_key_value_heads"]
        cs = rms_norm(linear(aux, W["fc.weight"]), W["hidden_norm.weight"], self.eps)
        pos = torch.arange(aux.shape[0])
        out = []
        for j in range(self.c["num_hidden_layers"]):
            a = f"layers.{j}.self_attn."
            k = rms_norm(self.heads(linear(cs, W[a + "k_proj.weight"]), nkv), W[a + "k_norm.weight"], self.eps)
            out.append((rope_neox(k, pos, self.theta), self.heads(linear(cs, W[a + "v_proj.weight"]), nkv)))
        return out

    def attention(self, j: int, h: torch.Tensor, positions: torch.Tensor, ctx, rule: str) -> torch.Tensor:
        c, W, a = self.c, self.W, f"layers.{j}.self_attn."
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = rope_neox(rms_norm(self.heads(linear(h, W[a + "q_proj.weight"]), nh), W[a + "q_norm.weight"], self.eps),
                      positions, self.theta)
        k = rope_neox(rms_norm(self.heads(linear(h, W[a + "k_proj.weight"]), nkv), W[a + "k_norm.weight"], self.eps),
                      positions, self.theta)
        v = self.heads(linear(h, W[a + "v_proj.weight"]), nkv)
        ctx_k, ctx_v = ctx
        keys, values = torch.cat([ctx_k, k]), torch.cat([ctx_v, v])                # [n + T, nkv, hd]
        key_pos = torch.cat([torch.arange(ctx_k.shape[0]), positions])
        visible = MASK_RULES[rule](positions[:, None], key_pos[None, :], self.window)  # [T, n + T]
        group = nh // nkv                                                            # query head g -> kv g // group
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) * hd ** -0.5
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", probs, values)
        return linear(out.reshape(h.shape[0], nh * hd), W[a + "o_proj.weight"])

    def base_logits(self, aux: torch.Tensor, tokens: list[int], rule: str = "flashinfer") -> torch.Tensor:
        W, eps, n = self.W, self.eps, aux.shape[0]
        ctx = self.context(aux)
        x = self.embed[torch.tensor(tokens)]
        positions = torch.arange(n, n + len(tokens))
        for j in range(self.c["num_hidden_layers"]):
            pre = f"layers.{j}."
            x = x + self.attention(j, rms_norm(x, W[pre + "input_layernorm.weight"], eps), positions, ctx[j], rule)
            h2 = rms_norm(x, W[pre + "post_attention_layernorm.weight"], eps)
            gate, up = linear(h2, W[pre + "mlp.gate_proj.weight"]), linear(h2, W[pre + "mlp.up_proj.weight"])
            x = x + linear(F.silu(gate) * up, W[pre + "mlp.down_proj.weight"])
        return linear(rms_norm(x, W["norm.weight"], eps), W["lm_head.weight"])

    def markov_bias(self, prev: int) -> torch.Tensor:
        return self.W["markov_head.markov_w2.weight"] @ self.W["markov_head.markov_w1.weight"][prev]

    def query_tokens(self, bonus: int, n_spec: int) -> list[int]:
        return [bonus] + [self.c["dflash_config"]["mask_token_id"]] * (n_spec - 1)

    def draft(self, aux: torch.Tensor, bonus: int, n_spec: int, rule: str = "flashinfer", w1_space: str = "target"):
        """Returns (drafts as target ids, draft ids, base_logits [N, Vd], markov_logits [N, Vd], margins).
        w1_space="draft" feeds the previous DRAFT id to markov_w1 (a plausible mistake, for the sensitivity)."""
        base = self.base_logits(aux, self.query_tokens(bonus, n_spec), rule)
        prev, drafts, draft_ids, rows, margins = bonus, [], [], [], []
        for i in range(n_spec):
            logits = base[i] + self.markov_bias(prev)
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            d = int(logits.argmax())
            draft_ids.append(d)
            drafts.append(self.to_target(d))
            prev = drafts[-1] if w1_space == "target" else d
            rows.append(logits)
        return drafts, draft_ids, base, torch.stack(rows), margins


def random_drafter(cfg: dict, seed: int, required_ids: list[int]) -> dict[str, torch.Tensor]:
    """bf16 weights by checkpoint name and the int64 d2t, drawn in a fixed order from one generator."""
    w = RandomWeights(seed)

    H, nh, nkv, hd, I = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                         cfg["intermediate_size"])
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    w.mat("fc.weight", H, cfg["target_hidden_size"] * len(cfg["dflash_config"]["target_layer_ids"]))
    w.norm("hidden_norm.weight", H)
    for j in range(cfg["num_hidden_layers"]):
        a = f"layers.{j}.self_attn."
        w.mat(a + "q_proj.weight", nh * hd, H)
        w.mat(a + "k_proj.weight", nkv * hd, H)
        w.mat(a + "v_proj.weight", nkv * hd, H)
        w.mat(a + "o_proj.weight", H, nh * hd)
        w.norm(a + "q_norm.weight", hd)
        w.norm(a + "k_norm.weight", hd)
        w.mlp_and_norms(j, H, I)
    w.norm("norm.weight", H)
    w.mat("lm_head.weight", Vd, H)
    w.markov_head(V, Vd, cfg["markov_rank"])
    # Draft vocabulary: a sorted subset of Vd target ids holding every required id; d2t[d] = subset[d] - d.
    required = sorted(set(required_ids))
    others = [t for t in torch.randperm(V, generator=w.generator).tolist() if t not in required]
    subset = torch.tensor(sorted(required + others[:Vd - len(required)]), dtype=torch.int64)
    w.out["d2t"] = subset - torch.arange(Vd, dtype=torch.int64)
    return w.out


def uninformative(drafter: Drafter, targets, results, n_spec: int, min_markov_changes: int) -> list[str]:
    """Reasons a seed (whose margins are clear) would still make a weak test."""
    why = []
    decisions = sum(len(r[0]) for r in results)
    changed = sum(int(base[k].argmax()) != ids[k] for _, ids, base, _, _ in results for k in range(len(ids)))
    if changed < min_markov_changes:
        why.append(f"uninformative: the Markov bias changes {changed} of {decisions} draft decisions "
                   f"(< {min_markov_changes})")
    if len({tuple(r[0][1:]) for r in results}) == 1:
        why.append(f"uninformative: the mask-position drafts are {results[0][0][1:]} in every case")
    if all(d == i for r in results for d, i in zip(r[0], r[1])):
        why.append("uninformative: every draft's draft id equals its target id (d2t offsets unexercised)")
    for label, kwargs in (("indexing markov_w1 by draft ids", {"w1_space": "draft"}),
                          ("ignoring the sliding window", {"rule": "no_window"})):
        if all(drafter.draft(t["aux"], t["bonus"], n_spec, **kwargs)[0] == r[0] for t, r in zip(targets, results)):
            why.append(f"uninformative: {label} gives the same drafts")
    return why


# ---------------------------------------------------------------------------------------------
# Checks of the reference itself
# ---------------------------------------------------------------------------------------------

def check_rope(theta: float) -> float:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=gen, dtype=F64)
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 4095])
    z = torch.complex(x[..., :8], x[..., 8:])
    inv = theta ** (-torch.arange(0, 16, 2, dtype=F64) / 16)
    rot = torch.polar(torch.ones(7, 8, dtype=F64), pos[:, None].to(F64) * inv)[:, None, :]
    want = torch.cat([(z * rot).real, (z * rot).imag], -1)
    return check_close("NeoX rope == complex rotation of pairs (i, i + 8)", rope_neox(x, pos, theta), want)


@torch.no_grad()
def transformers_qwen3_logits(cfg: dict, weights: dict, embed: torch.Tensor, aux: torch.Tensor, tokens: list[int]):
    """The query-block forward with transformers' own Qwen3 modules (float64 model; transformers still computes
    Qwen3RMSNorm, the rotary cos/sin and the eager softmax in float32): the context K/V are precomputed into a
    DynamicCache (as vLLM writes them into the KV cache), then Qwen3DecoderLayer runs on the block tokens with an
    additive mask written from FlashInfer's predicate kv_idx + qo_len + window_left >= kv_len + qo_idx."""
    from transformers import Qwen3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.qwen3 import modeling_qwen3 as mq

    qc = Qwen3Config(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                     intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                     num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                     head_dim=cfg["head_dim"], hidden_act=cfg["hidden_act"], rms_norm_eps=cfg["rms_norm_eps"],
                     rope_parameters=dict(cfg["rope_parameters"]), attention_bias=False,
                     max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=False)
    qc._attn_implementation = "eager"
    W = {n: w.to(F64) for n, w in weights.items() if w.is_floating_point()}
    layers = []
    for j in range(cfg["num_hidden_layers"]):
        layer = mq.Qwen3DecoderLayer(qc, j).to(F64).eval()
        pre = f"layers.{j}."
        layer.load_state_dict({n[len(pre):]: w for n, w in W.items() if n.startswith(pre)}, strict=True)
        layers.append(layer)
    rotary = mq.Qwen3RotaryEmbedding(qc)

    def norm(name):
        m = mq.Qwen3RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"]).to(F64)
        m.weight.copy_(W[name])
        return m

    n, N, hd = aux.shape[0], len(tokens), cfg["head_dim"]
    c = norm("hidden_norm.weight")(F.linear(aux, W["fc.weight"]))[None]          # [1, n, H]
    cos, sin = rotary(c, torch.arange(n)[None])
    cache = DynamicCache()
    for j, layer in enumerate(layers):
        a = layer.self_attn
        k = a.k_norm(a.k_proj(c).view(1, n, -1, hd)).transpose(1, 2)
        v = a.v_proj(c).view(1, n, -1, hd).transpose(1, 2)
        k = mq.apply_rotary_pos_emb(k, k, cos, sin)[1]
        cache.update(k, v, j)
    x = embed.to(F64)[torch.tensor(tokens)][None]
    position_ids = torch.arange(n, n + N)[None]
    pe = rotary(x, position_ids)
    qo_len, kv_len, window_left = N, n + N, cfg["dflash_config"]["swa_window_size"] - 1
    qo_idx, kv_idx = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
    keep = kv_idx + qo_len + window_left >= kv_len + qo_idx
    mask = torch.zeros(1, 1, qo_len, kv_len, dtype=F64).masked_fill(~keep, torch.finfo(F64).min)
    for layer in layers:
        x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
                  position_embeddings=pe)
    return F.linear(norm("norm.weight")(x)[0], W["lm_head.weight"])


# ---------------------------------------------------------------------------------------------
# Fixture
# ---------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="write the fixture into this folder")
    parser.add_argument("--target", type=Path, default=REPO / TARGET, help=f"the target fixture (default {TARGET})")
    parser.add_argument("--seed", type=int, default=1, help="first drafter seed tried (default 1)")
    parser.add_argument("--max-tries", type=int, default=300)
    parser.add_argument("--prompt-seed", type=int, default=1, help="first prompt seed tried (default 1)")
    parser.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")], default=PROMPT_LENGTHS,
                        help="comma-separated prompt lengths (default %(default)s)")
    parser.add_argument("--min-gap", type=float, default=0.05,
                        help="reject seeds with a draft (or target next-token) top1 - top2 logit margin below this")
    parser.add_argument("--min-markov-changes", type=int, default=3,
                        help="reject seeds where the Markov bias changes fewer draft argmaxes than this "
                             "(over all cases), or whose mask-position drafts are the same in every case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    cfg = CONFIG
    n_spec = NUM_SPECULATIVE_TOKENS
    layer_ids = cfg["dflash_config"]["target_layer_ids"]

    print("checks of the reference:")
    checks = {"rope_neox_vs_complex": check_rope(float(cfg["rope_parameters"]["rope_theta"]))}
    target_folder = args.target.resolve()
    tcfg = json.loads((target_folder / "config.json").read_text())
    assert tcfg["hidden_size"] == cfg["target_hidden_size"] and tcfg["vocab_size"] == cfg["vocab_size"]
    assert max(layer_ids) + 1 < tcfg["num_hidden_layers"], "the last layer's hidden_states entry is final-normed"
    model = load_target(target_folder)
    target_check = validate_target(model, target_folder, layer_ids)

    prompt_seed, rejected_prompts, targets, topk_gaps = draw_prompts(
        model, cfg, args.prompt_lengths, args.prompt_seed, 50, args.min_gap)
    for i, t in enumerate(targets):
        print(f"  prompt {i}: {len(t['prompt'])} tokens, target next token {t['bonus']} "
              f"(margin {t['bonus_gap']:.3f})")
    print(f"  prompt seed {prompt_seed}: smallest relative top-k gaps in the target "
          f"{ {s: f'{g:.1e}' for s, g in topk_gaps.items()} }")

    embed = model.model.embed_tokens.weight.detach().clone()
    bonuses = [t["bonus"] for t in targets]
    rejected = []
    for seed in range(args.seed, args.seed + args.max_tries):
        weights = random_drafter(cfg, seed, bonuses)
        drafter = Drafter(cfg, weights, embed)
        results = [drafter.draft(t["aux"], t["bonus"], n_spec) for t in targets]
        problems = [f"prompt {i} draft {k} margin {g:.3f}" for i, res in enumerate(results)
                    for k, g in enumerate(res[4]) if g < args.min_gap]
        if not problems:
            problems = uninformative(drafter, targets, results, n_spec, args.min_markov_changes)
        if problems:
            rejected.append({"seed": seed, "why": problems})
            print(f"seed {seed} rejected: {'; '.join(problems)}")
            continue
        break
    else:
        raise SystemExit(f"no seed in {args.seed}..{args.seed + args.max_tries - 1} has clear, informative drafts")

    # transformers' Qwen3 modules over a precomputed context cache give the same block logits.
    worst = 0.0
    for i, t in enumerate(targets):
        hf = transformers_qwen3_logits(cfg, weights, embed, t["aux"], drafter.query_tokens(t["bonus"], n_spec))
        worst = max(worst, check_close(f"prompt {i}: base logits == transformers Qwen3DecoderLayer over a "
                                       f"DynamicCache context, FlashInfer-predicate mask", hf, results[i][2], 1e-5))
    checks["base_logits_vs_transformers_qwen3"] = worst
    # The greedy argmax in draft space, mapped by d2t, equals the argmax of the logits scattered into the target
    # vocab (-inf elsewhere), as vLLM's probabilistic path (_d2t_scatter_index) and DFlash compute_logits lay it out.
    scatter_index = torch.arange(cfg["draft_vocab_size"]) + weights["d2t"]
    assert len(set(scatter_index.tolist())) == cfg["draft_vocab_size"] and int(scatter_index.max()) < cfg["vocab_size"]
    for drafts, _, _, markov, _ in results:
        full = torch.full((n_spec, cfg["vocab_size"]), float("-inf"), dtype=F64)
        full[:, scatter_index] = markov
        assert full.argmax(-1).tolist() == drafts
    assert all(b in (scatter_index.tolist()) for b in bonuses)
    print("  [PASS] draft-space argmax + d2t == argmax of the logits scattered into the target vocab")

    # What the fixture tells apart: drafts and logits under plausible misreadings.
    sensitivity = {}
    for label, kwargs in [(rule, {"rule": rule}) for rule in MASK_RULES if rule != "flashinfer"] + \
                         [("markov_w1_by_draft_id", {"w1_space": "draft"})]:
        changed, diff = 0, 0.0
        for t, res in zip(targets, results):
            alt = drafter.draft(t["aux"], t["bonus"], n_spec, **kwargs)
            changed += sum(a != b for a, b in zip(alt[0], res[0]))
            diff = max(diff, (alt[3] - res[3]).abs().max().item())
        sensitivity[label] = {"drafts_changed": changed, "max_abs_markov_logit_diff": diff}
        print(f"  sensitivity {label}: {changed} drafts change, max |markov logit diff| {diff:.3g}")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in sorted(weights.items())}, out / "model.safetensors",
              metadata={"format": "pt"})
    # The reference must be what the files mean: reload and rerun on the stored values.
    reloaded = load_file(out / "model.safetensors")
    assert reloaded.keys() == weights.keys() and all(torch.equal(reloaded[n], w) for n, w in weights.items())
    assert reloaded["d2t"].dtype == torch.int64
    again = Drafter(json.loads((out / "config.json").read_text()), reloaded, embed)
    for i, t in enumerate(targets):
        assert again.draft(t["aux"], t["bonus"], n_spec)[:2] == results[i][:2]
    print("  [PASS] the weights reloaded from disk give the same drafts")

    tensors, cases = {}, []
    for i, (t, (drafts, draft_ids, base, markov, margins)) in enumerate(zip(targets, results)):
        tensors[f"aux.{i}"] = t["aux"].float().contiguous()
        tensors[f"base_logits.{i}"] = base.float().contiguous()
        tensors[f"markov_logits.{i}"] = markov.float().contiguous()
        cases.append({"prompt": t["prompt"], "bonus": t["bonus"], "drafts": drafts, "draft_ids": draft_ids,
                      "min_gap": min(margins), "draft_gaps": margins, "bonus_gap": t["bonus_gap"],
                      "base_argmax": [int(a) for a in base.argmax(-1)]})
    save_file(tensors, out / "dspark_reference.safetensors", metadata={"format": "pt"})
    info = {
        "generator": "tools/make_qwen3_dspark_fixture.py",
        "command": " ".join(["python3", "tools/make_qwen3_dspark_fixture.py"] + sys.argv[1:]),
        "target": TARGET,
        "description": DESCRIPTION,
        "notes": "positions: prompt tokens 0..n-1 are the context rows; the query block [bonus, 3, 3, 3] sits at "
                 "n..n+3 and query i predicts position n+1+i. aux.<i> is [n_i, 128] = the target's residual stream "
                 "[after layer 0 | after layer 1] (transformers hidden_states[1] | hidden_states[2], float64 "
                 "forward stored as float32). Sliding window 16: a block query at position q sees key positions "
                 "k >= q - 15 (context and block), no causal limit (INFERRED FlashInfer window_left = 15, see the "
                 "generator's docstring). base_logits.<i> are the 4 queries' logits over the 200 DRAFT ids before "
                 "the Markov bias, markov_logits.<i> with the bias markov_w2 @ markov_w1[prev], prev the previous "
                 "token as a TARGET id (bonus, then d + d2t[d] of each draft). drafts are target ids, draft_ids "
                 "and base_argmax draft-vocab ids. min_gap, draft_gaps, bonus_gap: absolute top1 - top2 logit "
                 "margins. sensitivity: how many drafts change (and the largest markov-logit change) under "
                 "plausible misreadings; flash_attn_symmetric (FlashAttention's (w-1, w-1) non-causal window) "
                 "must change nothing here.",
        "storage": "bfloat16 (d2t int64)",
        "seed": seed,
        "rejected_seeds": rejected,
        "prompt_seed": prompt_seed,
        "rejected_prompt_seeds": rejected_prompts,
        "min_gap_threshold": args.min_gap,
        "target_topk_min_relative_gap": topk_gaps,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_speculative_tokens": n_spec,
        "target_check": target_check,
        "self_checks": checks,
        "sensitivity": sensitivity,
        "cases": cases,
    }
    (out / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: seed {seed}, {len(weights)} tensors, {size / 1024:.0f} KiB")
    for i, cs in enumerate(cases):
        print(f"  prompt {i} ({len(cs['prompt'])} tokens): bonus {cs['bonus']}, drafts {cs['drafts']} "
              f"(draft ids {cs['draft_ids']}), margins {[round(g, 3) for g in cs['draft_gaps']]}, "
              f"base argmax {cs['base_argmax']}")


if __name__ == "__main__":
    main()
