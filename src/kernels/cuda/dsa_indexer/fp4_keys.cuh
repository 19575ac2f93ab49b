// 4-bit index keys (MXFP4 68 B, NVFP4 72 B a token) for the DSA indexer kernels: where a key lies in its
// page, and how a thread widens its part of a key in registers into tensor-core operands.
//
// Page layout (cache/page_codec.cpp, Fp4RowsCodec; docs/cache.md), a page of B tokens, "values then
// scales": [B x 64 bytes of e2m1 codes, two a byte, element 2i in the low nibble][B x S scale bytes], S = 4
// E8M0 scales for MXFP4 (one per 32 values, OCP MX v1.0 section 6.3) or 8 E4M3 scales for NVFP4 (one per 16,
// second-level scale kKvTensorScale = 1.0, cache/page_codec.h). Every page starts on 64 bytes (the
// planner), so a key's codes are one aligned 64-byte line, its MXFP4 scales one aligned word and its NVFP4
// scales one aligned 8-byte pair of words.
//
// Hopper has no FP4 tensor-core product, so keys are widened to a type the tensor cores take. The
// choice, per format (the queries are the FP8 queries of FP8 keys in both: e4m3 with one fp32 scale per
// (token, head), dsa_quantize_queries):
//
//  * MXFP4 -> e4m3, FP8 products (wgmma / mma.sync e4m3). A value is e2m1 x 2^(e_b - 127) for its block b.
//    e2m1 x 2^j is exact in e4m3 for j in [-8, 6] (6 x 2^6 = 384 <= 448; 0.5 x 2^-8 = 2^-9, the smallest
//    subnormal), so each key takes the power of two r = 2^(eref - 127), eref = max(emax, 7) - 6 with emax
//    its largest block exponent, out of its values (r joins the key's score factor, as FP8 keys' fp32 scale
//    does) and stores e2m1 x 2^(e_b - eref) in e4m3: exact for every block within 14 binades of the key's
//    largest (e_b - eref >= -8), which LayerNorm'd keys always are; a block further below is rounded to
//    nearest even in e4m3 (its values are below 2^-14 of the key's largest, those below 2^-18 of it become
//    zero) and the CPU path (kernels/cpu/dsa_reference.cpp) rounds its keys the same way. (The clamp at 7 keeps r
//    a normal float when every block scale of a key is below 2^-120.) e4m3 products run at twice the
//    16-bit rate, which keeps 64 heads (DeepSeek-V3.2) memory-bound at 68 B a key.
//  * NVFP4 -> f16, f16 products (wgmma / the same kernel for every row count). A value is e2m1 x s with s
//    the block's E4M3 scale: up to 6 significant bits (1.5 x 1.875), so it is not an e4m3 in general, but
//    every such product is an f16 (11 significant bits, normal from 2^-14: the values lie in
//    [0.5 x 2^-9, 6 x 448] = [2^-10, 2688]), exactly. f16 rather than bf16 (exact as well): an e2m1
//    magnitude's f16 has a zero low byte, so one byte permute widens two codes; the e4m3 queries are
//    f16s exactly.
//
// Widening with byte permutes (PTX ISA, prmt.b32): a 32-bit word of codes holds 8 elements, nibble k =
// element k. prmt selects each output byte from 8 table bytes by a 3-bit index, so with the magnitudes of
// four codes as the selector (the sign bit, prmt's sign-replicate flag, masked off) one instruction maps
// four codes through an 8-entry table; the signs come from a second prmt in sign-replicate mode, which
// copies the top bit of a chosen byte: byte n of the word holds elements 2n (low nibble) and 2n+1, so
// the top bit of byte n of (word << 4) is element 2n's sign and that of byte n of the word element 2n+1's.
// Nine integer instructions for 8 e4m3 values, 17 for 8 scaled f16 values, done after the key tile has
// landed in shared memory while the next tiles' copies are in flight.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/dsa_indexer/index_scores.h"
#include "kernels/cuda/quant/fp4.cuh"

namespace sparrow::cuda::dsa {

inline constexpr int kFp4CodeBytes = kDsaIndexDim / 2;  // 64: a key's codes

// Scale bytes per token: 4 E8M0 (MXFP4) or 8 E4M3 (NVFP4).
__host__ __device__ constexpr int fp4_scale_bytes(PageFormat f) { return f == PageFormat::Mxfp4Rows ? 4 : 8; }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// The sign bits of a word's elements 0..3 (lo) and 4..7 (hi) as the top bits of four bytes (other bits
// of each byte are copies of it: mask with 0x80808080). Selector nibble 8|i copies the top bit of table
// byte i; table bytes 0..3 are (word << 4)'s, 4..7 the word's.
__device__ __forceinline__ void fp4_signs(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t xs = x << 4;
  lo = prmt(xs, x, 0xD9C8u);  // elements 0, 1, 2, 3: (xs byte 0, x byte 0, xs byte 1, x byte 1)
  hi = prmt(xs, x, 0xFBEAu);  // elements 4, 5, 6, 7: bytes 2 and 3 likewise
}

// ---- MXFP4 -> e4m3 ----

// e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (table bytes 0..3 and 4..7).
inline constexpr uint32_t kE4m3Lut0 = 0x3C383000u, kE4m3Lut1 = 0x4C484440u;

// A key's MXFP4 scale word (4 E8M0 bytes, block b in byte b) -> the power of two its e4m3 values are
// relative to: eref (see the top of this file), and r = 2^(eref - 127) as a float (NaN when a block
// holds the NaN scale 0xFF: the key then decodes to NaN, and so does its score).
__device__ __forceinline__ int mxfp4_eref(uint32_t scales) {
  const uint32_t m = __vmaxu4(scales, scales >> 16);  // bytes 0, 1: max of (0, 2), (1, 3)
  const int emax = int(max(m & 0xFFu, (m >> 8) & 0xFFu));
  return max(emax, 7) - 6;
}
__device__ __forceinline__ float mxfp4_key_factor(uint32_t scales, int eref) {
  const bool nan = __vcmpeq4(scales, 0xFFFFFFFFu) != 0u;
  return nan ? __uint_as_float(0x7FC00000u) : __uint_as_float(uint32_t(eref) << 23);
}

// The 8-entry table e4m3(e2m1(c) x 2^j), c = 0..7, of a block j = e_b - eref <= 6 below the reference.
// For j >= -5 every entry is a normal e4m3 whose exponent field is the j = 0 entry's plus j: adding 8j
// to each byte (but the zero's) never carries nor borrows between bytes (entries 0x30..0x4C, |8j| <= 48).
// Below, entries become subnormal (exact down to j = -8) or round: each is converted (rare).
__device__ __forceinline__ void mxfp4_table(int j, uint32_t& t0, uint32_t& t1) {
  if (j >= -5) {
    t0 = kE4m3Lut0 + uint32_t(8 * j) * 0x01010100u;
    t1 = kE4m3Lut1 + uint32_t(8 * j) * 0x01010101u;
  } else {
    uint32_t b[2] = {0u, 0u};
#pragma unroll
    for (int c = 1; c < 8; ++c)
      b[c / 4] |= uint32_t(quant::e4m3_encode(ldexpf(quant::e2m1_decode(uint32_t(c)), j))) << (8 * (c % 4));
    t0 = b[0];
    t1 = b[1];
  }
}

// 8 codes (one word) -> 8 e4m3 bytes: lo = elements 0..3, hi = elements 4..7, byte k = element k.
__device__ __forceinline__ void mxfp4_widen(uint32_t x, uint32_t t0, uint32_t t1, uint32_t& lo, uint32_t& hi) {
  const uint32_t m = x & 0x77777777u;
  uint32_t s_lo, s_hi;
  fp4_signs(x, s_lo, s_hi);
  lo = prmt(t0, t1, m) | (s_lo & 0x80808080u);
  hi = prmt(t0, t1, m >> 16) | (s_hi & 0x80808080u);
}

// A thread's 32 consecutive values of a key (16 code bytes: dims 32q .. 32q+31, MXFP4 block q) -> 8 words
// of e4m3 in dim order (word w = dims 32q + 4w .. 32q + 4w + 3), and the key's factor r.
__device__ __forceinline__ void mxfp4_widen_block(const uint4& codes, uint32_t scales, int q, uint32_t (&out)[8],
                                                  float& factor) {
  const int eref = mxfp4_eref(scales);
  factor = mxfp4_key_factor(scales, eref);
  uint32_t t0, t1;
  mxfp4_table(int((scales >> (8 * q)) & 0xFFu) - eref, t0, t1);
  mxfp4_widen(codes.x, t0, t1, out[0], out[1]);
  mxfp4_widen(codes.y, t0, t1, out[2], out[3]);
  mxfp4_widen(codes.z, t0, t1, out[4], out[5]);
  mxfp4_widen(codes.w, t0, t1, out[6], out[7]);
}

// ---- NVFP4 -> f16 ----

// High bytes of the f16 e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3800, 0x3C00, 0x3E00, ...):
// their low bytes are all zero.
inline constexpr uint32_t kF16Lut0 = 0x3E3C3800u, kF16Lut1 = 0x46444240u;

// 8 codes (one word) -> 4 f16x2 words of e2m1 x s (s: the block's scale as f16x2, both halves equal):
// out[p] = elements 2p (low half), 2p + 1. Products are exact (see the top of this file).
__device__ __forceinline__ void nvfp4_widen(uint32_t x, __half2 s, uint32_t (&out)[4]) {
  const uint32_t m = x & 0x77777777u;
  uint32_t s_lo, s_hi;
  fp4_signs(x, s_lo, s_hi);
  const uint32_t lo = prmt(kF16Lut0, kF16Lut1, m) | (s_lo & 0x80808080u);  // high bytes of elements 0..3
  const uint32_t hi = prmt(kF16Lut0, kF16Lut1, m >> 16) | (s_hi & 0x80808080u);
  // [0, e0, 0, e1] etc.: selector 4 picks a zero byte of the second operand.
  const uint32_t h[4] = {prmt(lo, 0u, 0x1404u), prmt(lo, 0u, 0x3424u), prmt(hi, 0u, 0x1404u), prmt(hi, 0u, 0x3424u)};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h[p]), s);
    out[p] = *reinterpret_cast<uint32_t*>(&v);
  }
}

// Two E4M3 bytes (low byte first) -> f16x2, exactly (every e4m3 is an f16).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(two)));
  return h;
}

// A thread's 32 consecutive values of a key (dims 32q .. 32q+31: NVFP4 blocks 2q, 2q+1, whose scale
// bytes are `scales2`, block 2q low) -> 16 f16x2 words in dim order (word i = dims 32q + 2i, 32q + 2i + 1).
__device__ __forceinline__ void nvfp4_widen_block(const uint4& codes, uint32_t scales2, uint32_t (&out)[16]) {
  const uint32_t sc = e4m3x2_to_f16x2(scales2);
  const uint32_t s0w = prmt(sc, 0u, 0x1010u), s1w = prmt(sc, 0u, 0x3232u);  // (s0, s0), (s1, s1)
  const __half2 s0 = *reinterpret_cast<const __half2*>(&s0w), s1 = *reinterpret_cast<const __half2*>(&s1w);
  uint32_t w[4];
  nvfp4_widen(codes.x, s0, w);
  out[0] = w[0], out[1] = w[1], out[2] = w[2], out[3] = w[3];
  nvfp4_widen(codes.y, s0, w);
  out[4] = w[0], out[5] = w[1], out[6] = w[2], out[7] = w[3];
  nvfp4_widen(codes.z, s1, w);
  out[8] = w[0], out[9] = w[1], out[10] = w[2], out[11] = w[3];
  nvfp4_widen(codes.w, s1, w);
  out[12] = w[0], out[13] = w[1], out[14] = w[2], out[15] = w[3];
}

}  // namespace sparrow::cuda::dsa
