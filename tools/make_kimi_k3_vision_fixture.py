#!/usr/bin/env python3
"""Writes tests/fixtures/kimi_k3_vl, tests/fixtures/kimi_k25_vision and tests/fixtures/kimi_k3_vl_gpu: tiny random
Kimi K3 vision towers
(MoonViT3d + the multimodal projector) and what they make of two images, computed in float64 by a reference
written here from vLLM 0.33.0 (the engine that serves the released checkpoint; transformers has no Kimi K3):
  model_executor/models/kimi_k25_vit.py    MoonViT3dPretrainedModel, MoonVision3dPatchEmbed,
                                           Learnable2DInterpPosEmbDivided_fixed, Rope2DPosEmbRepeated,
                                           MoonViTEncoderLayer, MoonViT3dEncoder, tpool_patch_merger,
                                           KimiK25MultiModalProjector, vision_tower_forward
  transformers_utils/configs/kimi_k3.py    KimiK3VisionConfig (defaults of absent keys), KimiK3Config
  models/kimi_k3/nvidia/model.py           KimiK3ForConditionalGeneration (hf_to_vllm_mapper:
                                           mm_projector.proj.0 -> linear_1, proj.2 -> linear_2)

Per image of grid (t, h, w) (rows: frame-major, then row-major patches, as the processor emits them):
  1 patch embed      MoonVision3dPatchEmbed.forward: a Conv2d whose kernel is its stride (14) == one product of
                     each patch's 588 values (layout [3, 14, 14], c then y then x) with proj.weight viewed
                     [H, 588], + proj.bias iff patch_embed_proj_bias
  2 position         Learnable2DInterpPosEmbDivided_fixed.get_pos_embeds: weight [H0, W0, H]; if (h, w) !=
                     (H0, W0), get_rope_shape = F.interpolate(weight as [1, H, H0, W0], size (h, w),
                     pos_emb_interpolation_mode, align_corners False) back to [h*w, H] row-major; written out
                     here as separable weight matrices (interp_matrix) and checked against F.interpolate. t > 1:
                     the grid repeats per frame + get_1d_sincos_pos_embed(H, t) (sines, then cosines)
  3 rotary           Rope2DPosEmbRepeated(d = qkv_hidden_size / heads, 512, 512): d/4 frequencies
                     f_i = 10000^(-4i/d); the patch at (row y, col x) has d/2 angles [x f_0, y f_0, x f_1, ...];
                     q and k rotate in ADJACENT pairs (dims 2j, 2j+1 by angle j: packed_qk_rope_,
                     ApplyRotaryEmb is_neox_style=False); the grid repeats per frame
  4 each layer       MoonViTEncoderLayer.forward: x += wo(attn(rope(wqkv(norm0(x))))); x += fc1(act(fc0(norm1(x))))
                     wqkv's output viewed (3, heads, d): q, k, v; attention over one image's t*h*w rows at a time
                     (cu_seqlens), no mask, scale d^-0.5; biases iff attn_bias (wqkv, wo) / linear_bias (fc0,
                     fc1); act = activation_func or hidden_act: gelu_pytorch_tanh (tanh form) or gelu (erf)
  5 final norm       MoonViT3dEncoder.final_layernorm
     norms           norm_type "layernorm": nn.LayerNorm(H), eps 1e-5, with bias; "rmsnorm": nn.RMSNorm(H),
                     eps None: see RMS_EPS below
  6 merge            tpool_patch_merger (sd2_tpool): mean over frames, then each 2x2 window's rows (0,0),
                     (0,1), (1,0), (1,1) side by side, windows row-major: [h/2 * w/2, 4H]
  7 projector        KimiK25MultiModalProjector: "patchmergerv2" (K3): linear_1 (4H -> 4H), GELUActivation
                     (erf, whatever projector_hidden_act says), linear_2 (4H -> text hidden), RMSNorm(eps
                     projector_ln_eps), no biases. "patchmerger" (K2.5): pre_norm LayerNorm(H, 1e-5) on each of
                     the four rows, then linear_1, gelu, linear_2, with biases
Several images in one call (vision_tower_forward) only share the row-wise steps: "both.embeddings" must equal
the images' embeddings one after the other.

RMS_EPS (read this before changing it): nn.RMSNorm(H) is built without an eps, and torch's docs said "Default:
torch.finfo(x.dtype).eps", which for the bf16 tower would be 2^-7. torch's code disagrees: since pytorch#142848
(Jan 2025) both the composite rms_norm and aten's fused CUDA kernel take the eps of the ACCUMULATOR type, float32
for bf16 input: torch 2.15's torch/_decomp/decompositions.py::_fused_rms_norm (finfo(float32).eps for bf16),
torch/_native/ops/norm/rmsnorm_impl.py ("Match aten/src/ATen/native/cuda/layer_norm_kernel.cu: aten picks eps
from the *accumulator* dtype, which is float32 for fp16/bf16/fp32 inputs"), and pytorch#173039 / #175639, which
corrected the docs to say so. torch 2.15 on the CPU gives the same on bf16 input and weight (measured). vLLM 0.33.0
pins torch 2.14, so RMS_EPS = finfo(float32).eps = 2^-23. `--rms-eps bfloat16` writes the fixtures with 2^-7
instead; the tool prints how far that moves the embeddings.

Where vLLM rounds to bf16 and this reference does not (a C++ test must allow for it): the pixel values (cast to
the conv's bf16 by input_norm), every linear output, the interpolated position table (computed on the bf16
weight), the sin-cos time table (a bf16 buffer after .to(dtype)), the rotated q/k (fp32 math, bf16 store), the
attention output, every norm's output and the residual sums. The rotary angles are fp32 in vLLM, float64 here.

Output (the weights are bf16 under the release's names; the reference uses their stored values in float64):
  tests/fixtures/kimi_k3_vl        K3's vision defaults at tiny sizes over the kimi_k3_1_pro text model:
                                   config.json (kimi_k3_1_pro's + vision_config + media_placeholder_token_id 250),
                                   generation_config.json, model.safetensors (the text weights unchanged + the
                                   vision weights), preprocessor_config.json, vision_reference.safetensors,
                                   fixture.json
  tests/fixtures/kimi_k25_vision   the other switches (LayerNorm, biases, erf gelu, bicubic, "patchmerger",
                                   qkv_hidden_size null == hidden), vision weights only, no prompt
  tests/fixtures/kimi_k3_vl_gpu    kimi_k3_vl's vision_config (another seed) with the projector out to 128, the
                                   hidden size of tests/fixtures/kimi_k3_1_pro_gpu (the GPU kernels' shapes), whose
                                   text model the GPU test merges in at run time: vision.safetensors (the vision
                                   weights only), vision_config.json ({"vision_config", "media_placeholder_token_id"},
                                   to merge into kimi_k3_1_pro_gpu's config.json), vision_reference.safetensors
                                   (embeddings, grids, a 100-token prompt's logits; no pixel values: kimi_k3_vl's
                                   are the same), fixture.json
vision_reference.safetensors, per image <name>: "<name>.pixel_values" (float32 [N, 588], tools/
make_image_fixtures.py's kimi_reference with in_patch_limit 48: the processor's patches), "<name>.grid" (int64
[t, h, w]), "<name>.embeddings" (float32 of the float64 result, [tokens, text hidden]); "both.embeddings" (the two
images in one call). kimi_k3_vl also: "prompt.ids" (int64: text, image 1's 12 placeholders, text, image 2's 20,
text; longer than index_topk; kimi_k3_vl_gpu's prompt is 100 tokens with both images in the first 64, so that
rows 64.. of its indexer choose among image keys), "prompt.image_offsets" (int64, where each run starts) and "prompt.logits" (float32
[len, vocab]): tools/kimi_k3_reference.py's float64 forward with the placeholder rows replaced by the embeddings
(vLLM's merge_multimodal_embeddings). A prompt whose indexer / router top-k has a near-tie (relative gap under
kimi_k3_reference.MIN_GAP) is rejected for the next seed.

Self-checks (asserted): the tower again with torch's own modules (Conv2d, F.interpolate, complex rotation,
scaled_dot_product_attention, nn.LayerNorm / nn.RMSNorm / nn.GELU / nn.Linear, vLLM's view/permute merge) within
1e-12, also on a 2-frame input; the kimi_k3_1_pro fixture's stored logits from forward() without `embedded`;
both.embeddings == the concatenation; attention neither one-hot nor uniform.

    python3 tools/make_kimi_k3_vision_fixture.py            # about 10 s on a CPU
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import kimi_k3_reference as k3  # noqa: E402  (the text model's float64 reference)
from make_image_fixtures import kimi_reference  # noqa: E402  (the verified reference of sparrow's processor)

F64 = torch.float64
TEXT_FIXTURE = ROOT / "tests" / "fixtures" / "kimi_k3_1_pro"
OUT_K3 = ROOT / "tests" / "fixtures" / "kimi_k3_vl"
OUT_K25 = ROOT / "tests" / "fixtures" / "kimi_k25_vision"
GPU_TEXT_FIXTURE = ROOT / "tests" / "fixtures" / "kimi_k3_1_pro_gpu"
OUT_K3_GPU = ROOT / "tests" / "fixtures" / "kimi_k3_vl_gpu"
IMAGES_DIR = ROOT / "tests" / "data" / "images"
IMAGES = ("rgb_97x61.png", "downscaled_203x151.jpg")
COMMAND = "python3 tools/make_kimi_k3_vision_fixture.py"

RMS_EPS = {"float32": torch.finfo(torch.float32).eps,      # 2^-23: what torch does (module docstring)
           "bfloat16": torch.finfo(torch.bfloat16).eps}    # 2^-7: what torch's old docs said
LAYER_NORM_EPS = 1e-5          # nn.LayerNorm's default; _make_vision_norm and pre_norm never pass another
ROPE_THETA, ROPE_MAX = 10000.0, 512   # MoonViT3dEncoder: Rope2DPosEmbRepeated(d, 512, 512), theta_base 10000
PLACEHOLDER = 250              # media_placeholder_token_id, inside the 256-token vocabulary
PREPROCESSOR = {"media_proc_cfg": {"in_patch_limit": 48, "patch_limit_on_one_side": 512, "patch_size": 14,
                                   "merge_kernel_size": 2, "image_mean": [0.5, 0.5, 0.5],
                                   "image_std": [0.5, 0.5, 0.5]}}

# KimiK3VisionConfig.__init__'s defaults: what vLLM assumes for a key the config.json leaves out (model_type
# kimi_k3 builds this class, so an absent qkv_hidden_size is 1536, not the hidden size).
K3_VISION_DEFAULTS = dict(
    patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64, init_pos_emb_time=4, pos_emb_type="divided_fixed",
    vt_num_attention_heads=12, vt_num_hidden_layers=27, vt_hidden_size=1024, vt_intermediate_size=4096,
    merge_kernel_size=[2, 2], video_attn_type="spatial_temporal", merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2", projector_hidden_act="gelu", projector_ln_eps=1e-5, qkv_hidden_size=1536,
    norm_type="rmsnorm", attn_bias=False, patch_embed_proj_bias=False, mlp_type="mlp2", linear_bias=False,
    activation_func="gelu_pytorch_tanh", pos_emb_interpolation_mode="bilinear", text_hidden_size=2304)

# Fixture 1: every KimiK3VisionConfig key, K3's choices, tiny sizes (head_dim 48 / 2 = 24, wider than H / heads).
K3_VISION = dict(
    patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4, pos_emb_type="divided_fixed",
    vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
    merge_kernel_size=[2, 2], video_attn_type="spatial_temporal", merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2", mm_hidden_size=32, projector_hidden_act="gelu", projector_ln_eps=1e-5,
    qkv_hidden_size=48, norm_type="rmsnorm", attn_bias=False, patch_embed_proj_bias=False, mlp_type="mlp2",
    linear_bias=False, activation_func="gelu_pytorch_tanh", pos_emb_interpolation_mode="bilinear",
    text_hidden_size=64)
# Fixture 3: fixture 1's settings over kimi_k3_1_pro_gpu's text model (hidden 128).
K3_VISION_GPU = dict(K3_VISION, text_hidden_size=128)
# Fixture 2: the K2.5-style switches. qkv_hidden_size is null, not absent: under model_type kimi_k3 an absent key
# takes KimiK3VisionConfig's 1536, while None gives `qkv_hidden_size or hidden` = 32 (MoonViT3dEncoder,
# MoonViTEncoderLayer), as a K2.5 config without the key does (head_dim 16).
K25_VISION = dict(K3_VISION, norm_type="layernorm", attn_bias=True, linear_bias=True, patch_embed_proj_bias=True,
                  activation_func="gelu", pos_emb_interpolation_mode="bicubic", mm_projector_type="patchmerger",
                  qkv_hidden_size=None)

# Random weights: matrices N(0, gain^2 / fan_in), norm scales 1 + N(0, 0.1^2), biases N(0, BIAS_STD^2). QKV_GAIN
# sets the attention logits' spread (softmax neither one-hot nor uniform; checked), the rest keep activations and
# the embeddings of order 1. Biases are large enough that a missing one shows.
PATCH_GAIN, POS_STD, QKV_GAIN, OUT_GAIN, FC0_GAIN, FC1_GAIN = 2.0, 0.5, 1.3, 1.0, 1.5, 1.0
PROJ1_GAIN, PROJ2_GAIN, NORM_STD, BIAS_STD = 1.5, 1.0, 0.1, 0.2
SEEDS = {"kimi_k3_vl": 1, "kimi_k25_vision": 2, "kimi_k3_vl_gpu": 3}
PROMPT_TEXT_LENGTHS = (7, 6, 5)   # text, image 1, text, image 2, text: 7 + 12 + 6 + 20 + 5 = 50 > index_topk 16
# kimi_k3_vl_gpu: 7 + 12 + 10 + 20 + 51 = 100 > index_topk 64; the images at 7..18 and 29..48, both in the first 64
GPU_PROMPT_TEXT_LENGTHS = (7, 10, 51)


# ---------------------------------------------------------------------------------------------------------------
# Configuration, as vLLM reads it
# ---------------------------------------------------------------------------------------------------------------

def vision_settings(config: dict) -> dict:
    """The numbers the tower is built from (MoonViT3dPretrainedModel.__init__, KimiK25MultiModalProjector)."""
    vc = {**K3_VISION_DEFAULTS, **config["vision_config"]}
    H, heads = vc["vt_hidden_size"], vc["vt_num_attention_heads"]
    Q = vc["qkv_hidden_size"] or H                  # MoonViT3dEncoder: block_cfg["qkv_hidden_size"] or hidden_dim
    kh, kw = vc["merge_kernel_size"]
    assert Q % heads == 0 and (Q // heads) % 4 == 0 and kh == kw == 2
    assert vc["pos_emb_type"] == "divided_fixed" and vc["merge_type"] == "sd2_tpool" and vc["mlp_type"] == "mlp2"
    act = vc.get("activation_func") or vc.get("hidden_act")
    assert act in ("gelu_pytorch_tanh", "gelu") and vc["norm_type"] in ("rmsnorm", "layernorm")
    return dict(H=H, heads=heads, Q=Q, d=Q // heads, I=vc["vt_intermediate_size"], L=vc["vt_num_hidden_layers"],
                P=vc["patch_size"], H0=vc["init_pos_emb_height"], W0=vc["init_pos_emb_width"],
                T0=vc["init_pos_emb_time"], T=config["text_config"]["hidden_size"],  # KimiK3Config overrides
                norm=vc["norm_type"], attn_bias=vc["attn_bias"], linear_bias=vc["linear_bias"],
                patch_bias=vc["patch_embed_proj_bias"], tanh_gelu=act == "gelu_pytorch_tanh",
                interp=vc["pos_emb_interpolation_mode"], projector=vc["mm_projector_type"],
                projector_eps=vc["projector_ln_eps"])


def block(i: int) -> str:
    return f"vision_tower.encoder.blocks.{i}."


# ---------------------------------------------------------------------------------------------------------------
# The reference, step by step
# ---------------------------------------------------------------------------------------------------------------

def linear(x, W, p, bias: bool):
    """ColumnParallelLinear / RowParallelLinear / ReplicatedLinear: x W^T (+ b)."""
    y = x @ W(p + ".weight").T
    return y + W(p + ".bias") if bias else y


def norm(x, W, p, s, rms_eps):
    """_make_vision_norm: nn.LayerNorm(H) (biased variance, eps 1e-5, weight and bias) or nn.RMSNorm(H)."""
    if s["norm"] == "layernorm":
        centered = x - x.mean(-1, keepdim=True)
        return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + LAYER_NORM_EPS) * W(p + ".weight") \
            + W(p + ".bias")
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps) * W(p + ".weight")


def gelu(x, tanh: bool):
    """nn.GELU(approximate="tanh") for gelu_pytorch_tanh; GELU / GELUActivation (erf) for gelu."""
    if tanh:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def cubic_weights(t: float, A: float = -0.75) -> list[float]:
    """torch's get_cubic_upsample_coefficients (Keys' cubic convolution, A = -0.75) for taps -1, 0, 1, 2."""
    near = lambda x: ((A + 2) * x - (A + 3)) * x * x + 1              # |x| <= 1
    far = lambda x: ((A * x - 5 * A) * x + 8 * A) * x - 4 * A         # 1 < |x| < 2
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def interp_matrix(n_out: int, n_in: int, mode: str) -> torch.Tensor:
    """[n_out, n_in]: F.interpolate(size=..., align_corners=False) along one axis (UpSampleBilinear2d /
    UpSampleBicubic2d): source coordinate (o + 0.5) * n_in / n_out - 0.5; bilinear clamps it at 0 and blends
    floor and floor + 1 (the last index repeats); bicubic takes taps floor - 1 .. floor + 2, indices clamped to
    the table (its border value repeats)."""
    M = torch.zeros(n_out, n_in, dtype=F64)
    scale = n_in / n_out
    for o in range(n_out):
        src = (o + 0.5) * scale - 0.5
        if mode == "bilinear":
            src = max(src, 0.0)
            i = int(src)
            lam = src - i
            M[o, i] += 1.0 - lam
            M[o, min(i + 1, n_in - 1)] += lam
        elif mode == "bicubic":
            i = min(math.floor(src), n_in - 1)                        # guard_index_and_lambda
            t = min(max(src - i, 0.0), 1.0)
            for k, c in enumerate(cubic_weights(t)):
                M[o, min(max(i - 1 + k, 0), n_in - 1)] += c
        else:
            raise ValueError(mode)
    return M


def sincos_time_table(dim: int, frames: int) -> torch.Tensor:
    """get_1d_sincos_pos_embed(dim, frames): [frames, dim], sin(t w_i) then cos(t w_i), w_i = 10000^(-i / (dim/2))."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=F64) / (dim / 2.0))
    angles = torch.arange(frames, dtype=F64)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], 1)


def position_rows(W, s, grid) -> torch.Tensor:
    """Learnable2DInterpPosEmbDivided_fixed.get_pos_embeds for one image: [t*h*w, H]."""
    t, h, w = grid
    table = W("vision_tower.patch_embed.pos_emb.weight")                           # [H0, W0, H]
    if (h, w) == (s["H0"], s["W0"]):
        rows = table.reshape(h * w, -1)
    else:  # get_rope_shape: separable, each output (y, x) = sum_ij Ry[y, i] Rx[x, j] table[i, j]
        Ry, Rx = interp_matrix(h, s["H0"], s["interp"]), interp_matrix(w, s["W0"], s["interp"])
        rows = torch.einsum("yi,xj,ijc->yxc", Ry, Rx, table).reshape(h * w, -1)
    if t == 1:
        return rows
    assert t <= s["T0"]
    return (rows[None] + sincos_time_table(s["H"], t)[:, None, :]).reshape(t * h * w, -1)


def rope_angles(s, grid) -> torch.Tensor:
    """Rope2DPosEmbRepeated.get_freqs_cis for one image, as angles [t*h*w, d/2]: angle 2i = x f_i, 2i+1 = y f_i."""
    t, h, w = grid
    d = s["d"]
    assert h <= ROPE_MAX and w <= ROPE_MAX
    f = 1.0 / ROPE_THETA ** (torch.arange(0, d, 4, dtype=F64)[: d // 4] / d)
    y, x = torch.meshgrid(torch.arange(h, dtype=F64), torch.arange(w, dtype=F64), indexing="ij")
    angles = torch.stack([x.reshape(-1, 1) * f, y.reshape(-1, 1) * f], -1).reshape(h * w, d // 2)
    return angles.repeat(t, 1)


def rotate(x, angles, pairs: str = "adjacent"):
    """x [N, heads, d] by angles [N, d/2]: pair j = dims (2j, 2j+1) (is_neox_style=False, packed_qk_rope_).
    pairs="halves" (NeoX: dims j and j + d/2) exists only to show how far that mistake lands."""
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    if pairs == "halves":
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def merge_rows(x, grid) -> torch.Tensor:
    """tpool_patch_merger for one image: [h/2 * w/2, 4H], the window at (Y, X) = mean over frames of rows
    (2Y, 2X), (2Y, 2X+1), (2Y+1, 2X), (2Y+1, 2X+1) side by side."""
    t, h, w = grid
    frames = x.reshape(t, h * w, -1).mean(0)
    out = []
    for Y in range(h // 2):
        for X in range(w // 2):
            out.append(torch.cat([frames[(2 * Y + dy) * w + 2 * X + dx] for dy in (0, 1) for dx in (0, 1)]))
    return torch.stack(out)


def embed_images(weights: dict, config: dict, patches: torch.Tensor, grids: list, *, rms_eps: float,
                 pairs: str = "adjacent", stats: dict | None = None) -> torch.Tensor:
    """float64 embeddings [sum of h/2 * w/2, text hidden] of the images whose patches [N, 588] are concatenated
    in `patches` (vision_tower_forward: MoonViT3dPretrainedModel.forward, then mm_projector_forward)."""
    s, W = vision_settings(config), k3.Params(weights)
    H, heads, d = s["H"], s["heads"], s["d"]
    bounds = [0]
    for t, h, w in grids:
        bounds.append(bounds[-1] + t * h * w)
    assert patches.shape == (bounds[-1], 3 * s["P"] ** 2)
    # 1-2: patch embedding plus the position table.
    x = patches.to(F64) @ W("vision_tower.patch_embed.proj.weight").reshape(H, -1).T   # [H, 3, 14, 14] -> [H, 588]
    if s["patch_bias"]:
        x = x + W("vision_tower.patch_embed.proj.bias")
    x = x + torch.cat([position_rows(W, s, g) for g in grids])
    angles = torch.cat([rope_angles(s, g) for g in grids])
    # 3-4: the layers.
    top = []
    for i in range(s["L"]):
        p = block(i)
        qkv = linear(norm(x, W, p + "norm0", s, rms_eps), W, p + "wqkv", s["attn_bias"]).reshape(-1, 3, heads, d)
        q, k, v = rotate(qkv[:, 0], angles, pairs), rotate(qkv[:, 1], angles, pairs), qkv[:, 2]
        attn = torch.zeros_like(v)
        for a, b in zip(bounds[:-1], bounds[1:]):            # cu_seqlens: one image at a time, no mask
            logits = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * d ** -0.5
            prob = (logits - logits.amax(-1, keepdim=True)).exp()
            prob = prob / prob.sum(-1, keepdim=True)
            top.append(prob.amax(-1).flatten())
            attn[a:b] = torch.einsum("hqk,khd->qhd", prob, v[a:b])
        x = x + linear(attn.reshape(-1, heads * d), W, p + "wo", s["attn_bias"])
        y = norm(x, W, p + "norm1", s, rms_eps)
        x = x + linear(gelu(linear(y, W, p + "mlp.fc0", s["linear_bias"]), s["tanh_gelu"]), W, p + "mlp.fc1",
                       s["linear_bias"])
    # 5: the final norm.
    x = norm(x, W, "vision_tower.encoder.final_layernorm", s, rms_eps)
    if stats is not None:
        top = torch.cat(top)
        stats.update(attention_top_probability_mean=float(top.mean()), attention_top_probability_min=float(
            top.min()), attention_top_probability_max=float(top.max()), tower_output_rms=float(x.pow(2).mean().sqrt()))
    # 6-7: merge each image, then the projector over all windows.
    m = torch.cat([merge_rows(x[a:b], g) for a, b, g in zip(bounds[:-1], bounds[1:], grids)])
    if s["projector"] == "patchmergerv2":
        y = gelu(linear(m, W, "mm_projector.proj.0", False), tanh=False)
        y = linear(y, W, "mm_projector.proj.2", False)
        return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + s["projector_eps"]) * W("mm_projector.post_norm.weight")
    assert s["projector"] == "patchmerger"
    parts = m.reshape(m.shape[0], 4, H)                       # pre_norm on each of the four rows
    c = parts - parts.mean(-1, keepdim=True)
    parts = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + LAYER_NORM_EPS) * W("mm_projector.pre_norm.weight") \
        + W("mm_projector.pre_norm.bias")
    y = gelu(linear(parts.reshape(m.shape[0], 4 * H), W, "mm_projector.proj.0", True), tanh=False)
    return linear(y, W, "mm_projector.proj.2", True)


# ---------------------------------------------------------------------------------------------------------------
# The same tower with torch's own modules, written like vLLM's code (self-check)
# ---------------------------------------------------------------------------------------------------------------

def embed_images_with_modules(weights: dict, config: dict, patches: torch.Tensor, grids: list, *,
                              rms_eps: float) -> torch.Tensor:
    s, W = vision_settings(config), k3.Params(weights)
    H, heads, d, P = s["H"], s["heads"], s["d"], s["P"]

    def module(m, prefix, names=("weight", "bias")):
        m = m.to(F64)
        with torch.no_grad():
            for n in names:
                if getattr(m, n, None) is not None:
                    getattr(m, n).copy_(W(f"{prefix}.{n}"))
        return m

    def make_norm(prefix, n):
        if s["norm"] == "layernorm":
            return module(torch.nn.LayerNorm(n), prefix)
        return module(torch.nn.RMSNorm(n, eps=rms_eps), prefix, ("weight",))

    with torch.no_grad():
        conv = module(torch.nn.Conv2d(3, H, P, P, bias=s["patch_bias"]), "vision_tower.patch_embed.proj")
        x = conv(patches.to(F64).reshape(-1, 3, P, P)).reshape(-1, H)
        table = W("vision_tower.patch_embed.pos_emb.weight")
        # get_1d_sincos_pos_embed as vLLM writes it (numpy), in float64: the time_weight buffer [T0, 1, H].
        omega = 1.0 / 10000 ** (np.arange(H // 2, dtype=np.float64) / (H / 2.0))
        out = np.einsum("m,d->md", np.arange(s["T0"], dtype=np.float64), omega)
        time = torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1)).unsqueeze(1)
        pos = []
        for t, h, w in grids:   # Learnable2DInterpPosEmbDivided_fixed.get_pos_embeds / get_rope_shape
            p2 = table.flatten(end_dim=1) if (h, w) == tuple(table.shape[:2]) else F.interpolate(
                table.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode=s["interp"]).squeeze(0).permute(
                1, 2, 0).flatten(end_dim=1)
            pos.append(p2 if t == 1 else (p2.unsqueeze(0).repeat(t, 1, 1) + time[0:t]).reshape(-1, H))
        x = x + torch.cat(pos)
        # Rope2DPosEmbRepeated._precompute_freqs_cis over the 512-wide table (rows up to the tallest image).
        rows = max(h for _, h, _ in grids)
        flat = torch.arange(0, rows * ROPE_MAX, dtype=F64)
        x_pos, y_pos = flat % ROPE_MAX, flat // ROPE_MAX
        freqs = 1.0 / ROPE_THETA ** (torch.arange(0, d, 4)[: d // 4].to(F64) / d)
        x_cis = torch.polar(torch.ones(len(flat), d // 4, dtype=F64), torch.outer(x_pos, freqs))
        y_cis = torch.polar(torch.ones(len(flat), d // 4, dtype=F64), torch.outer(y_pos, freqs))
        cis = torch.cat([x_cis.unsqueeze(-1), y_cis.unsqueeze(-1)], -1).reshape(rows, ROPE_MAX, -1)
        cis = torch.cat([cis[:h, :w].reshape(-1, d // 2).repeat(t, 1) for t, h, w in grids])
        lengths = [t * h * w for t, h, w in grids]
        act = torch.nn.GELU(approximate="tanh" if s["tanh_gelu"] else "none")
        for i in range(s["L"]):
            p = block(i)
            wqkv = module(torch.nn.Linear(H, 3 * s["Q"], bias=s["attn_bias"]), p + "wqkv")
            wo = module(torch.nn.Linear(s["Q"], H, bias=s["attn_bias"]), p + "wo")
            fc0 = module(torch.nn.Linear(H, s["I"], bias=s["linear_bias"]), p + "mlp.fc0")
            fc1 = module(torch.nn.Linear(s["I"], H, bias=s["linear_bias"]), p + "mlp.fc1")
            xq, xk, xv = torch.unbind(wqkv(make_norm(p + "norm0", H)(x)).view(-1, 3, heads, d), dim=-3)
            rot = lambda z: torch.view_as_real(torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2).contiguous())
                                               * cis[:, None, :]).flatten(-2)   # MoonViT's apply_rope
            xq, xk = rot(xq), rot(xk)
            out = torch.cat([F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                            v.transpose(0, 1)[None], scale=d ** -0.5)[0].transpose(0, 1)
                             for q, k, v in zip(xq.split(lengths), xk.split(lengths), xv.split(lengths))])
            x = x + wo(out.reshape(-1, heads * d))
            x = x + fc1(act(fc0(make_norm(p + "norm1", H)(x))))
        x = make_norm("vision_tower.encoder.final_layernorm", H)(x)
        merged = []
        for seq, (t, h, w) in zip(x.split(lengths), grids):   # tpool_patch_merger, verbatim
            v = seq.view(t, h // 2, 2, w // 2, 2, -1).mean(dim=0)
            merged.append(v.permute(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4, -1))
        feats = torch.cat(merged)
        l1 = module(torch.nn.Linear(4 * H, 4 * H, bias=s["projector"] == "patchmerger"), "mm_projector.proj.0")
        l2 = module(torch.nn.Linear(4 * H, s["T"], bias=s["projector"] == "patchmerger"), "mm_projector.proj.2")
        if s["projector"] == "patchmergerv2":
            post = module(torch.nn.RMSNorm(s["T"], eps=s["projector_eps"]), "mm_projector.post_norm", ("weight",))
            return post(l2(torch.nn.GELU()(l1(feats.view(feats.shape[0], -1)))))
        pre = module(torch.nn.LayerNorm(H, eps=LAYER_NORM_EPS), "mm_projector.pre_norm")
        return l2(torch.nn.GELU()(l1(pre(feats).view(-1, 4 * H))))


# ---------------------------------------------------------------------------------------------------------------
# Weights, images, fixtures
# ---------------------------------------------------------------------------------------------------------------

def random_vision_weights(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """bf16 tensors under the release's names (module docstring's gains)."""
    s = vision_settings(config)
    H, Q, I, T, P = s["H"], s["Q"], s["I"], s["T"], s["P"]
    out: dict[str, torch.Tensor] = {}
    normal = lambda shape, std, mean=0.0: torch.randn(shape, generator=gen, dtype=F64) * std + mean

    def mat(name, rows, cols, gain, bias):
        out[name + ".weight"] = normal((rows, cols), gain / math.sqrt(cols))
        if bias:
            out[name + ".bias"] = normal((rows,), BIAS_STD)

    def norm_weights(name, n):
        out[name + ".weight"] = normal((n,), NORM_STD, 1.0)
        if s["norm"] == "layernorm":
            out[name + ".bias"] = normal((n,), BIAS_STD)

    v = "vision_tower."
    mat(v + "patch_embed.proj", H, 3 * P * P, PATCH_GAIN, s["patch_bias"])
    out[v + "patch_embed.proj.weight"] = out[v + "patch_embed.proj.weight"].reshape(H, 3, P, P)
    out[v + "patch_embed.pos_emb.weight"] = normal((s["H0"], s["W0"], H), POS_STD)
    for i in range(s["L"]):
        p = block(i)
        norm_weights(p + "norm0", H)
        mat(p + "wqkv", 3 * Q, H, QKV_GAIN, s["attn_bias"])
        mat(p + "wo", H, Q, OUT_GAIN, s["attn_bias"])
        norm_weights(p + "norm1", H)
        mat(p + "mlp.fc0", I, H, FC0_GAIN, s["linear_bias"])
        mat(p + "mlp.fc1", H, I, FC1_GAIN, s["linear_bias"])
    norm_weights(v + "encoder.final_layernorm", H)
    if s["projector"] == "patchmerger":
        out["mm_projector.pre_norm.weight"] = normal((H,), NORM_STD, 1.0)
        out["mm_projector.pre_norm.bias"] = normal((H,), BIAS_STD)
    mat("mm_projector.proj.0", 4 * H, 4 * H, PROJ1_GAIN, s["projector"] == "patchmerger")
    mat("mm_projector.proj.2", T, 4 * H, PROJ2_GAIN, s["projector"] == "patchmerger")
    if s["projector"] == "patchmergerv2":
        out["mm_projector.post_norm.weight"] = normal((T,), NORM_STD, 1.0)
    return {n: t.to(torch.bfloat16).contiguous() for n, t in out.items()}


def processed_images() -> list[tuple[str, torch.Tensor, list[int]]]:
    """(name, patches float32 [N, 588], grid [t, h, w]) through kimi_reference with PREPROCESSOR's limits."""
    cfg = PREPROCESSOR["media_proc_cfg"]
    out = []
    for name in IMAGES:
        _, patches, (gh, gw, tokens) = kimi_reference(Image.open(IMAGES_DIR / name).convert("RGB"),
                                                       cfg["in_patch_limit"], cfg["patch_limit_on_one_side"],
                                                       cfg["patch_size"], cfg["merge_kernel_size"],
                                                       cfg["image_mean"], cfg["image_std"])
        assert tokens == (gh // 2) * (gw // 2)
        out.append((name, torch.from_numpy(patches.copy()), [1, int(gh), int(gw)]))
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over b's largest magnitude (the C++ tests' measure)."""
    return float((a - b).abs().max() / b.abs().max())


def check_against_modules(weights, config, images, rms_eps, label):
    """The step-by-step reference against torch's modules, on the images and on a synthetic 2-frame input."""
    gen = torch.Generator().manual_seed(99)
    cases = [(p, [g]) for _, p, g in images]
    cases.append((torch.cat([p for _, p, _ in images]), [g for _, _, g in images]))
    cases.append((torch.rand(2 * 4 * 6, 588, generator=gen, dtype=F64) * 2 - 1, [[2, 4, 6]]))
    for patches, grids in cases:
        a = embed_images(weights, config, patches, grids, rms_eps=rms_eps)
        b = embed_images_with_modules(weights, config, patches, grids, rms_eps=rms_eps)
        err = relative(a, b)
        assert err < 1e-12, (label, grids, err)
    # The interpolation written out equals F.interpolate on its own too (both modes, down and up).
    for mode in ("bilinear", "bicubic"):
        table = torch.randn(8, 8, 5, generator=gen, dtype=F64)
        for h, w in ((6, 8), (8, 10), (3, 13)):
            want = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=mode)[0].permute(1, 2, 0)
            got = torch.einsum("yi,xj,ijc->yxc", interp_matrix(h, 8, mode), interp_matrix(w, 8, mode), table)
            assert relative(got, want) < 1e-13, (mode, h, w)
    print(f"  {label}: step-by-step == torch modules (Conv2d, F.interpolate, complex rotation, SDPA, norms) "
          f"within 1e-12 on both images, both in one call and a 2-frame grid")


def check_text_reference():
    """forward() without `embedded` still gives the kimi_k3_1_pro fixture's stored logits."""
    config = json.loads((TEXT_FIXTURE / "config.json").read_text())
    weights = load_file(str(TEXT_FIXTURE / "model.safetensors"))
    prompt = json.loads((TEXT_FIXTURE / "prompts.json").read_text())["prompts"][1]
    stored = load_file(str(TEXT_FIXTURE / "reference.safetensors"))["logits.1"]
    assert torch.equal(k3.forward(config, weights, prompt).float(), stored)
    print(f"  kimi_k3_reference.forward without `embedded`: kimi_k3_1_pro logits.1 ({len(prompt)} tokens) bit-exact")


def write_common(out: Path, config: dict, weights: dict, reference: dict, info: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(out / "vision_reference.safetensors"))
    (out / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    # What was written is what the reference read.
    reloaded = load_file(str(out / "model.safetensors"))
    assert reloaded.keys() == weights.keys() and all(torch.equal(reloaded[n], t) for n, t in weights.items())


def image_reference(weights, config, images, rms_eps, stats):
    """Per-image and both-in-one-call embeddings; the reference's entries for vision_reference.safetensors."""
    ref, per_image = {}, []
    for name, patches, grid in images:
        e = embed_images(weights, config, patches, [grid], rms_eps=rms_eps, stats=stats if not per_image else None)
        per_image.append(e)
        ref[f"{name}.pixel_values"] = patches.float().contiguous()
        ref[f"{name}.grid"] = torch.tensor(grid, dtype=torch.int64)
        ref[f"{name}.embeddings"] = e.float().contiguous()
    both = embed_images(weights, config, torch.cat([p for _, p, _ in images]), [g for _, _, g in images],
                        rms_eps=rms_eps)
    assert relative(both, torch.cat(per_image)) < 1e-13
    ref["both.embeddings"] = both.float().contiguous()
    return ref, per_image


def prompt_with_images(text: list[list[int]], runs: list[int]):
    ids, offsets = list(text[0]), []
    for n, segment in zip(runs, text[1:]):
        offsets.append(len(ids))
        ids += [PLACEHOLDER] * n + list(segment)
    return ids, offsets


def build_k3(images, rms_eps, eps_name):
    text_config = json.loads((TEXT_FIXTURE / "config.json").read_text())
    config = dict(text_config, vision_config=K3_VISION, media_placeholder_token_id=PLACEHOLDER)
    weights = dict(load_file(str(TEXT_FIXTURE / "model.safetensors")))
    vision = random_vision_weights(config, torch.Generator().manual_seed(SEEDS["kimi_k3_vl"]))
    assert not vision.keys() & weights.keys()
    weights.update(vision)
    check_against_modules(weights, config, images, rms_eps, "kimi_k3_vl")
    stats: dict = {}
    ref, per_image = image_reference(weights, config, images, rms_eps, stats)
    other = "bfloat16" if eps_name == "float32" else "float32"
    moved = relative(embed_images(weights, config, images[0][1], [images[0][2]], rms_eps=RMS_EPS[other]), per_image[0])
    neox = relative(embed_images(weights, config, images[0][1], [images[0][2]], rms_eps=rms_eps, pairs="halves"),
                    per_image[0])
    # The prompt: a seed whose indexer / router decisions have no near-tie.
    rejected, seed = [], 1
    while True:
        gen = torch.Generator().manual_seed(seed)
        text = [torch.randint(2, PLACEHOLDER, (n,), generator=gen).tolist() for n in PROMPT_TEXT_LENGTHS]
        ids, offsets = prompt_with_images(text, [e.shape[0] for e in per_image])
        rows = {o + r: e[r] for o, e in zip(offsets, per_image) for r in range(e.shape[0])}
        gaps = k3.Gaps()
        logits = k3.forward(config, weights, ids, gaps=gaps, embedded=rows)
        close = [f"{site} {g:.2e} ({where})" for site, (g, where) in gaps.smallest.items() if g < k3.MIN_GAP]
        if not close:
            break
        rejected.append({"seed": seed, "why": close})
        seed += 1
        assert seed < 20, rejected
    assert len(ids) > text_config["text_config"]["index_topk"]
    # Sanity: the image rows matter, and where they go matters.
    plain = k3.forward(config, weights, ids)
    swapped_ids, swapped_offsets = prompt_with_images(text, [e.shape[0] for e in per_image[::-1]])
    swapped_rows = {o + r: e[r] for o, e in zip(swapped_offsets, per_image[::-1]) for r in range(e.shape[0])}
    swapped = k3.forward(config, weights, swapped_ids, embedded=swapped_rows)
    tail = offsets[-1] + per_image[-1].shape[0]           # the last text segment: same tokens, same positions
    assert len(swapped_ids) == len(ids) and swapped_ids[tail:] == ids[tail:]
    sanity = {"without_image_rows": relative(plain, logits),
              "images_swapped_last_text_segment": relative(swapped[tail:], logits[tail:])}
    assert sanity["without_image_rows"] > 0.1 and sanity["images_swapped_last_text_segment"] > 0.01
    ref["prompt.ids"] = torch.tensor(ids, dtype=torch.int64)
    ref["prompt.image_offsets"] = torch.tensor(offsets, dtype=torch.int64)
    ref["prompt.logits"] = logits.float().contiguous()
    info = fixture_info("kimi_k3_vl", config, images, ref, stats, rms_eps, eps_name, {
        "description": "Kimi K3 vision tower (MoonViT3d, K3's defaults: RMSNorm, no biases, tanh gelu, bilinear "
                       "position table, qkv_hidden_size 48 > hidden 32, patchmergerv2 projector) at tiny sizes over "
                       "the kimi_k3_1_pro text model (its weights unchanged), as vLLM 0.33.0 computes it; float64 "
                       "reference on the stored bf16 weights, no bf16 rounding of activations",
        "prompt": {"seed": seed, "rejected_seeds": rejected, "tokens": len(ids), "image_offsets": offsets,
                   "smallest_relative_gaps": {s_: {"gap": g, "where": w} for s_, (g, w) in gaps.smallest.items()},
                   "logits_max_abs": float(logits.abs().max()),
                   "relative_change_without_image_rows": sanity["without_image_rows"],
                   "relative_change_images_swapped_last_text_segment": sanity["images_swapped_last_text_segment"]},
        "sensitivity": {f"rms_eps_{other}": moved, "neox_rotation_pairs": neox}})
    write_common(OUT_K3, config, weights, ref, info)
    shutil.copyfile(TEXT_FIXTURE / "generation_config.json", OUT_K3 / "generation_config.json")
    return ref, info


def build_k25(images, rms_eps, eps_name):
    text_config = json.loads((TEXT_FIXTURE / "config.json").read_text())
    config = dict(text_config, vision_config=K25_VISION, media_placeholder_token_id=PLACEHOLDER)
    weights = random_vision_weights(config, torch.Generator().manual_seed(SEEDS["kimi_k25_vision"]))
    check_against_modules(weights, config, images, rms_eps, "kimi_k25_vision")
    stats: dict = {}
    ref, _ = image_reference(weights, config, images, rms_eps, stats)
    info = fixture_info("kimi_k25_vision", config, images, ref, stats, rms_eps, eps_name, {
        "description": "Kimi vision tower with the K2.5-style switches (LayerNorm, attn/linear/patch biases, erf "
                       "gelu, bicubic position table, qkv_hidden_size null == hidden 32, patchmerger projector with "
                       "pre_norm), vision weights only, as vLLM 0.33.0 computes it; float64 reference on the stored "
                       "bf16 weights"})
    write_common(OUT_K25, config, weights, ref, info)
    return ref, info

def build_k3_gpu(images, rms_eps, eps_name):
    """kimi_k3_vl's tower (another seed) projecting to kimi_k3_1_pro_gpu's hidden 128; the text model stays in
    its own fixture (the GPU test merges vision_config.json into its config.json and indexes both files)."""
    text_config = json.loads((GPU_TEXT_FIXTURE / "config.json").read_text())
    assert text_config["text_config"]["hidden_size"] == K3_VISION_GPU["text_hidden_size"]
    vision_file = {"vision_config": K3_VISION_GPU, "media_placeholder_token_id": PLACEHOLDER}
    config = dict(text_config, **vision_file)
    text_weights = load_file(str(GPU_TEXT_FIXTURE / "model.safetensors"))
    vision = random_vision_weights(config, torch.Generator().manual_seed(SEEDS["kimi_k3_vl_gpu"]))
    assert not vision.keys() & text_weights.keys()
    weights = {**text_weights, **vision}
    check_against_modules(weights, config, images, rms_eps, "kimi_k3_vl_gpu")
    stats: dict = {}
    ref, per_image = image_reference(weights, config, images, rms_eps, stats)
    for name, _, _ in images:                     # embeddings and grids only: kimi_k3_vl has the same pixels
        del ref[f"{name}.pixel_values"]
    del ref["both.embeddings"]
    topk = text_config["text_config"]["index_topk"]
    # The prompt: a seed whose indexer / router decisions have no near-tie.
    rejected, seed = [], 1
    while True:
        gen = torch.Generator().manual_seed(seed)
        text = [torch.randint(2, PLACEHOLDER, (n,), generator=gen).tolist() for n in GPU_PROMPT_TEXT_LENGTHS]
        ids, offsets = prompt_with_images(text, [e.shape[0] for e in per_image])
        rows = {o + r: e[r] for o, e in zip(offsets, per_image) for r in range(e.shape[0])}
        gaps = k3.Gaps()
        selections: list = []                     # what each MLA layer's indexer chose (dsa_indexer's masks)
        indexer = k3.dsa_indexer

        def recording_indexer(c, W, p, *args, **kwargs):
            chosen = indexer(c, W, p, *args, **kwargs)
            selections.append((p, chosen))
            return chosen
        k3.dsa_indexer = recording_indexer
        try:
            logits = k3.forward(config, weights, ids, gaps=gaps, embedded=rows)
        finally:
            k3.dsa_indexer = indexer
        close = [f"{site} {g:.2e} ({where})" for site, (g, where) in gaps.smallest.items() if g < k3.MIN_GAP]
        if not close:
            break
        rejected.append({"seed": seed, "why": close})
        seed += 1
        assert seed < 20, rejected
    end = offsets[-1] + per_image[-1].shape[0]
    assert len(ids) > topk and offsets[0] < 10 and end <= topk, (len(ids), offsets)
    # The indexer budget: rows 64.. read 64 of their keys; how many image keys they leave out.
    image_keys = torch.zeros(len(ids), dtype=torch.bool)
    for o, e in zip(offsets, per_image):
        image_keys[o:o + e.shape[0]] = True
    n_image = int(image_keys.sum())
    budget = []
    for prefix, chosen in selections:
        layer = int(prefix.split("layers.")[1].split(".")[0])  # 0-based, as Gaps' "layer l"
        over = chosen[topk:]                                   # the rows past the budget
        picked = over[:, image_keys].sum(-1).double()
        budget.append({"mla_layer": layer, "rows_over_budget": int(over.shape[0]),
                       "image_keys_read_per_row_mean": float(picked.mean()), "min": int(picked.min()),
                       "max": int(picked.max()), "of": n_image,
                       "rows_reading_every_image_key": int((picked == n_image).sum())})
    # Sanity: the image rows matter.
    plain = k3.forward(config, weights, ids)
    first = offsets[0]
    sanity = {"without_image_rows": relative(plain, logits),
              "without_image_rows_first_image_to_63": relative(plain[first:topk], logits[first:topk])}
    assert sanity["without_image_rows_first_image_to_63"] > 0.1, sanity
    ref["prompt.ids"] = torch.tensor(ids, dtype=torch.int64)
    ref["prompt.image_offsets"] = torch.tensor(offsets, dtype=torch.int64)
    ref["prompt.logits"] = logits.float().contiguous()
    info = fixture_info("kimi_k3_vl_gpu", config, images, ref, stats, rms_eps, eps_name, {
        "description": "Kimi K3 vision tower as in kimi_k3_vl (MoonViT3d, K3's defaults at tiny sizes: RMSNorm, no "
                       "biases, tanh gelu, bilinear position table, qkv_hidden_size 48 > hidden 32, patchmergerv2 "
                       "projector), another seed, projecting to 128 for the kimi_k3_1_pro_gpu text model (the GPU "
                       "kernels' shapes), as vLLM 0.33.0 computes it; float64 reference on the stored bf16 weights, "
                       "no bf16 rounding of activations",
        "text_fixture": "tests/fixtures/kimi_k3_1_pro_gpu",
        "prompt": {"seed": seed, "rejected_seeds": rejected, "min_gap_threshold": k3.MIN_GAP, "tokens": len(ids),
                   "image_offsets": offsets, "index_topk": topk,
                   "smallest_relative_gaps": {s_: {"gap": g, "where": w} for s_, (g, w) in gaps.smallest.items()},
                   "indexer_budget": budget,
                   "logits_max_abs": float(logits.abs().max()),
                   "relative_change_without_image_rows": sanity["without_image_rows"],
                   "relative_change_without_image_rows_first_image_to_63":
                       sanity["without_image_rows_first_image_to_63"]}})
    info["notes"] = ["text model: tests/fixtures/kimi_k3_1_pro_gpu, merged at test time (vision_config.json into "
                     "its config.json; a safetensors index mapping its model.safetensors' names there and the "
                     "vision weights to vision.safetensors)",
                     f"prompt: both images within the first {topk} positions; rows {topk}.. of each MLA layer's "
                     f"DSA indexer read only {topk} of their keys (prompt.indexer_budget: how many of the "
                     f"{n_image} image keys they keep)",
                     "pixel values: kimi_k3_vl's vision_reference.safetensors (the same images, the same "
                     "processing, in_patch_limit 48)"] + info["notes"]
    OUT_K3_GPU.mkdir(parents=True, exist_ok=True)
    (OUT_K3_GPU / "vision_config.json").write_text(json.dumps(vision_file, indent=2, sort_keys=True) + "\n")
    save_file(vision, str(OUT_K3_GPU / "vision.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(OUT_K3_GPU / "vision_reference.safetensors"))
    (OUT_K3_GPU / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
    reloaded = load_file(str(OUT_K3_GPU / "vision.safetensors"))
    assert reloaded.keys() == vision.keys() and all(torch.equal(reloaded[n], t) for n, t in vision.items())
    return ref, info


def fixture_info(family, config, images, ref, stats, rms_eps, eps_name, extra):
    s = vision_settings(config)
    return {
        "family": family, "generator": "tools/make_kimi_k3_vision_fixture.py", "command": COMMAND,
        **{k: v for k, v in extra.items() if k == "description"},
        "seed": SEEDS[family], "torch": torch.__version__, "storage": "bfloat16 (vision weights)",
        "images": {name: {"grid_thw": grid, "tokens": (grid[1] // 2) * (grid[2] // 2),
                          "embeddings_max_abs": float(ref[f"{name}.embeddings"].abs().max())}
                   for name, _, grid in images},
        "preprocessor": PREPROCESSOR["media_proc_cfg"], "head_dim": s["d"],
        "gains": {"patch": PATCH_GAIN, "pos_std": POS_STD, "qkv": QKV_GAIN, "wo": OUT_GAIN, "fc0": FC0_GAIN,
                  "fc1": FC1_GAIN, "proj0": PROJ1_GAIN, "proj2": PROJ2_GAIN, "norm_std": NORM_STD,
                  "bias_std": BIAS_STD},
        "stats": stats,
        **{k: v for k, v in extra.items() if k != "description"},
        "notes": [f"vision RMSNorm eps = torch.finfo(torch.{eps_name}).eps = {rms_eps!r}: nn.RMSNorm(H) has eps None "
                  "and torch takes the accumulator (float32) type's eps for bf16 input, not bf16's 2^-7 (the module "
                  "docstring gives the evidence)",
                  "every activation is float64 here; vLLM rounds to bf16 after each linear, norm and residual sum, "
                  "and casts the pixel values to bf16 before the patch embedding",
                  "projector_hidden_act is not read by vLLM: the projector's GELU is always erf (GELUActivation)",
                  "qkv_hidden_size: an absent key is KimiK3VisionConfig's 1536; null means the hidden size"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rms-eps", choices=sorted(RMS_EPS), default="float32",
                        help="the type whose finfo().eps the vision RMSNorms take (default float32: torch's "
                             "behaviour for bf16 input; bfloat16 = 2^-7, torch's old documentation)")
    args = parser.parse_args()
    global COMMAND
    if args.rms_eps != "float32":
        COMMAND += f" --rms-eps {args.rms_eps}"
    torch.set_num_threads(1)
    rms_eps = RMS_EPS[args.rms_eps]
    check_text_reference()
    images = processed_images()
    for name, patches, grid in images:
        print(f"  {name}: grid (t, h, w) = {tuple(grid)}, {patches.shape[0]} patches, "
              f"{(grid[1] // 2) * (grid[2] // 2)} tokens")
    assert [g for _, _, g in images] == [[1, 6, 8], [1, 8, 10]]
    for build, out in ((build_k3, OUT_K3), (build_k25, OUT_K25), (build_k3_gpu, OUT_K3_GPU)):
        ref, info = build(images, rms_eps, args.rms_eps)
        st = info["stats"]
        print(f"{out.relative_to(ROOT)}:")
        for name, _, _ in images:
            e = ref[f"{name}.embeddings"]
            print(f"  {name}: embeddings {tuple(e.shape)}, range [{e.min():+.3f}, {e.max():+.3f}], "
                  f"rms {e.pow(2).mean().sqrt():.3f}")
        print(f"  attention top probability mean {st['attention_top_probability_mean']:.3f} (min "
              f"{st['attention_top_probability_min']:.3f}, max {st['attention_top_probability_max']:.3f}); "
              f"tower output rms {st['tower_output_rms']:.3f}")
        assert 0.15 < st["attention_top_probability_mean"] < 0.85, st
        if "sensitivity" in info:
            sens = info["sensitivity"]
            print("  embeddings move by " + ", ".join(f"{v:.3g} ({k})" for k, v in sens.items()) +
                  " of their largest magnitude")
        if "prompt" in info and "sensitivity" in info:
            pr = info["prompt"]
            print(f"  prompt: {pr['tokens']} tokens, images at {pr['image_offsets']}, logits up to "
                  f"{pr['logits_max_abs']:.3g}; without the image rows they move by "
                  f"{pr['relative_change_without_image_rows']:.3g}, with the images swapped the last text "
                  f"segment's by {pr['relative_change_images_swapped_last_text_segment']:.3g} (relative)")
        if "prompt" in info and "sensitivity" not in info:
            pr = info["prompt"]
            print(f"  prompt: {pr['tokens']} tokens (seed {pr['seed']}, rejected {len(pr['rejected_seeds'])}), images "
                  f"at {pr['image_offsets']}, logits up to {pr['logits_max_abs']:.3g}; without the image rows they "
                  f"move by {pr['relative_change_without_image_rows_first_image_to_63']:.3g} (rows "
                  f"{pr['image_offsets'][0]}..{pr['index_topk'] - 1}), {pr['relative_change_without_image_rows']:.3g} "
                  f"(all rows) (relative)")
            for b in pr["indexer_budget"]:
                print(f"  MLA layer {b['mla_layer']}: rows {pr['index_topk']}.. ({b['rows_over_budget']}) read "
                      f"{b['image_keys_read_per_row_mean']:.1f} of the {b['of']} image keys on average (min "
                      f"{b['min']}, max {b['max']}; {b['rows_reading_every_image_key']} rows read all)")
        if "prompt" in info:
            for site, g in info["prompt"]["smallest_relative_gaps"].items():
                print(f"  smallest relative gap {g['gap']:.2e}  {site} ({g['where']})")
        for f in sorted(out.iterdir()):
            print(f"  {f.name}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
