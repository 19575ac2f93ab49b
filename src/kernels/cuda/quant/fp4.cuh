// Device twins of the CPU number codecs (kernels/cpu/fp8_codec.h and kernels/cpu/fp4_codec.h): FP8 E4M3, E2M1,
// E8M0, and the NVFP4 / MXFP4 block rules, as __device__ __forceinline__ functions for kernels that
// write or read quantised KV-cache pages. Each gives the CPU reference's bits exactly; the rules and
// their special cases (NaN, infinities, zero scales, saturation) are documented once, in
// kernels/cpu/fp4_codec.h. tests/cuda/quant_test.cpp checks them against the CPU codecs and the committed
// vectors (tests/data/quant_vectors.json).
//
// Hopper (sm_90) has no FP4 arithmetic and no E2M1 conversion instruction (cvt ... e2m1x2 is sm_100+),
// so E2M1 is encoded with comparisons against the exact midpoints and decoded by assembling the fp32
// bits; E4M3 uses the hardware conversion (cvt.rn.satfinite.e4m3x2.f32) with NaN pinned to 0x7F.
// Arithmetic uses explicit round-to-nearest intrinsics (__fdiv_rn, __fmul_rn) so that no compiler
// flag (fast math, contraction) can change a bit.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

namespace sparrow::cuda::quant {

inline constexpr int kNvfp4Block = 16;
inline constexpr int kMxfp4Block = 32;
inline constexpr uint8_t kE8m0Nan = 0xFF;

// ---- FP8 E4M3 (fn: max 448, no infinities) ----

__device__ __forceinline__ uint8_t e4m3_encode(float x) {
  if (isnan(x)) return 0x7F;
  return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Exact: s eeee mmm, bias 7; exponent 0 holds m * 2^-9; S.1111.111 is NaN.
__device__ __forceinline__ float e4m3_decode(uint8_t code) {
  const uint32_t e = (code >> 3) & 15u, m = code & 7u;
  float v;
  if (e == 15u && m == 7u) v = __uint_as_float(0x7FC00000u);
  else if (e == 0u) v = float(m) * 0x1p-9f;
  else v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e - 7): fp32 exponent e - 7 + 127
  return (code & 0x80u) ? -v : v;
}

// ---- E2M1 ----

// The magnitude code of a >= 0 (NaN: 7): how many of the midpoints 0.25, 0.75, ..., 5 it passes, ties
// going to the even code (`>` where the lower neighbour's code is even, `>=` where the upper one's is).
__device__ __forceinline__ uint32_t e2m1_magnitude(float a) {
  if (isnan(a)) return 7u;
  return uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) + uint32_t(a >= 1.75f) +
         uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.0f);
}

__device__ __forceinline__ uint32_t sign_nibble(float x) { return (__float_as_uint(x) >> 28) & 8u; }

__device__ __forceinline__ uint32_t e2m1_encode(float x) {
  return isnan(x) ? 7u : sign_nibble(x) | e2m1_magnitude(fabsf(x));
}

// s ee m, bias 1: exponent 0 holds m * 0.5; otherwise (1 + m/2) * 2^(ee - 1).
__device__ __forceinline__ float e2m1_decode(uint32_t code) {
  const uint32_t ee = (code >> 1) & 3u, m = code & 1u;
  const uint32_t magnitude = ee == 0u ? (m ? 0x3F000000u : 0u) : (((ee + 126u) << 23) | (m << 22));
  return __uint_as_float(magnitude | ((code & 8u) << 28));
}

// ---- E8M0 ----

__device__ __forceinline__ float e8m0_decode(uint8_t code) {
  if (code == kE8m0Nan) return __uint_as_float(0x7FC00000u);
  return code == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(uint32_t(code) << 23);  // 2^-127 is subnormal
}

// ---- NVFP4: value = e2m1 * e4m3(scale) * global ----

// The E4M3 block scale of a block whose largest magnitude is amax (NaNs left out, as fmaxf does).
__device__ __forceinline__ uint8_t nvfp4_scale(float amax, float global) {
  return e4m3_encode(__fdiv_rn(__fdiv_rn(amax, 6.0f), global));
}
// The step codes are divided by: e4m3(scale) * global.
__device__ __forceinline__ float nvfp4_step(uint8_t scale, float global) {
  return __fmul_rn(e4m3_decode(scale), global);
}
__device__ __forceinline__ uint32_t nvfp4_encode(float x, float step) {
  if (isnan(x)) return 7u;
  return step == 0.0f ? sign_nibble(x) : sign_nibble(x) | e2m1_magnitude(__fdiv_rn(fabsf(x), step));
}
__device__ __forceinline__ float nvfp4_decode(uint32_t code, uint8_t scale, float global) {
  return __fmul_rn(__fmul_rn(e2m1_decode(code), e4m3_decode(scale)), global);
}

// ---- MXFP4: value = e2m1 * 2^(scale - 127) ----

// The E8M0 scale of a block (OCP MX v1.0 section 6.3): 2^(floor(log2(amax)) - 2), clamped at 2^-127;
// NaN when the block holds a NaN or an infinity. For amax >= 0, floor(log2(amax)) + 127 is amax's
// biased fp32 exponent (0 for zero and subnormals, whose scale clamps anyway), so the byte is that
// exponent minus 2, at least 0.
__device__ __forceinline__ uint8_t mxfp4_scale(float amax, bool any_not_finite) {
  if (any_not_finite) return kE8m0Nan;
  const int biased = int(__float_as_uint(amax) >> 23);
  return uint8_t(biased > 2 ? biased - 2 : 0);
}
// 1 / X = 2^(127 - scale), for the scales mxfp4_scale gives (at most 252): a normal fp32.
__device__ __forceinline__ float mxfp4_inverse(uint8_t scale) { return __uint_as_float(uint32_t(254 - scale) << 23); }
__device__ __forceinline__ uint32_t mxfp4_encode(float x, float inverse) {
  return sign_nibble(x) | e2m1_magnitude(__fmul_rn(fabsf(x), inverse));  // exact: a power of two
}
__device__ __forceinline__ float mxfp4_decode(uint32_t code, uint8_t scale) {
  return __fmul_rn(e2m1_decode(code), e8m0_decode(scale));
}

}  // namespace sparrow::cuda::quant
