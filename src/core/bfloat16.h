// bfloat16 <-> float32 on the host: round to nearest even (NaN stays a quiet NaN), and the exact
// widening. The one definition used by the checkpoint reader, the cache codecs and tensor conversion.
#pragma once
#include <cstdint>
#include <cstring>

namespace sparrow {

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round half to even on the dropped 16 bits
  return uint16_t(bits >> 16);
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

}  // namespace sparrow
