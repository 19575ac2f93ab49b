#!/usr/bin/env python3
"""Writes tests/fixtures/minimax_m3_vl/vision_reference.safetensors: MiniMax-M3-VL's image embeddings (what the
vision tower, the projector and the 2x2 patch merger make of an image's patches, one row per image token) for the
fixture's weights, computed in float64 by a reference written here from vLLM 0.33.0's
vllm/models/minimax_m3/common/vision_tower.py (the engine that serves the released checkpoint) and its rotary
setup (model_executor/layers/rotary_embedding/mrope_vit_setup.py, mrope.py's triton_mrope, NeoX pairs):

  patch embedding   a Conv3d whose kernel is its stride: one product of the [C, T, P, P] patch row, no bias
  pre_layrnorm      LayerNorm
  each layer        x + attn(LN1(x)), then + fc2(gelu(fc1(LN2(x)))); attention over one image's patches at a
                    time (cu_seqlens), q / k / v / out with biases, scale head_dim^-0.5, no causal mask
  rotary            each of t, h, w takes a = 2 * ((head_dim / 3) / 2) dimensions (a / 2 frequencies
                    1 / theta^(2i / a)); the first 3a dimensions of q and k rotate in NeoX halves, frequency j
                    of axis t, h, w for j in [0, a/2), [a/2, a), [a, 3a/2); the rest pass through. A patch's
                    (t, h, w) follows the processor's 2x2 merge-window order of patch rows
  no post layernorm (the release ships none; vLLM builds the tower without it)
  projector         linear_1, gelu (erf), linear_2, per patch
  patch merger      4 consecutive patch rows concatenated, linear_1, gelu, linear_2

transformers 5.17 rotates differently (docs/vision.md): its embeddings for the same patches are printed beside,
to show the two engines disagree, and are not the reference.

Input: the MiniMax processor's patches of the images that tests/data/images/expected.safetensors holds them for
(transformers' processor, which src/vision reproduces exactly). Output, per image: <name>.embeddings (float32 of
the float64 result, [tokens, text hidden]) and <name>.grid; and "both.embeddings", the two images in one call.

And a prompt with both images in it (PROMPT: text, the first image's placeholder tokens, text, the second's, text;
longer than the text model's sparse budget of 3 blocks of 8): "prompt.ids" and "prompt.logits" [len, vocab], the
logits of transformers 5.17's text model in float64 (MiniMaxM3SparseForConditionalGeneration's language model and
head, plain 1-D positions) on the prompt's embeddings with each image's placeholder rows replaced by the reference
embeddings above, as vLLM's merge_multimodal_embeddings places them. "prompt.image_offsets": where each image's
placeholders start.

    pip install torch transformers==5.17.0 numpy safetensors
    python3 tools/make_minimax_vision_fixture.py
"""
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "minimax_m3_vl"
IMAGES = ("rgb_97x61.png", "downscaled_203x151.jpg")


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def positions(grid, merge):
    """(t, h, w) of each patch row, in the processor's merge-window order (mrope_vit_setup.py)."""
    t, h, w = grid
    out = []
    for local in range(t * h * w):
        rem, tpos = local % (h * w), local // (h * w)
        bh, r = rem // (merge * w), rem % (merge * w)
        bw, r2 = r // (merge * merge), r % (merge * merge)
        out.append((tpos, bh * merge + r2 // merge, bw * merge + r2 % merge))
    return np.array(out, dtype=np.float64)


def rotate(x, pos, head_dim, theta):
    """vLLM's partial 3D RoPE on x [N, heads, head_dim]."""
    axis = 2 * ((2 * (head_dim // 2) // 3) // 2)
    half = axis // 2
    inv = 1.0 / theta ** (np.arange(0, axis, 2, dtype=np.float64) / axis)  # the same for t, h and w
    angles = np.concatenate([pos[:, a:a + 1] * inv[None, :] for a in range(3)], axis=1)  # [N, 3 * half]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    rot = 3 * axis
    x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
    out = x.copy()
    out[..., :rot // 2] = x1 * cos - x2 * sin
    out[..., rot // 2:rot] = x2 * cos + x1 * sin
    assert 3 * half == rot // 2
    return out


def embeddings(weights, config, patches, grids):
    vc = config["vision_config"]
    hidden, heads = vc["hidden_size"], vc["num_attention_heads"]
    head_dim, eps, merge = hidden // heads, vc["layer_norm_eps"], vc["spatial_merge_size"]
    theta = vc.get("rope_parameters", {}).get("rope_theta", vc.get("rope_theta", 10000.0))
    W = lambda name: weights[name].astype(np.float64)
    v = "vision_tower.vision_model."
    x = patches @ W(v + "embeddings.patch_embedding.weight").reshape(hidden, -1).T
    x = layer_norm(x, W(v + "pre_layrnorm.weight"), W(v + "pre_layrnorm.bias"), eps)
    pos = np.concatenate([positions(g, merge) for g in grids])
    bounds = np.cumsum([0] + [int(np.prod(g)) for g in grids])
    for i in range(vc["num_hidden_layers"]):
        p = f"{v}encoder.layers.{i}."
        lin = lambda name, y: y @ W(p + name + ".weight").T + W(p + name + ".bias")
        y = layer_norm(x, W(p + "layer_norm1.weight"), W(p + "layer_norm1.bias"), eps)
        q = rotate(lin("self_attn.q_proj", y).reshape(-1, heads, head_dim), pos, head_dim, theta)
        k = rotate(lin("self_attn.k_proj", y).reshape(-1, heads, head_dim), pos, head_dim, theta)
        val = lin("self_attn.v_proj", y).reshape(-1, heads, head_dim)
        attn = np.zeros_like(val)
        for s, e in zip(bounds[:-1], bounds[1:]):
            logits = np.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / math.sqrt(head_dim)
            logits -= logits.max(-1, keepdims=True)
            prob = np.exp(logits)
            prob /= prob.sum(-1, keepdims=True)
            attn[s:e] = np.einsum("hqk,khd->qhd", prob, val[s:e])
        x = x + lin("self_attn.out_proj", attn.reshape(-1, hidden))
        y = layer_norm(x, W(p + "layer_norm2.weight"), W(p + "layer_norm2.bias"), eps)
        x = x + lin("block_sparse_moe.fc2", gelu(lin("block_sparse_moe.fc1", y)))
    top = lambda name, y: y @ W(name + ".weight").T + W(name + ".bias")
    x = top("multi_modal_projector.linear_2", gelu(top("multi_modal_projector.linear_1", x)))
    x = x.reshape(x.shape[0] // (merge * merge), -1)
    return top("patch_merge_mlp.linear_2", gelu(top("patch_merge_mlp.linear_1", x)))


def transformers_embeddings(patches, grid):
    import torch
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(str(FIXTURE), dtype=torch.float64)
    with torch.no_grad():
        out = model.get_image_features(pixel_values=torch.from_numpy(patches),
                                       image_grid_thw=torch.tensor([grid]))
    out = getattr(out, "pooler_output", out)
    return (out[0] if isinstance(out, (list, tuple)) else out).numpy()


# Text, image 1's placeholders, text, image 2's, text. The ids avoid the image and video tokens (250, 251).
PROMPT_TEXT = ([17, 42, 99, 3, 128, 61, 200, 14, 77, 9, 180, 36],
               [7, 64, 201, 33, 150, 9, 119, 48, 222, 5, 90],
               [88, 12, 240, 5, 131, 66, 19, 245, 102, 57])


def prompt_logits(config, embeddings_per_image):
    """The text model's logits for PROMPT_TEXT around the images, in float64 (transformers 5.17)."""
    import torch
    from transformers import AutoModelForImageTextToText
    image_token = config["image_token_index"]
    ids, offsets = list(PROMPT_TEXT[0]), []
    for emb, text in zip(embeddings_per_image, PROMPT_TEXT[1:]):
        offsets.append(len(ids))
        ids += [image_token] * emb.shape[0] + list(text)
    model = AutoModelForImageTextToText.from_pretrained(str(FIXTURE), dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager").eval()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        for emb, offset in zip(embeddings_per_image, offsets):
            embeds[0, offset:offset + emb.shape[0]] = torch.from_numpy(emb)
        hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
        logits = model.lm_head(hidden)[0].numpy()
    return np.array(ids, dtype=np.int64), np.array(offsets, dtype=np.int64), logits


def main():
    config = json.loads((FIXTURE / "config.json").read_text())
    from safetensors.torch import load_file as load_torch  # bf16 weights: numpy has no bfloat16
    weights = {k: t.double().numpy() for k, t in load_torch(str(FIXTURE / "model.safetensors")).items()}
    expected = load_file(str(ROOT / "tests" / "data" / "images" / "expected.safetensors"))
    out = {}
    patches = [expected[n + ".pixel_values"].astype(np.float64) for n in IMAGES]
    grids = [[int(v) for v in expected[n + ".grid"]] for n in IMAGES]
    for name, p, g in zip(IMAGES, patches, grids):
        e = embeddings(weights, config, p, [g])
        out[name + ".embeddings"] = e.astype(np.float32)
        out[name + ".grid"] = np.array(g, dtype=np.int64)
        try:
            theirs = transformers_embeddings(p, g)
            print(f"{name}: {e.shape[0]} tokens; transformers 5.17 differs by up to {np.abs(theirs - e).max():.3g} "
                  f"(embeddings up to {np.abs(e).max():.3g})")
        except Exception as error:  # the reference does not depend on it
            print(f"{name}: {e.shape[0]} tokens; transformers 5.17 not compared ({error})")
    both = embeddings(weights, config, np.concatenate(patches), grids)
    out["both.embeddings"] = both.astype(np.float32)
    per_image = [embeddings(weights, config, p, [g]) for p, g in zip(patches, grids)]
    ids, offsets, logits = prompt_logits(config, per_image)
    # As float32 (exact below 2^24), the one type the tests' safetensors reader widens.
    out["prompt.ids"], out["prompt.image_offsets"] = ids.astype(np.float32), offsets.astype(np.float32)
    out["prompt.logits"] = logits.astype(np.float32)
    print(f"prompt: {len(ids)} tokens, images at {offsets.tolist()}; logits up to {np.abs(logits).max():.3g}")
    assert np.allclose(both, np.concatenate([embeddings(weights, config, p, [g]) for p, g in zip(patches, grids)]))
    save_file(out, str(FIXTURE / "vision_reference.safetensors"))


if __name__ == "__main__":
    main()
