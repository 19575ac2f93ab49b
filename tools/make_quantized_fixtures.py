#!/usr/bin/env python3
"""Writes the quantized-weight fixtures: a tiny checkpoint stored as a release stores its weights, and its
dequantized twin (the same model with every quantized weight written out in float32).

    tests/fixtures/minimax_m3_nvfp4/   MiniMax-M3.1-Flash's layout: routed experts in ModelOpt NVFP4
                                       (per-expert w1 / w2 / w3: weight U8, weight_scale E4M3 per 16,
                                       weight_scale_2, input_scale), every other projection MXFP8 (weight
                                       E4M3, weight_scale_inv E8M0 per 32); hf_quant_config.json
                                       MIXED_PRECISION with quantized_layers.
    tests/fixtures/deepseek_v32_mxfp4/ Kimi K3's expert format: routed experts in compressed-tensors MXFP4
                                       (weight_packed U8, weight_scale E8M0 per 32), the rest as it was;
                                       config.json quantization_config "compressed-tensors".
Each has twin/ (config.json without quantization, model.safetensors). tests/quantized_weights_test.cpp
checks that sparrow dequantizes every weight to the twin's values bit for bit and that both checkpoints
give the same logits.

This encoder and its dequantizer are written from the formats' definitions (OCP Microscaling v1.0 for
E2M1 / E8M0 / MXFP; vLLM 0.33's dequantize_to_dtype for NVFP4's order of products), in numpy (torch only
for the E4M3 rounding), independently of sparrow's C++ codecs.

    python3 tools/make_quantized_fixtures.py    # rewrites both fixtures from their sources
"""
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def read(folder: Path) -> dict:
    """The fixture's tensors as torch tensors in their stored dtypes."""
    tensors = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return tensors


def as_torch(tensors: dict) -> dict:
    return {n: (t if isinstance(t, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(t))).contiguous()
            for n, t in tensors.items()}


# --- element codecs ------------------------------------------------------------------------------

def e4m3_round(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3 value (torch's float8_e4m3fn cast: round to nearest even, saturating at 448)."""
    clipped = np.clip(x, -448.0, 448.0).astype(np.float32)
    return torch.from_numpy(clipped).to(torch.float8_e4m3fn)


def e4m3_values(codes: torch.Tensor) -> np.ndarray:
    return codes.float().numpy()


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign bit 8) of values already within [-6, 6]: nearest magnitude, ties to the even code."""
    mag = np.abs(x)[..., None]
    dist = np.abs(mag - E2M1_VALUES)
    best = dist.min(axis=-1, keepdims=True)
    # among the nearest, the even code (codes 0, 2, 4, 6 have an even mantissa bit)
    candidates = np.where(dist == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(axis=-1)
    code = np.where(even < 99, even, candidates.min(axis=-1)).astype(np.uint8)
    return code | np.where(np.signbit(x), 8, 0).astype(np.uint8)


def e2m1_decode(code: np.ndarray) -> np.ndarray:
    value = E2M1_VALUES[code & 7]
    return np.where(code & 8, -value, value).astype(np.float32)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Element 2i in the low nibble, 2i + 1 in the high one; an odd row gets a zero high nibble."""
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def blocks(w: np.ndarray, size: int) -> np.ndarray:
    """[rows, cols] -> [rows, ceil(cols / size), size], the last block zero-padded (values or codes)."""
    rows, cols = w.shape
    n = -(-cols // size)
    padded = np.zeros((rows, n * size), w.dtype if w.dtype == np.uint8 else np.float32)
    padded[:, :cols] = w
    return padded.reshape(rows, n, size)


def e8m0_exponent(amax: np.ndarray, emax_elem: int) -> np.ndarray:
    """OCP MX v1.0 6.3: shared exponent floor(log2(amax)) - emax_elem, clamped to [-127, 127]."""
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))), -127) - emax_elem
    return np.clip(e, -127, 127).astype(np.int32)


# --- formats: (stored tensors, dequantized float32 weight) -----------------------------------------

def mxfp8(w: np.ndarray):
    b = blocks(w, 32)
    exp = e8m0_exponent(np.abs(b).max(axis=-1), 8)  # E4M3's largest value 448 = 1.75 * 2^8
    scale = np.ldexp(np.float32(1), exp).astype(np.float32)
    codes = e4m3_round((b / scale[..., None]).reshape(w.shape[0], -1)[:, : w.shape[1]])
    values = e4m3_values(codes)
    full = np.zeros((w.shape[0], b.shape[1] * 32), np.float32)
    full[:, : w.shape[1]] = values
    deq = (full.reshape(b.shape) * scale[..., None]).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return {"weight": codes, "scale": (exp + 127).astype(np.uint8)}, deq.astype(np.float32)


def mxfp4(w: np.ndarray):
    b = blocks(w, 32)
    exp = e8m0_exponent(np.abs(b).max(axis=-1), 2)  # E2M1's largest value 6 = 1.5 * 2^2
    scale = np.ldexp(np.float32(1), exp).astype(np.float32)
    codes = e2m1_encode(np.clip(b / scale[..., None], -6, 6)).reshape(w.shape[0], -1)[:, : w.shape[1]]
    deq = (e2m1_decode(blocks(codes, 32)) * scale[..., None]).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return {"packed": pack_nibbles(codes), "scale": (exp + 127).astype(np.uint8)}, deq.astype(np.float32)


def nvfp4(w: np.ndarray):
    """ModelOpt's recipe: global scale_2 = amax / (6 * 448); per 16 values an E4M3 scale of
    amax_block / (6 * scale_2); codes of x / (e4m3(scale) * scale_2). Dequantized as vLLM's
    dequantize_to_dtype: e2m1 * (e4m3(scale) * scale_2), fp32."""
    scale_2 = np.float32(np.abs(w).max() / (6.0 * 448.0))
    b = blocks(w, 16)
    block_scale = e4m3_round((np.abs(b).max(axis=-1) / np.float32(6.0) / scale_2).astype(np.float32))
    d = (e4m3_values(block_scale) * scale_2).astype(np.float32)
    safe = np.where(d > 0, d, 1).astype(np.float32)
    q = np.where(d[..., None] > 0, np.clip(b / safe[..., None], -6, 6), 0).astype(np.float32)
    codes = e2m1_encode(q).reshape(w.shape[0], -1)[:, : w.shape[1]]
    deq = (e2m1_decode(blocks(codes, 16)) * d[..., None]).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return ({"packed": pack_nibbles(codes), "scale": block_scale.contiguous(), "scale_2": np.array([scale_2], np.float32)},
            deq.astype(np.float32))


# --- fixtures ------------------------------------------------------------------------------------

def is_projection(name: str, w: np.ndarray) -> bool:
    """Linear weights a release quantizes: not the embedding, head, norms, router or its bias."""
    if w.ndim != 2 or not name.endswith(".weight"):
        return False
    return not any(part in name for part in ("embed_tokens", "lm_head", "norm", ".gate.weight", "weights_proj"))


def split_experts(tensors: dict) -> dict:
    """transformers' fused experts (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) as the
    release's per-expert w1 (gate), w3 (up), w2 (down)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):  # (clone: each expert's slice becomes its own tensor)
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w1.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.w3.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w2.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def write(folder: Path, source: Path, stored: dict, twin: dict, config: dict, twin_config: dict, extra: dict):
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "twin").mkdir(parents=True)
    for file in ("generation_config.json",):
        if (source / file).exists():
            shutil.copy(source / file, folder / file)
    save_file(as_torch(stored), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, text in extra.items():
        (folder / name).write_text(text)
    save_file(as_torch(twin), str(folder / "twin" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "twin" / "config.json").write_text(json.dumps(twin_config, indent=2, sort_keys=True) + "\n")


def make_minimax_nvfp4():
    source = FIXTURES / "minimax_m3"
    tensors = split_experts(read(source))
    stored, twin, layers = {}, {}, {}
    for name, t in sorted(tensors.items()):
        base, w = name[: -len(".weight")], t.float().numpy()
        if ".experts." in name:
            parts, deq = nvfp4(w)
            stored[name] = parts["packed"]
            stored[base + ".weight_scale"] = parts["scale"]
            stored[base + ".weight_scale_2"] = parts["scale_2"]
            stored[base + ".input_scale"] = np.array([1.0], np.float32)
            twin[name] = deq
            layers[base] = {"quant_algo": "NVFP4", "group_size": 16}
        elif is_projection(name, w):
            parts, deq = mxfp8(w)
            stored[name] = parts["weight"]
            stored[base + ".weight_scale_inv"] = parts["scale"]
            twin[name] = deq
            layers[base] = {"quant_algo": "MXFP8", "group_size": 32}
        else:
            stored[name] = t
            twin[name] = t
    config = json.loads((source / "config.json").read_text())
    quant = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                              "quantized_layers": layers}}
    write(FIXTURES / "minimax_m3_nvfp4", source, stored, twin, config, config,
          {"hf_quant_config.json": json.dumps(quant, indent=2, sort_keys=True) + "\n"})


def make_deepseek_mxfp4():
    source = FIXTURES / "deepseek_v32"
    tensors = read(source)
    stored, twin = {}, {}
    for name, t in sorted(tensors.items()):
        if ".experts." in name and name.endswith(".weight"):
            base = name[: -len(".weight")]
            parts, deq = mxfp4(t.float().numpy())
            stored[base + ".weight_packed"] = parts["packed"]
            stored[base + ".weight_scale"] = parts["scale"]
            twin[name] = deq
        else:
            stored[name] = t
            twin[name] = t
    twin_config = json.loads((source / "config.json").read_text())
    config = dict(twin_config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["re:.*mlp\\.experts\\..*"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                        "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None}},
        "ignore": ["lm_head"]}
    write(FIXTURES / "deepseek_v32_mxfp4", source, stored, twin, config, twin_config, {})


if __name__ == "__main__":
    make_minimax_nvfp4()
    make_deepseek_mxfp4()
