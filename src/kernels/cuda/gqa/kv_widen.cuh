// Widening narrow cached values to bf16 pairs in registers, exactly, with integer ops and bf16 multiplies:
// the GQA attention kernels (attention_kernel.cuh) and the MSA block selector (msa/msa.cu) read FP8 and FP4
// pages in place and feed the bf16 tensor cores with these.
//
// Why not the hardware conversions: Hopper has no FP4 conversion at all (cvt ... e2m1x2 is sm_100+), and
// its e4m3 -> f16 conversion (cvt.rn.f16x2.e4m3x2), followed by f16 -> f32 -> bf16, is three instructions
// per pair on the conversion pipe, which issues at a quarter of the integer / FMA rate (CUDA C++
// Programming Guide, "Arithmetic Instructions", throughput table, compute capability 9.0: 16 conversions
// per clock and SM). That is what made the first FP8 MSA key path slower than bf16 (bench/results/
// kernels.md, "MSA selection with FP8 index keys"). Here every conversion is a few 32-bit PRMT / shift /
// LOP3 ops and one bf16x2 multiply per pair, all on full-rate pipes.
//
// The value formats are kernels/cpu/fp8_codec.h (E4M3) and kernels/cpu/fp4_codec.h (E2M1, NVFP4, MXFP4); every
// function below returns exactly the CPU decode of its codes, rounded to nothing (each decoded value is a
// bf16 value), with one documented exception: the E4M3 NaN codes 0x7F / 0xFF read as +-480 (the writers
// produce them only for NaN inputs; checking for them would cost a third more per value).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quant/fp4.cuh"

namespace sparrow::cuda::widen {

// PTX prmt.b32 (default mode): byte j of the result is byte sel[4j+2 : 4j] of {b, a} (a = bytes 0-3);
// a selector nibble with bit 3 set would replicate that byte's sign instead, so selectors here never set it.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// a * b on two bf16 pairs, round to nearest (PTX mul.rn.bf16x2, sm_90). Subnormal inputs and results are
// kept (the PTX half-precision arithmetic has no .ftz for bf16; SASS HMUL2 without .FTZ keeps them).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// ---- FP8 E4M3 -> bf16 ----

// 2^120 as a bf16 pair (biased exponent 247).
constexpr uint32_t kBf16x2Pow2p120 = 0x7B807B80u;

// Bytes 0 and 2 of u (E4M3 codes) as a bf16 pair scaled by 2^-120: the sign goes to bit 15 (31), the 7
// exponent-and-mantissa bits to bits 10..4 (26..20), so bf16's exponent field holds E4M3's exponent e and
// its mantissa E4M3's 3 mantissa bits on top. A normal code 1.m * 2^(e-7) then reads 1.m * 2^(e-127), a
// subnormal m/8 * 2^-6 reads as the bf16 subnormal m/8 * 2^-126: both the value times 2^-120. Bytes 1
// and 3 of u land outside both masks.
__device__ __forceinline__ uint32_t e4m3_pair_scaled(uint32_t u) {
  return ((u << 4) & 0x07F007F0u) | ((u << 8) & 0x80008000u);
}

// Four E4M3 codes (x's byte 0 first) -> two bf16 pairs (values 0, 1 and 2, 3; the lower one in the low
// half): 2 PRMT + 2 x (2 shifts, 2 logic ops) + 2 bf16x2 multiplies by 2^120, exact (the products have
// at most 4 significant bits and lie in [2^-9, 448]).
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t x, uint32_t& lo, uint32_t& hi) {
  lo = mul_bf16x2(e4m3_pair_scaled(prmt(x, 0u, 0x3120u)), kBf16x2Pow2p120);  // bytes 0, 1 at bytes 0, 2
  hi = mul_bf16x2(e4m3_pair_scaled(prmt(x, 0u, 0x1302u)), kBf16x2Pow2p120);  // bytes 2, 3 at bytes 0, 2
}

// ---- E2M1 -> bf16 ----

// Eight E2M1 codes (nibble k of x = value k: byte i holds values 2i in its low and 2i+1 in its high
// nibble, the packing of kernels/cpu/fp4_codec.h) -> four bf16 pairs (values 2k, 2k+1), unscaled and exact.
// The magnitude (3 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6) indexes an 8-entry table held in two registers: one
// PRMT looks up 4 values at once, its selector nibbles being 4 magnitudes (bit 3 cleared: plain byte
// select, not sign replication); the low and the high bytes of the bf16 values are two such tables. A
// value's sign (bit 3 of its nibble) is moved to the msb of its high byte by one PRMT per 4 values (byte
// i of {x << 4, x} carries the signs of values 2i / 2i+1 in its msb), and a last PRMT interleaves low
// and high bytes. 15 integer ops per 8 values; no subnormals anywhere (0.5 is bf16 0x3F00).
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t x, uint32_t (&out)[4]) {
  // bf16 of 0, 0.5, 1, 1.5 | 2, 3, 4, 6 = 0000 3F00 3F80 3FC0 | 4000 4040 4080 40C0: low and high bytes.
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;
  constexpr uint32_t kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;
  const uint32_t m = x & 0x77777777u;
  const uint32_t m_hi = m >> 16;  // the selector reads the low 4 nibbles: values 4..7
  const uint32_t lo0 = prmt(kLo0, kLo1, m), hi0 = prmt(kHi0, kHi1, m);
  const uint32_t lo1 = prmt(kLo0, kLo1, m_hi), hi1 = prmt(kHi0, kHi1, m_hi);
  const uint32_t x4 = x << 4;                                              // byte i's msb: value 2i's sign
  const uint32_t s0 = prmt(x4, x, 0x5140u), s1 = prmt(x4, x, 0x7362u);     // byte k's msb: value k's (4+k's) sign
  const uint32_t h0 = hi0 | (s0 & 0x80808080u), h1 = hi1 | (s1 & 0x80808080u);
  out[0] = prmt(lo0, h0, 0x5140u);  // [lo(v0) hi(v0) lo(v1) hi(v1)]
  out[1] = prmt(lo0, h0, 0x7362u);  // v2, v3
  out[2] = prmt(lo1, h1, 0x5140u);  // v4, v5
  out[3] = prmt(lo1, h1, 0x7362u);  // v6, v7
}

// ---- block scales as bf16 pairs ----

// An NVFP4 block scale (E4M3) as the bf16 pair (s, s), exactly: the fp32 value has at most 4 significant
// bits, so its top 16 bits are the bf16. The second-level scale of the KV pages is 1.0 (kKvTensorScale,
// cache/page_codec.h), so value = e2m1 * s: one bf16x2 multiply per pair, exact (a 2-bit by 4-bit
// significand product in [2^-10, 2688]).
__device__ __forceinline__ uint32_t nvfp4_scale_bf16x2(uint32_t code) {
  const uint32_t b = __float_as_uint(quant::e4m3_decode(uint8_t(code))) >> 16;
  return b | (b << 16);
}

// An MXFP4 block scale (E8M0, 2^(code - 127); 0xFF = NaN) as the bf16 pair (X, X), exactly: bf16 has
// fp32's exponent range, code 0 (2^-127) being the bf16 subnormal 0x0040. value = e2m1 * X: one bf16x2
// multiply per pair, exact wherever fp32 holds the value (the CPU's fp32 product), NaN scales give NaN.
__device__ __forceinline__ uint32_t mxfp4_scale_bf16x2(uint32_t code) {
  const uint32_t b = code == quant::kE8m0Nan ? 0x7FC0u : code == 0 ? 0x0040u : code << 7;
  return b | (b << 16);
}

}  // namespace sparrow::cuda::widen
