// FP8 E4M3 (the OCP "E4M3FN" variant: no infinities, one NaN code per sign, max finite 448) on the CPU.
// The encode is bit-identical to CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (the PTX
// cvt.rn.satfinite.e4m3x2.f32): round to nearest, ties to even; |x| beyond 448 (infinities included)
// saturates to ±448; NaN becomes 0x7F (NVIDIA canonicalises NaN to the positive code). It serves as the
// reference for the FP8 caches the CUDA kernels write (DSA index keys, MLA latents, FP8 rows) and the
// E4M3 block scale of NVFP4 (kernels/cpu/fp4_codec.h); kernels/cuda/quant/fp4.cuh has its device twin.
#pragma once
#include <cstdint>

namespace sparrow::cpu {

inline constexpr float kE4m3Max = 448.0f;

uint8_t float_to_e4m3(float x);
float e4m3_to_float(uint8_t code);

}  // namespace sparrow::cpu
