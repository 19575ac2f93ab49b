// What the top-k methods (topk.cu, topk_sampled.cu, topk_registers.cu) share.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda::topk_keys {

// A score's 32-bit key, whose unsigned order is the float order: all bits of a negative flipped, the sign
// bit of a positive set; -0 counts as +0, and NaN becomes 0 and ranks below -inf (topk.h's tie rules).
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN: below -inf
  if (b == 0x80000000u) b = 0u;                   // -0 ties with +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The largest power of two <= v (v >= 1): cluster sizes.
inline int floor_pow2(int64_t v) {
  int p = 1;
  while (int64_t(p) * 2 <= v) p *= 2;
  return p;
}

}  // namespace sparrow::cuda::topk_keys
