#!/usr/bin/env python3
"""Writes tests/data/images/: small images of odd sizes in the formats and pixel layouts a chat request may carry,
and what the Python side makes of each (tests/vision_test.cpp compares sparrow's C++ against it, exactly):

  <name>.rgb           the image as PIL decodes it and convert("RGB") leaves it (uint8 [h, w, 3])
  <name>.resized       torchvision's uint8 bicubic antialiased resize to the processor's size (uint8 [H, W, 3])
  <name>.pixel_values  MiniMax-M3-VL's image processor's output (transformers 5.17; fp32), for two cases (the rest
                       differ from them only in the resized pixels, which .resized pins)
  <name>.grid          its image_grid_thw (int64 [3])

and for Kimi K3's preprocessing, which transformers does not have (vLLM 0.33.0 runs the checkpoint's
media_proc_cfg through transformers_utils/processors/kimi_k25_vision_fused.py), a reference written from
vLLM's code below (kimi_reference):

  <name>.kimi_resized       PIL's Image.resize(BICUBIC) to navit_resize's size (uint8)
  <name>.kimi_pixel_values  the normalised, zero-padded patches [N, 3 * 14 * 14] (fp32), for the same two cases
  <name>.kimi_grid          grid_h, grid_w, num_tokens (int64 [3])

in expected.safetensors, and each case's processor settings in cases.json.

    pip install torch torchvision transformers==5.17.0 pillow numpy safetensors
    python3 tools/make_image_fixtures.py
"""
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.numpy import save_file
from torchvision.transforms.v2 import functional as tvF
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor, smart_resize

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "images"
DEFAULT_MIN, DEFAULT_MAX = 4 * 28 * 28, 451584
WITH_PIXEL_VALUES = ("rgb_97x61.png", "downscaled_203x151.jpg")  # ~110 KB each


def picture(h: int, w: int, seed: int) -> np.ndarray:
    """Gradients, edges and noise: every resampling tap matters, and PNG still compresses it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], axis=-1)
    img = img + rng.integers(-40, 41, size=img.shape)
    img[(x // 9 + y // 7) % 2 == 0] //= 2  # a checkerboard of hard edges
    return np.clip(img, 0, 255).astype(np.uint8)


def kimi_reference(image: Image.Image, in_patch_limit: int, side_limit: int, patch: int = 14, merge: int = 2,
                   mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)):
    """vLLM's navit_resize_image, PIL resize and fused normalisation table, step for step (fixed_output_tokens
    unset): the resized image, the patches [N, 3 * patch * patch] in row-major grid order, and the grid."""
    import math
    width, height = image.size
    s1 = math.sqrt(in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, s1, side_limit * patch / width, side_limit * patch / height)
    new_w = min(max(1, int(width * scale)), side_limit * patch)
    new_h = min(max(1, int(height * scale)), side_limit * patch)
    factor = merge * patch
    pad_h, pad_w = (factor - new_h % factor) % factor, (factor - new_w % factor) % factor
    resized = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
    values = np.arange(256, dtype=np.float32)[:, None]
    lut = (values / 255.0 - np.asarray(mean, dtype=np.float32)[None, :]) * (1.0 / np.asarray(std, dtype=np.float32))[None, :]
    padded = np.zeros((new_h + pad_h, new_w + pad_w, 3), dtype=np.uint8)
    padded[:new_h, :new_w] = resized
    normalised = lut[padded, np.arange(3)[None, None, :]]  # [H, W, 3] float32
    gh, gw = padded.shape[0] // patch, padded.shape[1] // patch
    patches = normalised.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3 * patch * patch)
    tokens = (new_h + pad_h) // factor * ((new_w + pad_w) // factor)
    return resized, patches.astype(np.float32), np.array([gh, gw, tokens], dtype=np.int64)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def cases():
    rgb = lambda h, w, s: Image.fromarray(picture(h, w, s))
    yield "rgb_97x61.png", encode(rgb(61, 97, 1), "PNG"), {"kimi": {"in_patch_limit": 16}}
    palette = rgb(33, 45, 2).quantize(colors=37)
    palette.info["transparency"] = 5
    yield "palette_trns_45x33.png", encode(palette, "PNG", transparency=5), {"kimi": {"in_patch_limit": 4}}
    yield "rgba_53x64.png", encode(Image.fromarray(np.dstack([picture(64, 53, 3), picture(64, 53, 4)[..., 0]]), "RGBA"), "PNG"), {}
    yield "grey_alpha_70x40.png", encode(rgb(40, 70, 5).convert("LA"), "PNG"), {}
    grey16 = (picture(40, 70, 6)[..., 0].astype(np.uint16) * 3)  # some over 255: clipped by PIL's I;16 -> RGB
    yield "grey16_70x40.png", encode(Image.fromarray(grey16), "PNG"), {}
    yield "grey16_trns_33x21.png", encode(Image.fromarray(grey16[:21, :33].copy()), "PNG", transparency=300), {}
    yield "rgb_trns_29x35.png", encode(rgb(35, 29, 22), "PNG", transparency=(10, 20, 30)), {}
    rgb16 = picture(30, 57, 7).astype(np.uint16) * 257 + 3
    yield "rgb16_57x30.png", rgb16_png(rgb16), {}
    yield "bilevel_66x29.png", encode(rgb(29, 66, 8).convert("1"), "PNG"), {}
    yield "grey4_31x47.png", encode(rgb(47, 31, 9).convert("L").quantize(colors=16), "PNG", bits=4), {}
    yield "q85_420_101x75.jpg", encode(rgb(75, 101, 10), "JPEG", quality=85, subsampling=2), {"kimi": {"in_patch_limit": 9}}
    yield "q95_444_61x89.jpg", encode(rgb(89, 61, 11), "JPEG", quality=95, subsampling=0), {}
    yield "progressive_77x55.jpg", encode(rgb(55, 77, 12), "JPEG", quality=80, progressive=True), {}
    yield "grey_45x60.jpg", encode(rgb(60, 45, 13).convert("L"), "JPEG", quality=90), {}
    yield "lossy_83x59.webp", encode(rgb(59, 83, 17), "WEBP", quality=80), {}
    yield "lossless_alpha_47x38.webp", encode(Image.fromarray(np.dstack([picture(38, 47, 18), picture(38, 47, 19)[..., 1]]),
                                                              "RGBA"), "WEBP", lossless=True), {}
    yield "lossy_alpha_50x61.webp", encode(Image.fromarray(np.dstack([picture(61, 50, 20), picture(61, 50, 21)[..., 2]]),
                                                           "RGBA"), "WEBP", quality=70), {"kimi": {"in_patch_limit": 10}}
    # Downscaled hard by a small max_pixels (many taps per output pixel), and a long strip.
    yield "downscaled_203x151.jpg", encode(rgb(151, 203, 14), "JPEG", quality=90), {"min_pixels": 784, "max_pixels": 6272,
                                                                                     "kimi": {"in_patch_limit": 12}}
    yield "strip_700x20.png", encode(rgb(20, 700, 15), "PNG"), {"kimi": {"patch_limit_on_one_side": 20}}
    yield "upscaled_19x23.png", encode(rgb(23, 19, 16), "PNG"), {}


def rgb16_png(samples: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (PIL writes none): IHDR, one IDAT of unfiltered rows, IEND."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    h, w, _ = samples.shape
    rows = b"".join(b"\x00" + samples[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    expected, manifest = {}, {}
    for name, data, settings in cases():
        (OUT / name).write_bytes(data)
        min_pixels = settings.get("min_pixels", DEFAULT_MIN)
        max_pixels = settings.get("max_pixels", DEFAULT_MAX)
        rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        processor = MiniMaxM3VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
        out = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        height, width = smart_resize(*rgb.shape[:2], factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
        resized = tvF.resize(torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), [height, width],
                             interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        expected[f"{name}.rgb"] = rgb.copy()
        expected[f"{name}.resized"] = resized.permute(1, 2, 0).contiguous().numpy()
        expected[f"{name}.grid"] = out["image_grid_thw"][0].numpy().astype(np.int64)
        if name in WITH_PIXEL_VALUES:
            expected[f"{name}.pixel_values"] = out["pixel_values"].numpy().astype(np.float32)
        kimi = {"in_patch_limit": 16384, "patch_limit_on_one_side": 512, **settings.get("kimi", {"in_patch_limit": 20})}
        kimi_resized, kimi_patches, kimi_grid = kimi_reference(Image.open(io.BytesIO(data)).convert("RGB"),
                                                               kimi["in_patch_limit"], kimi["patch_limit_on_one_side"])
        expected[f"{name}.kimi_resized"] = np.ascontiguousarray(kimi_resized)
        expected[f"{name}.kimi_grid"] = kimi_grid
        if name in WITH_PIXEL_VALUES:
            expected[f"{name}.kimi_pixel_values"] = kimi_patches
        manifest[name] = {"min_pixels": min_pixels, "max_pixels": max_pixels, "kimi": kimi}
        print(f"{name}: {rgb.shape[1]}x{rgb.shape[0]} -> {width}x{height}, grid {expected[f'{name}.grid'].tolist()}")
    # An animation, which sparrow refuses (tests/vision_test.cpp): not a case.
    frames = [Image.fromarray(np.full((9, 11, 3), v, np.uint8)) for v in (10, 200)]
    (OUT / "animated_11x9.webp").write_bytes(encode(frames[0], "WEBP", save_all=True, append_images=frames[1:],
                                                    duration=100))
    save_file(expected, str(OUT / "expected.safetensors"))
    (OUT / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
