// Simulated MoE routing for benchmarks (`--moe-routing-simulation uniform_random`, the counterpart of vLLM's
// VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random): each token's top_k experts are drawn uniformly and
// distinct, so a batch of B tokens touches E (1 - (1 - k/E)^B) experts in expectation: the routing the
// decode roofline assumes (src/bench/roofline.cpp), the same for every engine measured against it.
//
// The draw is keyed by the token's hidden state (its first kKeyValues values as bf16 bits) and a salt
// (the layer), not by a random stream: it needs no state, so CUDA graphs replay it as they are, the CPU
// and the GPU choose the same experts for the same bf16 inputs, and a token's experts do not depend on
// the rest of its batch. Shared by the CPU router (model/feed_forward.cpp) and the CUDA kernel (cuda/moe/moe.cu).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SPARROW_HOST_DEVICE __host__ __device__
#else
#define SPARROW_HOST_DEVICE
#endif

namespace sparrow::uniform_routing {

constexpr int kKeyValues = 64;  // hidden values hashed per token (fewer when the hidden size is smaller)

// splitmix64's finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", 2014).
SPARROW_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The token's key from the bf16 bits of its first values.
SPARROW_HOST_DEVICE inline uint64_t token_key(const uint16_t* bf16_bits, int64_t hidden, uint32_t salt) {
  uint64_t key = mix64(0x9e3779b97f4a7c15ull ^ salt);
  const int64_t n = hidden < kKeyValues ? hidden : kKeyValues;
  for (int64_t i = 0; i < n; i += 4) {
    uint64_t word = 0;
    for (int64_t j = 0; j < 4 && i + j < n; ++j) word |= uint64_t(bf16_bits[i + j]) << (16 * j);
    key = mix64(key ^ word);
  }
  return key;
}

// top_k distinct experts in [0, num_experts) from `key` (top_k <= num_experts), in draw order.
SPARROW_HOST_DEVICE inline void draw_experts(uint64_t key, int64_t num_experts, int64_t top_k, int32_t* experts) {
  uint64_t state = key;
  for (int64_t j = 0; j < top_k; ++j) {
    int32_t e;
    bool taken;
    do {  // redraw an expert already chosen: at most top_k - 1 of num_experts are
      state += 0x9e3779b97f4a7c15ull;
      e = int32_t(mix64(state) % uint64_t(num_experts));
      taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || experts[i] == e;
    } while (taken);
    experts[j] = e;
  }
}

}  // namespace sparrow::uniform_routing
