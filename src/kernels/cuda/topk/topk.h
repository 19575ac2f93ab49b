// Exact top-k over rows of fp32 scores (the DSA indexer's selection), by radix select on the float
// bits: no sort. Per row: the k largest of the first lengths[row] scores, ties to the smaller index, NaN
// ranking below everything (as cpu::top_k in kernels/cpu/reference_ops.h); the k indices are written sorted
// ascending. A row with lengths[row] <= k yields 0 .. len-1 followed by -1 up to k.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sparrow::cuda {

// Four exact implementations (topk.cu, topk_sampled.cu and topk_registers.cu say how each works); Auto
// picks the fastest for the size, and tests run each on every case. SampledThreshold takes rows of up to
// 1M scores, RegisterRadix rows of up to 128K.
enum class TopkMethod { Auto, RadixPasses, StreamingFilter, SampledThreshold, RegisterRadix };
inline constexpr int kTopkStreamingMaxK = 4096;  // StreamingFilter takes k up to this

// Device scratch the launch needs for rows x max_len (0 when every row fits one CTA).
size_t topk_workspace_bytes(int64_t rows, int64_t max_len, int k, TopkMethod method = TopkMethod::Auto);

// scores: [rows, ld] fp32; lengths: [rows] int32 (device), each <= max_len (host bound, <= ld);
// out: [rows, k] int32. workspace: at least topk_workspace_bytes(rows, max_len, k, method) bytes of
// device memory (any contents; the launch clears what it uses). With Auto and max_len <= k the scores are
// not read (every row keeps all its indices), so they may be null.
void topk_rows(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
               int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
               TopkMethod method = TopkMethod::Auto);

}  // namespace sparrow::cuda
