#include "kernels/cpu/fp4_codec.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow::cpu {

namespace {

// The E2M1 magnitude code of a >= 0 (or NaN): the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even
// code. Every midpoint (0.25, 0.75, ..., 5) is exact in fp32, so comparing against them rounds exactly;
// `<=` at a midpoint whose lower neighbour has the even code, `<` where the upper one has it.
uint8_t e2m1_magnitude(float a) {
  if (std::isnan(a)) return 7;
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;  // saturates, infinity included
}

uint8_t sign_bit(float x) { return std::signbit(x) ? 8 : 0; }

void put_code(uint8_t* packed, int64_t i, uint8_t code) {
  uint8_t& byte = packed[i >> 1];
  byte = (i & 1) ? uint8_t((byte & 0x0F) | (code << 4)) : uint8_t((byte & 0xF0) | code);
}

}  // namespace

uint8_t float_to_e2m1(float x) {
  if (std::isnan(x)) return 0x7;
  return sign_bit(x) | e2m1_magnitude(std::fabs(x));
}

float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMagnitude[code & 7];
  return (code & 8) ? -v : v;
}

float e8m0_to_float(uint8_t code) {
  return code == kE8m0Nan ? std::nanf("") : std::ldexp(1.0f, int(code) - 127);
}

uint8_t nvfp4_block_scale(float amax, float global) { return float_to_e4m3((amax / kE2m1Max) / global); }

void nvfp4_quantize(const float* x, int64_t n, float global, uint8_t* packed, uint8_t* scales) {
  SPARROW_CHECK(global > 0.0f && std::isfinite(global), "nvfp4: the second-level scale must be positive and finite, got ",
                global);
  std::fill(packed, packed + fp4_packed_bytes(n), uint8_t(0));
  for (int64_t b = 0; b * kNvfp4Block < n; ++b) {
    const int64_t begin = b * kNvfp4Block, end = std::min<int64_t>(n, begin + kNvfp4Block);
    float amax = 0.0f;
    // NaNs ignored, as fmaxf on the GPU (max.f32). Not std::fmax: glibc's follows IEEE 754-2008 maxNum,
    // which returns NaN when either input is a *signaling* NaN (bf16 bit patterns 0x7F81..0x7FBF and their
    // negatives widen to fp32 sNaNs), so the scale became 0x7F there and the GPU codes differed.
    for (int64_t i = begin; i < end; ++i)
      if (!std::isnan(x[i])) amax = std::max(amax, std::fabs(x[i]));
    scales[b] = nvfp4_block_scale(amax, global);
    const float d = e4m3_to_float(scales[b]) * global;
    for (int64_t i = begin; i < end; ++i) {
      uint8_t code;
      if (std::isnan(x[i])) code = 0x7;
      else if (d == 0.0f) code = sign_bit(x[i]);
      else code = sign_bit(x[i]) | e2m1_magnitude(std::fabs(x[i]) / d);
      put_code(packed, i, code);
    }
  }
}

void nvfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t n, float global, float* x) {
  for (int64_t i = 0; i < n; ++i)
    x[i] = (e2m1_to_float(fp4_code(packed, i)) * e4m3_to_float(scales[i / kNvfp4Block])) * global;
}

uint8_t mxfp4_block_scale(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return kE8m0Nan;
    amax = std::max(amax, std::fabs(x[i]));
  }
  // floor(log2(amax)) is amax's binary exponent (ilogb: exact, subnormals included); E2M1's emax is 2.
  const int shared = amax == 0.0f ? -127 : std::max(-127, std::ilogb(amax) - 2);
  return uint8_t(shared + 127);  // at most ilogb(FLT_MAX) - 2 + 127 = 252
}

void mxfp4_quantize(const float* x, int64_t n, uint8_t* packed, uint8_t* scales) {
  std::fill(packed, packed + fp4_packed_bytes(n), uint8_t(0));
  for (int64_t b = 0; b * kMxfp4Block < n; ++b) {
    const int64_t begin = b * kMxfp4Block, end = std::min<int64_t>(n, begin + kMxfp4Block);
    scales[b] = mxfp4_block_scale(x + begin, end - begin);
    if (scales[b] == kE8m0Nan) continue;  // codes 0; the block decodes to NaN
    const int shared = int(scales[b]) - 127;
    for (int64_t i = begin; i < end; ++i)  // |x| / 2^shared: exact (ldexp), bar underflow to values < 0.25
      put_code(packed, i, sign_bit(x[i]) | e2m1_magnitude(std::ldexp(std::fabs(x[i]), -shared)));
  }
}

void mxfp4_dequantize(const uint8_t* packed, const uint8_t* scales, int64_t n, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = e2m1_to_float(fp4_code(packed, i)) * e8m0_to_float(scales[i / kMxfp4Block]);
}

}  // namespace sparrow::cpu
