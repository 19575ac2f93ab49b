#include "kernels/cpu/fp8_codec.h"

#include <cmath>

namespace sparrow::cpu {

// Layout (OCP 8-bit floating point spec, E4M3): s eeee mmm, bias 7. exponent 0 holds the subnormals
// m * 2^-9; exponent 15 with mantissa 7 is NaN, so the largest finite value is 1.75 * 2^8 = 448.
uint8_t float_to_e4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  // Every value >= 448 rounds (or saturates, with SATFINITE) to the largest finite code.
  if (a >= kE4m3Max) return sign | 0x7E;
  // Subnormal range (below 2^-6): the code is round(a / 2^-9); scaling by a power of two is exact and
  // nearbyint rounds half to even under the default rounding mode. A result of 8 is the smallest
  // normal, whose code is 8 as well.
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  int e = std::ilogb(a);  // a in [2^e, 2^(e+1)), e in [-6, 8]
  // 1.mmm with three fraction bits: round(a / 2^(e-3)) is in [8, 16]; 16 carries into the exponent.
  int q = int(std::nearbyint(std::ldexp(a, 3 - e)));
  if (q == 16) {
    q = 8;
    ++e;
  }
  return sign | uint8_t(((e + 7) << 3) | (q - 8));
}

float e4m3_to_float(uint8_t code) {
  const int exp = (code >> 3) & 0xF, man = code & 7;
  float v;
  if (exp == 15 && man == 7) {
    v = std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(float(man), -9);
  } else {
    v = std::ldexp(float(8 + man), exp - 10);  // (1 + m/8) * 2^(exp-7)
  }
  return (code & 0x80) ? -v : v;
}

}  // namespace sparrow::cpu
