// The CPU number codecs (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h) against the committed vectors of
// tools/make_quant_vectors.py (an independent implementation from the specifications), bit for bit, and
// their round trips. fp8_test.cpp checks E4M3 further against a brute-force search.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "quant_vectors.h"

using namespace sparrow;
using namespace sparrow::cpu;
using sparrow::testing::bits_of_float;
using sparrow::testing::same_float;

namespace {

const sparrow::testing::QuantVectors& vectors() {
  static const sparrow::testing::QuantVectors v = sparrow::testing::load_quant_vectors();
  return v;
}

std::string hex(float x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g (0x%08x)", double(x), bits_of_float(x));
  return buffer;
}

}  // namespace

TEST(QuantVectors, AreThereAndCoverTheSpecialCases) {
  const auto& v = vectors();
  EXPECT_GT(v.e4m3.size(), 300u);
  EXPECT_GT(v.e2m1.size(), 40u);
  EXPECT_GT(v.nvfp4.size(), 10u);
  EXPECT_GT(v.mxfp4.size(), 10u);
  bool nan = false, inf = false, negative_zero = false, subnormal = false;
  for (const auto& c : v.e4m3) {
    nan |= std::isnan(c.x);
    inf |= std::isinf(c.x);
    negative_zero |= c.x == 0.0f && std::signbit(c.x);
    subnormal |= std::fpclassify(c.x) == FP_SUBNORMAL;
  }
  EXPECT_TRUE(nan && inf && negative_zero && subnormal);
}

TEST(QuantCodecs, E4m3MatchesTheVectors) {
  for (const auto& c : vectors().e4m3) EXPECT_EQ(int(float_to_e4m3(c.x)), int(c.code)) << hex(c.x);
}

TEST(QuantCodecs, E2m1MatchesTheVectorsAndDecodesEveryCode) {
  for (const auto& c : vectors().e2m1) EXPECT_EQ(int(float_to_e2m1(c.x)), int(c.code)) << hex(c.x);
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    const float v = e2m1_to_float(uint8_t(code));
    EXPECT_EQ(std::fabs(v), magnitudes[code & 7]) << code;
    EXPECT_EQ(std::signbit(v), code >= 8) << code;
    EXPECT_EQ(int(float_to_e2m1(v)), code) << code;  // every code round-trips, -0 included
  }
}

TEST(QuantCodecs, E8m0DecodesEveryCode) {
  for (int code = 0; code < 255; ++code) EXPECT_EQ(double(e8m0_to_float(uint8_t(code))), std::ldexp(1.0, code - 127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xFF)));
}

TEST(QuantCodecs, Nvfp4MatchesTheVectors) {
  for (const auto& c : vectors().nvfp4) {
    SCOPED_TRACE(c.name);
    const int64_t n = int64_t(c.x.size());
    std::vector<uint8_t> packed(fp4_packed_bytes(n), 0xAA), scales(fp4_num_blocks(n, kNvfp4Block), 0xAA);
    nvfp4_quantize(c.x.data(), n, c.global, packed.data(), scales.data());
    EXPECT_EQ(scales, c.scales);
    EXPECT_EQ(packed, c.packed);
    std::vector<float> back(n);
    nvfp4_dequantize(c.packed.data(), c.scales.data(), n, c.global, back.data());
    for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(same_float(back[i], c.decoded[i])) << i << ": " << hex(back[i]);
  }
}

TEST(QuantCodecs, Mxfp4MatchesTheVectors) {
  for (const auto& c : vectors().mxfp4) {
    SCOPED_TRACE(c.name);
    const int64_t n = int64_t(c.x.size());
    std::vector<uint8_t> packed(fp4_packed_bytes(n), 0xAA), scales(fp4_num_blocks(n, kMxfp4Block), 0xAA);
    mxfp4_quantize(c.x.data(), n, packed.data(), scales.data());
    EXPECT_EQ(scales, c.scales);
    EXPECT_EQ(packed, c.packed);
    std::vector<float> back(n);
    mxfp4_dequantize(c.packed.data(), c.scales.data(), n, back.data());
    for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(same_float(back[i], c.decoded[i])) << i << ": " << hex(back[i]);
  }
}

// The block rules on their own: NVIDIA's recipe puts the largest value of a block on 6, and MX's floor
// rule gives the largest value an E2M1 magnitude of 4 or 6.
TEST(QuantCodecs, BlockScalesFollowTheirRecipes) {
  EXPECT_EQ(e4m3_to_float(nvfp4_block_scale(6.0f, 1.0f)), 1.0f);
  EXPECT_EQ(e4m3_to_float(nvfp4_block_scale(2688.0f, 1.0f)), 448.0f);
  EXPECT_EQ(e4m3_to_float(nvfp4_block_scale(1e30f, 1.0f)), 448.0f);                      // saturates
  EXPECT_EQ(e4m3_to_float(nvfp4_block_scale(3.0f, 0.5f)), 1.0f);                         // (3 / 6) / 0.5
  EXPECT_EQ(nvfp4_block_scale(0.0f, 1.0f), 0);
  const float six[1] = {6.0f}, seven[1] = {7.99f}, eight[1] = {8.0f}, zero[1] = {0.0f}, tiny[1] = {1e-45f};
  EXPECT_EQ(e8m0_to_float(mxfp4_block_scale(six, 1)), 1.0f);    // 2^(2 - 2)
  EXPECT_EQ(e8m0_to_float(mxfp4_block_scale(seven, 1)), 1.0f);  // saturates to 6, the floor rule
  EXPECT_EQ(e8m0_to_float(mxfp4_block_scale(eight, 1)), 2.0f);
  EXPECT_EQ(mxfp4_block_scale(zero, 1), 0);
  EXPECT_EQ(mxfp4_block_scale(tiny, 1), 0);
  const float inf[2] = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_EQ(mxfp4_block_scale(inf, 2), kE8m0Nan);
  std::vector<float> x(16, 1.0f);
  std::vector<uint8_t> packed(8), scales(1);
  EXPECT_THROW(nvfp4_quantize(x.data(), 16, 0.0f, packed.data(), scales.data()), Error);
  EXPECT_THROW(nvfp4_quantize(x.data(), 16, std::nanf(""), packed.data(), scales.data()), Error);
}

// Decoded values quantise back to the same bytes, and the error stays within half a step of the
// block's grid (saturation of a rounded-down NVFP4 scale adds at most one e4m3 rounding).
TEST(QuantCodecs, RoundTripsAndBoundsTheError) {
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = 1 + rng() % 200;
    std::vector<float> x(n);
    const float magnitude = std::ldexp(1.0f, exponent(rng));
    for (float& v : x) v = normal(rng) * magnitude;
    {
      std::vector<uint8_t> p(fp4_packed_bytes(n)), s(fp4_num_blocks(n, kMxfp4Block)), p2(p.size()), s2(s.size());
      std::vector<float> y(n);
      mxfp4_quantize(x.data(), n, p.data(), s.data());
      mxfp4_dequantize(p.data(), s.data(), n, y.data());
      mxfp4_quantize(y.data(), n, p2.data(), s2.data());
      ASSERT_EQ(p, p2) << "mxfp4 seed " << seed;
      ASSERT_EQ(s, s2) << "mxfp4 seed " << seed;
      for (int64_t i = 0; i < n; ++i) {
        const float X = e8m0_to_float(s[i / kMxfp4Block]);
        // Half the largest grid step (2 * X, between 4X and 6X) inside, or up to 2X above 6X (saturation).
        ASSERT_LE(std::fabs(y[i] - x[i]), 2.0f * X * 1.000001f) << "seed " << seed << " value " << x[i];
      }
    }
    const float global = trial % 3 == 0 ? 1.0f : std::ldexp(1.0f, exponent(rng) / 2);
    {
      std::vector<uint8_t> p(fp4_packed_bytes(n)), s(fp4_num_blocks(n, kNvfp4Block)), p2(p.size()), s2(s.size());
      std::vector<float> y(n);
      nvfp4_quantize(x.data(), n, global, p.data(), s.data());
      nvfp4_dequantize(p.data(), s.data(), n, global, y.data());
      for (int64_t i = 0; i < n; ++i) {
        // Inside [0, 6 step] half a grid step is at most one step; beyond it the value saturates to 6 step.
        // A normal E4M3 scale below the largest is within 1/16 of amax / 6 (not saturated), so its block
        // never goes beyond 6 step by more than a step.
        const uint8_t scale = s[i / kNvfp4Block];
        const float step = e4m3_to_float(scale) * global, error = std::fabs(y[i] - x[i]);
        const bool rounded = (scale & 0x78) != 0 && scale != 0x7E;
        const float bound = rounded ? step : std::max(step, std::fabs(x[i]) - 6.0f * step);
        ASSERT_LE(error, bound * 1.000001f) << "nvfp4 seed " << seed << " value " << x[i] << " global " << global;
      }
      // Blocks with normal E4M3 scales re-quantise to the same bytes (their largest code is 4 or 6).
      bool normal_scales = true;
      for (uint8_t code : s) normal_scales &= (code & 0x78) != 0;
      if (normal_scales) {
        nvfp4_quantize(y.data(), n, global, p2.data(), s2.data());
        ASSERT_EQ(p, p2) << "nvfp4 seed " << seed;
        ASSERT_EQ(s, s2) << "nvfp4 seed " << seed;
      }
    }
  }
}
