#!/usr/bin/env python3
"""Builds the reference fixtures under tests/fixtures: tiny random checkpoints of each model family
together with what HF transformers computes for them, so that tests/reference_test.cpp can check
sparrow against transformers without network access or real weights. (Kimi K3, which transformers does
not have, has its own reference and fixture writer: tools/kimi_k3_reference.py.)

Each fixture folder holds
  config.json, model*.safetensors   the checkpoint, laid out as the family's real checkpoints are
  prompts.json                      {"prompts": [[ids...], ...]}: short (< the sparse budget), medium, long
  reference.safetensors             float32 `logits.<i>` [len_i, vocab] = model(prompt i).logits, one forward
  greedy.json                       {"completions": [[40 ids], ...]}: greedy continuation of each prompt
  fixture.json                      seed, command line, versions, the smallest decision gaps seen

The reference is computed in float32 by the transformers model classes, after reloading the written
checkpoint with from_pretrained (so the reference is what transformers makes of the files on disk).

No fixture hinges on rounding: every top-k the reference takes (indexer tokens, MSA blocks, MoE
groups and experts) and every greedy choice is inspected, and a seed whose k-th / (k+1)-th values
(or top-1 / top-2 logits) lie within rounding distance is rejected for the next one.

Usage: python3 tools/make_fixtures.py --out tests/fixtures                    # all fixtures
       python3 tools/make_fixtures.py --out /tmp/f --family deepseek_v32 --name ds_wide \
           --override hidden_size=96 --override index_topk=24 --seed 7
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import linecache
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLConfig,
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLTextConfig,
)

GREEDY_TOKENS = 40
# Relative gap (to the row's largest magnitude) under which a top-k boundary or a greedy choice
# counts as decided by rounding. fp32 reimplementations differ from transformers by ~1e-6 of the
# row scale, so 3e-5 leaves a wide margin.
DEFAULT_MIN_GAP = 3e-5
DEFAULT_SEED_TRIES = 30
FORGET_GATE_GAIN = 0.3


# ---------------------------------------------------------------------------------------------
# Families: a tiny config each, and how its checkpoint is stored
# ---------------------------------------------------------------------------------------------

DEEPSEEK_V32 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=192, moe_intermediate_size=16,
    num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True,
    index_topk=16, index_n_heads=8, index_head_dim=16,
    max_position_embeddings=256, rms_norm_eps=1e-6,
    # YaRN as DeepSeek ships it, but with mscale != mscale_all_dim so that both the cos/sin factor
    # (mscale / mscale_all_dim) and the softmax scale (mscale_all_dim²) differ from 1.
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                     "rope_theta": 10000.0},
    bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
)

KIMI_LINEAR = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
    num_local_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=2.446, norm_topk_prob=True, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
)

MINIMAX_M3 = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3,
    layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    intermediate_size=16, dense_intermediate_size=128, shared_intermediate_size=32,
    num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
    swiglu_alpha=1.702, swiglu_limit=7.0,
    index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=3, index_local_blocks=1,
    max_position_embeddings=512, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
)

MINIMAX_M3_VL = dict(
    text_config=MINIMAX_M3,
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       patch_size=14, temporal_patch_size=2, spatial_merge_size=2, image_size=56),
    projector_hidden_size=64, image_token_index=250, video_token_index=251,
)


@dataclass
class Family:
    tiny_config: dict
    storage: str  # "float32", "bfloat16", "float16" or "fp8" (bf16 + e4m3 linear weights, sharded)
    # The sparse budget in tokens (prompts are chosen around it); None for dense attention.
    budget: Callable[[dict], int] | None = None
    description: str = ""


def dsa_budget(cfg: dict) -> int:
    return cfg["index_topk"]


def msa_budget(cfg: dict) -> int:
    text = cfg.get("text_config", cfg)
    return text["index_topk_blocks"] * text["index_block_size"]


FAMILIES = {
    "deepseek_v32": Family(DEEPSEEK_V32, "bfloat16", dsa_budget,
                           "DeepseekV32ForCausalLM, bf16 weights, YaRN rope"),
    "deepseek_v32_fp8": Family(DEEPSEEK_V32, "fp8", dsa_budget,
                               "DeepseekV32ForCausalLM, e4m3 linear weights with 128x128 block scales, 3 shards"),
    "kimi_linear": Family(KIMI_LINEAR, "float32", None, "KimiLinearForCausalLM, fp32 weights"),
    "minimax_m3": Family(MINIMAX_M3, "float16", msa_budget,
                         "MiniMaxM3VLForCausalLM (text only), fp16 weights, fused experts"),
    "minimax_m3_vl": Family(MINIMAX_M3_VL, "bfloat16", msa_budget,
                            "MiniMaxM3SparseForConditionalGeneration (vision tower present, text run), "
                            "bf16 weights in the original per-expert layout"),
}


# ---------------------------------------------------------------------------------------------
# Building, randomising and storing the model
# ---------------------------------------------------------------------------------------------

def build_model(family: str, cfg: dict):
    cfg = copy.deepcopy(cfg)
    if family.startswith("deepseek_v32"):
        return DeepseekV32ForCausalLM(DeepseekV32Config(**cfg, attn_implementation="eager"))
    if family == "kimi_linear":
        return KimiLinearForCausalLM(KimiLinearConfig(**cfg, attn_implementation="eager"))
    if family == "minimax_m3":
        return MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**cfg, attn_implementation="eager"))
    if family == "minimax_m3_vl":
        config = MiniMaxM3VLConfig(**cfg)
        config._attn_implementation = "eager"
        config.text_config._attn_implementation = "eager"
        config.vision_config._attn_implementation = "eager"
        return MiniMaxM3SparseForConditionalGeneration(config)
    raise SystemExit(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def load_model(family: str, folder: Path):
    """Reloads a written fixture checkpoint in float32 with transformers' own loader, insisting that
    every tensor in the files found its parameter and every parameter was loaded."""
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if family.startswith("deepseek_v32"):
        model, info = DeepseekV32ForCausalLM.from_pretrained(folder, **kwargs)
    elif family == "kimi_linear":
        model, info = KimiLinearForCausalLM.from_pretrained(folder, **kwargs)
    elif family == "minimax_m3":
        model, info = MiniMaxM3VLForCausalLM.from_pretrained(folder, **kwargs)
    elif family == "minimax_m3_vl":
        model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, **kwargs)
    else:
        raise AssertionError(family)
    problems = {kind: sorted(names)[:5] for kind, names in info.items() if kind != "error_msgs" and names}
    if problems or info.get("error_msgs"):
        raise SystemExit(f"reloading {folder}: {problems} {info.get('error_msgs', '')}")
    return model.eval()


def is_gemma_norm(module) -> bool:
    """MiniMax's RMSNorm scales by (1 + w), so its weights sit around 0 instead of 1."""
    return type(module).__name__ == "MiniMaxM3VLRMSNorm"


@torch.no_grad()
def randomise(model, generator: torch.Generator, weight_gain: float, head_gain: float):
    """Re-initialises every weight with a larger scale than transformers' default (std 0.02) so that
    attention, routing and logits are peaked rather than near-uniform: matrices N(0, gain²/fan_in),
    embeddings N(0, 1), norm scales around 1 (Gemma-style: around 0), biases small."""

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator) * std + mean

    lm_head = model.get_output_embeddings()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if name in ("A_log", "dt_bias"):
                continue  # KDA decay parameters: keep transformers' (FLA's) initialisation
            if isinstance(module, torch.nn.Embedding):
                param.copy_(normal(param.shape, 1.0))
            elif param.ndim >= 2:
                gain = head_gain if module is lm_head else weight_gain
                if module_name.endswith("forget_gate.f_b_proj"):
                    # KDA's decay softplus(f_b(f_a(x)) + dt_bias): keep the projection a small nudge
                    # on dt_bias so that the state remembers over many tokens, as trained models do.
                    gain = FORGET_GATE_GAIN
                param.copy_(normal(param.shape, gain / math.sqrt(param.shape[-1])))
            elif name == "bias":
                param.copy_(normal(param.shape, 0.1))
            else:  # norm scale
                param.copy_(normal(param.shape, 0.1, 0.0 if is_gemma_norm(module) else 1.0))
        for name, buffer in module.named_buffers(recurse=False):
            if name == "e_score_correction_bias":
                buffer.copy_(normal(buffer.shape, 0.05))


def round_to(dtype: torch.dtype, model):
    """Rounds every weight to the storage dtype (the reference then runs in fp32 on the rounded
    values). The router's e_score_correction_bias stays fp32, as DeepSeek and MiniMax ship it."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).float())


def save_checkpoint(model, folder: Path, dtype: torch.dtype):
    """save_pretrained in `dtype`, but with the routers' e_score_correction_bias kept in fp32."""
    fp32_buffers = {}
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            fp32_buffers[name] = buffer.clone()
    model.to(dtype)
    for name, value in fp32_buffers.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        module.e_score_correction_bias = value
    model.save_pretrained(folder)
    model.to(torch.float32)


# --- FP8: DeepSeek-V3's e4m3 weights with 128x128 block scales -------------------------------

FP8_BLOCK = 128
FP8_MAX = 448.0


def fp8_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The linear layers DeepSeek-V3.2 ships in e4m3: every projection of attention, indexer and
    MLP / experts; not the embedding, lm_head, norms, the router, nor the indexer's weights_proj."""
    if tensor.ndim != 2 or not name.endswith(".weight"):
        return False
    excluded = ("embed_tokens", "lm_head", "norm", ".mlp.gate.weight", "weights_proj")
    return not any(part in name for part in excluded)


def fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block (edge blocks partial): scale = amax / 448, stored as weight_scale_inv with
    weight ≈ e4m3 * scale_inv."""
    rows, cols = weight.shape
    scale_rows, scale_cols = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(scale_rows, scale_cols, dtype=torch.float32)
    for i in range(scale_rows):
        for j in range(scale_cols):
            block = weight[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            scale = block.abs().max().item() / FP8_MAX or 1.0
            scale_inv[i, j] = scale
            quantized[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = \
                (block / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def fp8_dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    expanded = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return quantized.float() * expanded[: quantized.shape[0], : quantized.shape[1]]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def write_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int):
    """Splits the tensors (in name order, so a layer may straddle two files) over `shards` files
    with a model.safetensors.index.json, as sharded Hugging Face checkpoints are written."""
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    per_shard = -(-len(names) // shards)
    weight_map, total_size = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s * per_shard:(s + 1) * per_shard]}
        save_file(part, folder / file, metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = file
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_to_fp8(folder: Path, shadow: Path):
    """Rewrites the bf16 checkpoint in `folder` as DeepSeek's FP8 layout (3 shards), and writes into
    `shadow` the same checkpoint with the e4m3 weights dequantized to fp32 (what the reference loads:
    transformers' own CPU dequantization does not handle partial 128-blocks)."""
    tensors = read_safetensors(folder)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if fp8_quantizable(name, tensor):
            quantized, scale_inv = fp8_quantize(tensor)
            stored[name] = quantized
            stored[name + "_scale_inv"] = scale_inv
            dequantized[name] = fp8_dequantize(quantized, scale_inv)
        else:
            stored[name] = tensor
            dequantized[name] = tensor.float()
    write_sharded(stored, folder, shards=3)
    config = json.loads((folder / "config.json").read_text())
    shadow.mkdir(parents=True)
    (shadow / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(dequantized, shadow / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Watching every top-k and greedy choice for near-ties
# ---------------------------------------------------------------------------------------------

# A top-k whose indices are thrown away (`x.topk(2, dim=-1)[0].sum(...)`: the router's per-group
# score) decides nothing at its boundary: swapping two tied values leaves the values the same.
VALUES_ONLY_TOPK = re.compile(r"topk\(.*\)\s*(\[0\]|\.values\b)")


class GapMonitor:
    """Wraps torch.topk / Tensor.topk while active and records, per call site, the smallest
    relative gap between the k-th and (k+1)-th largest values of any row. Masked entries (±inf,
    or transformers' finfo.min fill) are not compared: their order decides nothing."""

    def __init__(self):
        self.smallest = {}  # call site -> (relative gap, detail)

    def note(self, site: str, gap: float, detail: str):
        if site not in self.smallest or gap < self.smallest[site][0]:
            self.smallest[site] = (gap, detail)

    def inspect(self, values: torch.Tensor, k: int, dim: int, largest: bool, site: str):
        if not values.is_floating_point():
            return
        rows = values.detach().movedim(dim, -1)
        n = rows.shape[-1]
        if k >= n or rows.numel() == 0:
            return
        rows = rows.reshape(-1, n).double()
        if not largest:
            rows = -rows
        limit = torch.finfo(values.dtype).max / 2
        meaningful = torch.isfinite(rows) & (rows.abs() < limit)
        ordered = rows.sort(dim=-1, descending=True).values
        kth, next_ = ordered[:, k - 1], ordered[:, k]
        both = torch.isfinite(kth) & torch.isfinite(next_) & (kth.abs() < limit) & (next_.abs() < limit)
        if not both.any():
            return
        scale = torch.where(meaningful, rows.abs(), torch.zeros_like(rows)).amax(dim=-1).clamp_min(1e-30)
        gaps = ((kth - next_) / scale)[both]
        i = int(gaps.argmin())
        self.note(site, float(gaps[i]), f"k={k} of {n}")

    def __enter__(self):
        self.original_function = torch.topk
        self.original_method = torch.Tensor.topk
        monitor = self

        def call_site():
            """The calling function's name, or None when the call keeps only the values."""
            frame = sys._getframe(3)  # call_site <- watch <- topk wrapper <- caller
            if VALUES_ONLY_TOPK.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno)):
                return None
            return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)

        def watch(values, k, dim, largest):
            site = call_site()
            if site is not None:
                monitor.inspect(values, k, dim, largest, site)

        def topk_function(input, k, dim=-1, largest=True, sorted=True, **kwargs):
            watch(input, k, dim, largest)
            return monitor.original_function(input, k, dim=dim, largest=largest, sorted=sorted, **kwargs)

        def topk_method(self, k, dim=-1, largest=True, sorted=True, **kwargs):
            watch(self, k, dim, largest)
            return monitor.original_method(self, k, dim=dim, largest=largest, sorted=sorted, **kwargs)

        torch.topk = topk_function
        torch.Tensor.topk = topk_method
        return self

    def __exit__(self, *exc):
        torch.topk = self.original_function
        torch.Tensor.topk = self.original_method


def greedy_gap(logits: torch.Tensor) -> float:
    top2 = logits.double().sort(descending=True).values[:2]
    return float((top2[0] - top2[1]) / logits.double().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------------------------

def prompt_lengths(family: Family, cfg: dict, requested: list[int] | None) -> list[int]:
    if requested:
        return requested
    if family.budget is None:
        return [8, 37, 100]
    budget = family.budget(cfg)
    return [max(2, min(12, budget // 2)), budget + budget // 2 + 3, max(90, 3 * budget + 7)]


def text_forward(model, ids: list[int], **kwargs):
    return model(input_ids=torch.tensor([ids]), **kwargs)


@torch.no_grad()
def compute_reference(model, prompts: list[list[int]], monitor: GapMonitor):
    """Logits of one forward per prompt, and the greedy continuation computed by re-running the
    full forward at every step (no cache), all under the top-k monitor."""
    logits, completions, smallest_greedy = [], [], (math.inf, "")
    with monitor:
        for i, prompt in enumerate(prompts):
            logits.append(text_forward(model, prompt, use_cache=False).logits[0].float().clone())
            ids = list(prompt)
            for step in range(GREEDY_TOKENS):
                last = text_forward(model, ids, use_cache=False).logits[0, -1]
                gap = greedy_gap(last)
                if gap < smallest_greedy[0]:
                    smallest_greedy = (gap, f"prompt {i} step {step}")
                ids.append(int(last.argmax()))
            completions.append(ids[len(prompt):])
    return logits, completions, smallest_greedy


@torch.no_grad()
def generate_with_cache(model, prompts: list[list[int]], monitor: GapMonitor) -> list[list[int]]:
    """transformers' generate() (KV / state cache, one token per step) as a cross-check."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with monitor:
        for prompt in prompts:
            ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 use_cache=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            out.append(ids[0, len(prompt):].tolist())
    return out


def compare_weights(expected: dict[str, torch.Tensor], model) -> list[str]:
    """Names whose reloaded value differs (bit-wise) from what was meant to be written."""
    actual = dict(model.named_parameters())
    actual.update(dict(model.named_buffers()))
    return [n for n, t in expected.items() if n not in actual or not torch.equal(actual[n].float(), t.float())]


# ---------------------------------------------------------------------------------------------
# One fixture
# ---------------------------------------------------------------------------------------------

def parse_override(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--override wants key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def apply_overrides(cfg: dict, overrides: list[str]) -> dict:
    """key=value (value JSON-parsed, else a string); dotted keys reach into nested dicts
    (text_config.hidden_size=96)."""
    cfg = copy.deepcopy(cfg)
    for text in overrides:
        key, value = parse_override(text)
        target, parts = cfg, key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return cfg


def write_checkpoint(family_name: str, family: Family, model, folder: Path, scratch: Path) -> dict:
    """Writes the checkpoint; returns the fp32 weights the reference must see after reloading."""
    storage = family.storage
    if storage == "float32":
        model.save_pretrained(folder)
    elif storage in ("bfloat16", "float16"):
        round_to(getattr(torch, storage), model)
        save_checkpoint(model, folder, getattr(torch, storage))
    elif storage == "fp8":
        round_to(torch.bfloat16, model)
        save_checkpoint(model, folder, torch.bfloat16)
        convert_to_fp8(folder, scratch / "dequantized")
    else:
        raise AssertionError(storage)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected.update({n: b.detach().clone() for n, b in model.named_buffers() if "e_score" in n})
    return expected


def build_fixture(family_name: str, out_dir: Path, name: str, seed: int, overrides: list[str],
                  lengths: list[int] | None, min_gap: float, max_tries: int, weight_gain: float,
                  head_gain: float, command: str) -> None:
    family = FAMILIES[family_name]
    cfg = apply_overrides(family.tiny_config, overrides)
    target = out_dir / name
    scratch = out_dir / f".{name}.tmp"
    rejected = []
    for attempt in range(max_tries):
        this_seed = seed + attempt
        shutil.rmtree(scratch, ignore_errors=True)
        checkpoint = scratch / "checkpoint"
        torch.manual_seed(this_seed)
        generator = torch.Generator().manual_seed(this_seed)
        model = build_model(family_name, cfg).eval()
        randomise(model, generator, weight_gain, head_gain)
        expected = write_checkpoint(family_name, family, model, checkpoint, scratch)

        if family.storage == "fp8":
            # The dequantized shadow holds, by construction, exactly what the e4m3 files mean.
            reference_model = load_model(family_name, scratch / "dequantized")
        else:
            reference_model = load_model(family_name, checkpoint)
            mismatched = compare_weights(expected, reference_model)
            if mismatched:
                raise SystemExit(f"{name}: reloaded weights differ from the written ones: {mismatched[:5]}")

        vocab = reference_model.config.get_text_config().vocab_size
        prompt_gen = torch.Generator().manual_seed(1000 + this_seed)
        prompts = [torch.randint(2, vocab, (n,), generator=prompt_gen).tolist()
                   for n in prompt_lengths(family, cfg, lengths)]

        monitor = GapMonitor()
        logits, completions, smallest_greedy = compute_reference(reference_model, prompts, monitor)
        cached = generate_with_cache(reference_model, prompts, monitor)

        problems = [f"greedy gap {smallest_greedy[0]:.2e} at {smallest_greedy[1]}"] \
            if smallest_greedy[0] < min_gap else []
        problems += [f"top-k gap {gap:.2e} in {site} ({detail})"
                     for site, (gap, detail) in monitor.smallest.items() if gap < min_gap]
        if problems:
            rejected.append({"seed": this_seed, "why": problems})
            print(f"  {name}: seed {this_seed} rejected: {'; '.join(problems)}")
            continue

        cache_agrees = cached == completions
        if not cache_agrees:
            print(f"  {name}: WARNING generate(use_cache=True) differs from the full-forward greedy; "
                  f"greedy.json keeps the full-forward one")
        peak = torch.cat([l.softmax(-1).amax(-1) for l in logits]).mean().item()
        gaps = {"greedy_top1_top2": {"gap": smallest_greedy[0], "where": smallest_greedy[1]}}
        gaps.update({site: {"gap": gap, "detail": detail} for site, (gap, detail) in sorted(monitor.smallest.items())})

        shutil.rmtree(target, ignore_errors=True)
        checkpoint.rename(target)
        shutil.rmtree(scratch, ignore_errors=True)
        (target / "prompts.json").write_text(json.dumps({"prompts": prompts}) + "\n")
        (target / "greedy.json").write_text(json.dumps({"completions": completions}) + "\n")
        save_file({f"logits.{i}": l.contiguous() for i, l in enumerate(logits)}, target / "reference.safetensors")
        info = {
            "family": family_name, "description": family.description, "storage": family.storage,
            "seed": this_seed, "rejected_seeds": rejected, "command": command,
            "overrides": overrides, "prompt_lengths": [len(p) for p in prompts],
            "transformers": transformers.__version__, "torch": torch.__version__,
            "weight_gain": weight_gain, "head_gain": head_gain, "min_gap_threshold": min_gap,
            "smallest_relative_gaps": gaps, "cached_generate_agrees": cache_agrees,
            "mean_top1_probability": peak,
        }
        (target / "fixture.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"{name}: seed {this_seed}, prompts {[len(p) for p in prompts]}, mean top-1 prob {peak:.2f}, "
              f"cached generate agrees: {cache_agrees}")
        for site, entry in gaps.items():
            print(f"    smallest gap {entry['gap']:.2e}  {site}")
        return
    shutil.rmtree(scratch, ignore_errors=True)
    raise SystemExit(f"{name}: no seed in {seed}..{seed + max_tries - 1} is free of near-ties")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder that receives one folder per fixture")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="build only this family (default: all)")
    parser.add_argument("--name", help="output folder name (default: the family name); needs --family")
    parser.add_argument("--seed", type=int, default=1, help="first seed tried (default 1)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="change the family's tiny config (JSON value; dotted keys for nested dicts)")
    parser.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated prompt lengths (default: around the sparse budget)")
    parser.add_argument("--min-gap", type=float, default=DEFAULT_MIN_GAP,
                        help="reject seeds with a relative top-k / greedy gap below this")
    parser.add_argument("--max-tries", type=int, default=DEFAULT_SEED_TRIES, help="seeds tried before giving up")
    parser.add_argument("--weight-gain", type=float, default=1.5, help="std of weights times sqrt(fan_in)")
    parser.add_argument("--head-gain", type=float, default=4.0, help="the same for lm_head (peaked logits)")
    parser.add_argument("--storage", choices=["float32", "bfloat16", "float16", "fp8"],
                        help="store the weights in this dtype instead of the family's (e.g. bfloat16 for GPU "
                             "fixtures: the reference then runs on exactly the weights the GPU holds)")
    args = parser.parse_args()
    if args.name and not args.family:
        parser.error("--name needs --family")
    torch.set_default_dtype(torch.float32)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # reproducible reductions
    command = " ".join(["python3", "tools/make_fixtures.py"] + sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.storage and not args.family:
        parser.error("--storage needs --family")
    if args.storage:
        FAMILIES[args.family] = dataclasses.replace(FAMILIES[args.family], storage=args.storage)
    for family_name in [args.family] if args.family else FAMILIES:
        build_fixture(family_name, args.out, args.name or family_name, args.seed, args.override,
                      args.prompt_lengths, args.min_gap, args.max_tries, args.weight_gain, args.head_gain, command)


if __name__ == "__main__":
    main()
