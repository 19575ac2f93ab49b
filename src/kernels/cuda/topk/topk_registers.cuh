// The register-resident radix select (topk_registers.cu says how it works); topk.cu dispatches to it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda::topk_registers {

inline constexpr int kThreads = 512;
inline constexpr int kMaxPerThread = 32;                      // scores a thread holds in registers
inline constexpr int kMaxSlice = kThreads * kMaxPerThread;    // scores a CTA holds: 16384
inline constexpr int kMaxCluster = 8;                         // CTAs a row (the portable cluster size)

struct Plan {
  int cluster = 1;     // CTAs per row
  int per_thread = 4;  // scores a thread holds: 4, 8, 16 or 32
  int slice = 0;       // scores a CTA owns, a multiple of 4
};
Plan make_plan(int64_t rows, int64_t max_len);

// Rows of up to kMaxCluster * kMaxSlice (131,072) scores, any k; no workspace.
bool supports(int64_t max_len);
void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, cudaStream_t stream);

}  // namespace sparrow::cuda::topk_registers
