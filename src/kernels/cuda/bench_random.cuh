// Deterministic pseudo-random values for filling benchmark inputs on the device (kernels/cuda/*/bench.cu):
// a 64-bit finaliser (MurmurHash3's fmix64) of the element index, so any thread can fill any element.
#pragma once
#include <cstdint>

namespace sparrow::cuda {

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

// Uniform in [-1, 1).
__device__ __forceinline__ float hash_unit(uint64_t x) { return (hash32(x) >> 8) * (2.0f / 16777216.0f) - 1.0f; }

}  // namespace sparrow::cuda
