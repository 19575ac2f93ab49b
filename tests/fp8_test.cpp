// The CPU FP8 E4M3 codec (kernels/cpu/fp8_codec.h) against the format's definition: every code decoded,
// and encodes checked against a brute-force nearest-value search (ties to the even code).
#include "kernels/cpu/fp8_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

namespace {

using sparrow::cpu::e4m3_to_float;
using sparrow::cpu::float_to_e4m3;

// Independent decode straight from the OCP spec's formula (sign, 4-bit exponent, bias 7, 3-bit mantissa).
double spec_value(int code) {
  int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// Brute force: the nearest finite code to x (ties to the even code), saturating, NaN -> 0x7F.
uint8_t brute_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  uint8_t sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_d = 1e300;
  for (int c = 0; c <= 0x7E; ++c) {
    double d = std::fabs(spec_value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | uint8_t(best);
}

TEST(Fp8, DecodesAll256Codes) {
  for (int c = 0; c < 256; ++c) {
    float v = e4m3_to_float(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(double(v), spec_value(c)) << "code " << c;
    EXPECT_EQ(std::signbit(v), c >= 128) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
}

TEST(Fp8, RoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(c))), c) << c;
  }
}

TEST(Fp8, TiesGoToEvenAndNeighboursRoundCorrectly) {
  // Midpoints between consecutive positive codes (subnormal and normal), and the floats around them.
  for (int c = 0; c < 0x7E; ++c) {
    float lo = e4m3_to_float(uint8_t(c)), hi = e4m3_to_float(uint8_t(c + 1));
    float mid = 0.5f * (lo + hi);  // exact: lo and hi have few bits
    uint8_t even = (c & 1) == 0 ? uint8_t(c) : uint8_t(c + 1);
    EXPECT_EQ(float_to_e4m3(mid), even) << "tie between " << c << " and " << c + 1;
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | even);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 1e9f)), c + 1);
  }
}

TEST(Fp8, SaturatesSpecialsAndUnderflows) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(463.99f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);  // the tie above 448 rounds to even 448 as well
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(inf), 0x7E);
  EXPECT_EQ(float_to_e4m3(-inf), 0xFE);
  EXPECT_EQ(float_to_e4m3(-500.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_e4m3(-std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);                             // half the smallest subnormal: tie to 0
  EXPECT_EQ(float_to_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8, EncodeMatchesBruteForceOnRandomValues) {
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> log_mag(-14.0f, 10.0f);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    float x;
    if (i % 2 == 0) {
      x = std::exp2(log_mag(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    } else {
      uint32_t b = any_bits(rng);
      std::memcpy(&x, &b, 4);
    }
    ASSERT_EQ(float_to_e4m3(x), brute_encode(x)) << "x=" << x << " seed " << seed;
  }
}

}  // namespace
