// 4-bit floating point on the CPU: the E2M1 element, and the two block-scaled formats built on it,
// NVFP4 (NVIDIA) and MXFP4 (OCP Microscaling v1.0). These are the reference the CUDA twins in
// kernels/cuda/quant/fp4.cuh must match bit for bit, and the codecs of the NVFP4 / MXFP4 KV-cache
// pages (cache/page_codec.h). tests/data/quant_vectors.json (written by tools/make_quant_vectors.py, an
// independent numpy implementation of the same rules) pins every rule below.
//
// E2M1 (OCP MX v1.0 section 5.3.3, "FP4"): s ee m, exponent bias 1, no infinity, no NaN.
//   code 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 1 is the one subnormal); code | 8 = the negative.
//   Encode: round to nearest, ties to the even code; |x| > 6 (infinities included) saturates to ±6;
//   the sign is kept, so -0 and negatives that round to zero give code 8 (-0); NaN gives 0x7 (+6, what
//   CUDA's cuda_fp4.h conversions document for NaN).
//   Packing: two codes a byte, element 2i in the low nibble and 2i+1 in the high nibble (the order of
//   vLLM's and MiniMax MSA's FP4 caches); an odd count leaves the last high nibble 0.
//
// E4M3 (the block scale of NVFP4) is kernels/cpu/fp8_codec.h.
//
// E8M0 (OCP MX v1.0 section 5.4.1): an unsigned biased exponent, value 2^(code - 127) for 0..254,
//   0xFF = NaN; no zero, no sign.
//
// NVFP4: blocks of 16 consecutive values, each block one E4M3 scale, and one fp32 second-level scale
//   `global` for the whole tensor (a KV cache: per layer, kept outside the pages):
//     value = e2m1(code) * e4m3(scale) * global       (product in that order; the first is exact)
//   Block scale, as NVIDIA's NVFP4 recipe chooses it (TensorRT-LLM / FlashInfer cvt_warp_fp16_to_fp4,
//   with global = 1 / their "global encode scale"), with IEEE arithmetic throughout:
//     amax  = largest |x| of the block, NaNs ignored (fmaxf)
//     scale = e4m3_satfinite_rne((amax / 6) / global)          (two fp32 divisions, each rounded)
//     d     = e4m3(scale) * global                             (fp32 product)
//     code  = NaN -> 0x7; else sign | (d == 0 ? 0 : e2m1(|x| / d))   (fp32 division)
//   so the block's largest value lands on 6 (the E2M1 maximum) up to the scale's rounding; rounding
//   the scale down makes |x| / d slightly above 6 and saturates. NVIDIA's kernels use approximate
//   reciprocals (rcp.approx) where this uses divisions: vendor-quantised tensors can differ from these
//   codes by one step in rare cases; ours are defined by exact IEEE arithmetic so the CPU and the GPU
//   agree bit for bit. A block whose scale rounds to zero (amax < 6 * 2^-10 * global, or all zeros)
//   stores scale 0 and ±0 codes. An infinity makes amax infinite: the scale saturates to 448 and the
//   infinity to ±6.
//
// MXFP4 (OCP Microscaling Formats v1.0, section 6.3 "conversion from vector of scalars"): blocks of 32
//   values, each block one E8M0 scale X:
//     value = e2m1(code) * X
//     X     = 2^(floor(log2(amax)) - emax_elem), emax_elem = 2 for E2M1 (its largest value 6 = 1.5 * 2^2),
//             the exponent clamped below at -127 (amax = 0 included: the scale's smallest value);
//     code  = sign | e2m1(|x| / X)          (exact: X is a power of two), saturating to ±6
//   The floor rule lets values up to amax / X < 8 exceed 6; they saturate, as the spec says. A block
//   holding a NaN or an infinity gets the NaN scale 0xFF (the spec: X is NaN when the block's amax is
//   not finite) and codes 0; it decodes to NaN.
//
// A row whose length is no multiple of the block is cut into whole blocks and one shorter last block,
// exactly as if it were padded with zeros (zeros change no block's amax).
#pragma once
#include <cstdint>

namespace sparrow::cpu {

inline constexpr float kE2m1Max = 6.0f;
inline constexpr int kNvfp4Block = 16;
inline constexpr int kMxfp4Block = 32;
inline constexpr uint8_t kE8m0Nan = 0xFF;

uint8_t float_to_e2m1(float x);     // the code, in the low nibble
float e2m1_to_float(uint8_t code);  // reads the low nibble
float e8m0_to_float(uint8_t code);

// The code of element i of a packed row, and the sizes of a row of n values.
inline uint8_t fp4_code(const uint8_t* packed, int64_t i) {
  return (i & 1) ? uint8_t(packed[i >> 1] >> 4) : uint8_t(packed[i >> 1] & 0x0F);
}
inline int64_t fp4_packed_bytes(int64_t n) { return (n + 1) / 2; }
inline int64_t fp4_num_blocks(int64_t n, int block) { return (n + block - 1) / block; }

// NVFP4: n values -> fp4_packed_bytes(n) code bytes and fp4_num_blocks(n, 16) E4M3 scale bytes.
// `global` must be positive and finite.
uint8_t nvfp4_block_scale(float amax, float global);
void nvfp4_quantize(const float* x, int64_t n, float global, uint8_t* packed, uint8_t* scales);
void nvfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t n, float global, float* x);

// MXFP4: n values -> fp4_packed_bytes(n) code bytes and fp4_num_blocks(n, 32) E8M0 scale bytes.
uint8_t mxfp4_block_scale(const float* x, int64_t n);  // of one block of n <= 32 values
void mxfp4_quantize(const float* x, int64_t n, uint8_t* packed, uint8_t* scales);
void mxfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t n, float* x);

}  // namespace sparrow::cpu
