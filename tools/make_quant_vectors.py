#!/usr/bin/env python3
"""Test vectors for sparrow's number codecs: FP8 E4M3, E2M1, NVFP4 and MXFP4.

An implementation of the formats written from their specifications, independently of the C++
(src/kernels/cpu/fp8_codec.cpp, fp4_codec.cpp) and CUDA (src/kernels/cuda/quant/fp4.cuh) code it checks: every
encode below is a brute-force search for the nearest representable value (ties to the even code) over
a table built from the format's definition, not a port of the engine's threshold logic.

  * FP8 E4M3 "fn": OCP 8-bit Floating Point Specification (OFP8) rev 1.0, E4M3: bias 7, no
    infinities, S.1111.111 is NaN, largest finite 448. Round to nearest even, saturating (SATFINITE);
    NaN -> 0x7F.
  * E2M1: OCP Microscaling Formats (MX) v1.0, section 5.3.3: bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    Round to nearest even, saturating to 6; sign kept (-0 is code 8); NaN -> 0x7 (cuda_fp4.h).
  * NVFP4: blocks of 16, E4M3 block scale = e4m3((amax / 6) / global) with fp32 arithmetic (NVIDIA's
    NVFP4 recipe with IEEE divisions), codes e2m1(|x| / (e4m3(scale) * global)), NaN -> 0x7, a zero
    scale stores +-0.
  * MXFP4: OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax)) - 2), exponent clamped at -127 (amax = 0
    too), NaN scale (0xFF) and codes 0 for a block holding NaN or infinity; codes e2m1(x / X).

Floats are written as their IEEE binary32 bit patterns (so NaN, infinities and -0 survive JSON).
Writes tests/data/quant_vectors.json (tests/quant_test.cpp and tests/cuda/quant_test.cpp read it):

    python3 tools/make_quant_vectors.py --out tests/data/quant_vectors.json
"""
import argparse
import json
import math

import numpy as np

F32 = np.float32


def bits(x):
    return int(np.array([x], dtype=F32).view(np.uint32)[0])


def from_bits(b):
    return F32(np.array([b], dtype=np.uint32).view(F32)[0])


# ---- E4M3 --------------------------------------------------------------------------------------

def e4m3_value(code):
    """The value of an E4M3 code from the OFP8 definition (None for NaN)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return None
    mag = (m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
    return -mag if s else mag


E4M3_POSITIVE = [(c, e4m3_value(c)) for c in range(0x7F)]  # 0x00 .. 0x7E, all finite


def nearest_even(a, table):
    """The code of the table entry nearest to a >= 0; ties to the even code. Exact (float64 of fp32)."""
    best, best_d = None, None
    for code, v in table:
        d = abs(v - a)
        if best is None or d < best_d or (d == best_d and code % 2 == 0 and best % 2 == 1):
            best, best_d = code, d
    return best


def e4m3_encode(x):
    x = F32(x)
    if np.isnan(x):
        return 0x7F
    sign = 0x80 if np.signbit(x) else 0
    a = abs(float(x))
    if a >= 448.0:  # SATFINITE: beyond the largest finite value (and infinities) -> +-448
        return sign | 0x7E
    return sign | nearest_even(a, E4M3_POSITIVE)


def e4m3_decode(code):
    v = e4m3_value(code)
    return F32(np.nan) if v is None else F32(v)


# ---- E2M1 --------------------------------------------------------------------------------------

E2M1_POSITIVE = [(c, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][c]) for c in range(8)]


def e2m1_magnitude(a):
    """a >= 0 (float); nearest even, saturating to 6."""
    if a >= 6.0:
        return 7
    return nearest_even(a, E2M1_POSITIVE)


def e2m1_encode(x):
    x = F32(x)
    if np.isnan(x):
        return 0x7
    return (8 if np.signbit(x) else 0) | e2m1_magnitude(abs(float(x)))


def e2m1_decode(code):
    v = E2M1_POSITIVE[code & 7][1]
    return F32(-v if code & 8 else v)


# ---- NVFP4 -------------------------------------------------------------------------------------

def pack(codes):
    out = []
    for i in range(0, len(codes), 2):
        lo = codes[i]
        hi = codes[i + 1] if i + 1 < len(codes) else 0
        out.append(lo | (hi << 4))
    return out


def nvfp4(xs, glob):
    xs = [F32(x) for x in xs]
    glob = F32(glob)
    codes, scales, decoded = [], [], []
    for b in range(0, len(xs), 16):
        block = xs[b:b + 16]
        finite_or_inf = [abs(float(x)) for x in block if not np.isnan(x)]
        amax = F32(max(finite_or_inf) if finite_or_inf else 0.0)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            sf = F32(F32(amax / F32(6.0)) / glob)
        s8 = e4m3_encode(sf)
        scales.append(s8)
        d = F32(e4m3_decode(s8) * glob)
        for x in block:
            if np.isnan(x):
                code = 0x7
            else:
                sign = 8 if np.signbit(x) else 0
                if d == 0:
                    code = sign
                else:
                    with np.errstate(over="ignore"):
                        q = F32(F32(abs(float(x))) / d)
                    code = sign | e2m1_magnitude(float(q))
            codes.append(code)
            decoded.append(F32(F32(e2m1_decode(code) * e4m3_decode(s8)) * glob))
    return {"global": bits(glob), "x": [bits(x) for x in xs], "scales": scales, "packed": pack(codes),
            "decoded": [bits(v) for v in decoded]}


# ---- MXFP4 -------------------------------------------------------------------------------------

def mxfp4(xs):
    xs = [F32(x) for x in xs]
    codes, scales, decoded = [], [], []
    for b in range(0, len(xs), 32):
        block = xs[b:b + 32]
        if any(not np.isfinite(x) for x in block):
            scales.append(0xFF)
            codes += [0] * len(block)
            decoded += [F32(np.nan)] * len(block)
            continue
        amax = max(abs(float(x)) for x in block)
        if amax == 0.0:
            shared = -127
        else:
            _, e = math.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
            shared = max(-127, (e - 1) - 2)
        scales.append(shared + 127)
        scale = 2.0 ** shared  # exact in float64
        for x in block:
            code = (8 if np.signbit(x) else 0) | e2m1_magnitude(abs(float(x)) / scale)
            codes.append(code)
            decoded.append(F32(float(e2m1_decode(code)) * scale))
    return {"x": [bits(x) for x in xs], "scales": scales, "packed": pack(codes), "decoded": [bits(v) for v in decoded]}


# ---- the cases ---------------------------------------------------------------------------------

def e4m3_cases():
    xs = [0.0, -0.0, 1.0, 0.1, -3.3, 17.0, 18.0, 19.0, 448.0, 449.0, 464.0, 464.0001, 500.0, 1e30, -1e30,
          float("inf"), float("-inf"), float("nan"), -float("nan"), 2.0 ** -10, 1.5 * 2.0 ** -10, 1.5 * 2.0 ** -9,
          2.0 ** -9, 2.0 ** -6, 7 * 2.0 ** -9, 7.5 * 2.0 ** -9, 1e-30, -1e-30, 1e-45, -1e-45, 2.0 ** -126]
    xs.append(float(from_bits(bits(2.0 ** -10) + 1)))  # just above half the smallest subnormal
    # Every midpoint between neighbouring positive codes (ties) and one float either side of it.
    for c in range(0x7E):
        lo, hi = e4m3_value(c), e4m3_value(c + 1)
        mid = F32((lo + hi) / 2)
        xs += [mid, np.nextafter(mid, F32(0)), np.nextafter(mid, F32(1e9))]
    return [[bits(x), e4m3_encode(x)] for x in xs]


def e2m1_cases():
    xs = [0.0, -0.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, 100.0, -0.3, -0.1,
          float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 0.5, 3.0, 4.0]
    for c in range(7):
        lo, hi = E2M1_POSITIVE[c][1], E2M1_POSITIVE[c + 1][1]
        mid = F32((lo + hi) / 2)
        for v in (mid, np.nextafter(mid, F32(0)), np.nextafter(mid, F32(100))):
            xs += [v, -v]
    return [[bits(x), e2m1_encode(x)] for x in xs]


def nvfp4_cases(rng):
    inf, nan = float("inf"), float("nan")
    cases = []

    def add(name, xs, glob=1.0):
        case = nvfp4(xs, glob)
        case["name"] = name
        cases.append(case)

    add("zeros", [0.0] * 16)
    add("negative zeros and a zero block keep signs", [-0.0, 0.0] * 8)
    add("all equal", [1.7] * 16)
    add("all equal negative", [-0.02] * 16)
    # amax 6: scale 1.0, codes are the values themselves; the midpoints tie to even codes.
    add("exact codes and ties", [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6])
    # A scale that rounds down (amax / 6 = 1.1 -> e4m3 1.125 rounds; 6.6 / 1.0625...) and saturation.
    add("scale rounding saturates the largest", [6.6, 6.5, 6.4, 3.3, -6.6, 0.1, 0.2, 0.3, 1, 2, 3, 4, 5, 6, 0, 0])
    # Subnormal E4M3 scales: amax / 6 below 2^-6.
    add("subnormal block scale", [0.05, -0.04, 0.03, 0.02, 0.01, 0.005, 0.0, 0.045] * 2)
    add("scale rounds to zero", [1e-4, -2e-4, 3e-4, 0.0] * 4)
    add("fp32 subnormal inputs", [1e-40, -1e-39, 1e-45, 3e-39] * 4)
    add("beyond the largest scale saturates", [1e5, -3e4, 2e3, 1.0] * 4)
    add("infinity", [inf, 1.0, -2.0, 3.0] * 4)
    add("nan is ignored by amax and stores +6", [nan, 1.0, -2.0, 3.0] * 4)
    add("all nan", [nan] * 16)
    add("partial last block (20 values)", [float(v) for v in rng.normal(0, 2, 20).astype(F32)])
    # NVIDIA's recipe: global = tensor amax / (448 * 6), so the largest block scale lands on 448.
    xs = [float(v) for v in rng.normal(0, 3, 64).astype(F32)]
    add("recipe global scale", xs, glob=F32(max(abs(v) for v in xs) / (448.0 * 6.0)))
    add("global 0.5", [float(v) for v in rng.normal(0, 1, 32).astype(F32)], glob=0.5)
    add("random wide range", [float(v) for v in (rng.normal(0, 1, 48) * np.exp2(rng.integers(-12, 12, 48))).astype(F32)])
    return cases


def mxfp4_cases(rng):
    inf, nan = float("inf"), float("nan")
    cases = []

    def add(name, xs):
        case = mxfp4(xs)
        case["name"] = name
        cases.append(case)

    add("zeros (scale 2^-127)", [0.0] * 32)
    add("negative zeros", [-0.0] * 32)
    add("all equal", [3.0] * 32)
    add("all equal negative", [-0.7] * 32)
    # amax 6 -> X = 2^(2-2) = 1: the codes are the values; the midpoints tie to even codes.
    add("exact codes and ties", [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6] * 2)
    # amax 7.9 -> floor(log2) = 2 -> X = 1: 6.5 .. 7.9 saturate to 6 (the floor rule's saturation).
    add("floor rule saturates", [7.9, 7.0, 6.5, 6.01, 5.99, -7.5] + [0.1 * i for i in range(26)])
    add("power of two amax", [4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625, -4.0] * 4)
    add("tiny block clamps the scale at 2^-127", [1e-39, -2e-39, 5e-40, 0.0] * 8)
    add("fp32 subnormal and normal mix", [1e-45, 2.0 ** -120, 2.0 ** -123, -2.0 ** -122] * 8)
    add("huge values", [3e38, -1e38, 1e37, 1.0] * 8)
    add("infinity gives a nan scale", [inf] + [1.0] * 31)
    add("nan gives a nan scale", [1.0] * 31 + [nan])
    add("partial last block (40 values)", [float(v) for v in rng.normal(0, 2, 40).astype(F32)])
    add("random wide range", [float(v) for v in (rng.normal(0, 1, 64) * np.exp2(rng.integers(-20, 20, 64))).astype(F32)])
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/data/quant_vectors.json")
    args = parser.parse_args()
    rng = np.random.default_rng(20260707)
    data = {
        "_comment": "Written by tools/make_quant_vectors.py (an independent numpy implementation of OCP FP8 "
                    "E4M3, OCP MX v1.0 E2M1 / MXFP4 and NVIDIA's NVFP4 recipe; see its docstring). Floats are "
                    "IEEE binary32 bit patterns; packed FP4 holds element 2i in the low nibble.",
        "e4m3": e4m3_cases(),
        "e2m1": e2m1_cases(),
        "nvfp4": nvfp4_cases(rng),
        "mxfp4": mxfp4_cases(rng),
    }
    with open(args.out, "w") as f:
        # One case a line: small, and diffs stay readable.
        f.write("{\n")
        keys = list(data)
        for k, key in enumerate(keys):
            value = data[key]
            f.write(f"  {json.dumps(key)}: ")
            if isinstance(value, list):
                f.write("[\n")
                for i, item in enumerate(value):
                    f.write("    " + json.dumps(item, separators=(",", ":")) + ("," if i + 1 < len(value) else "") + "\n")
                f.write("  ]")
            else:
                f.write(json.dumps(value))
            f.write(",\n" if k + 1 < len(keys) else "\n")
        f.write("}\n")


if __name__ == "__main__":
    main()
