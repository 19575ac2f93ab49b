// The sampled-threshold top-k (topk_sampled.cu says how it works); topk.cu dispatches to it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda::topk_sampled {

inline constexpr int kMaxSlice = 131072;  // scores a CTA owns (its bitmaps: 2 x 16 KiB)
inline constexpr int kMaxCluster = 8;     // CTAs a row (the portable cluster size)

struct Plan {
  int cluster = 1;  // CTAs per row
  int slice = 0;    // scores per CTA
};
Plan make_plan(int64_t rows, int64_t max_len);

// Rows up to kMaxCluster * kMaxSlice scores, any k; no workspace.
bool supports(int64_t max_len);
void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, cudaStream_t stream);

}  // namespace sparrow::cuda::topk_sampled
