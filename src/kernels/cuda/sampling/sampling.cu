// Greedy choice on the GPU: one block per row scans the vocabulary, then a block reduction. The order
// is cpu::top_k's (what the CPU sampler's argmax uses): larger value first, NaN last, ties to the
// smaller id. That order is total, so the reduction gives the same id whatever the split.
#include "kernels/cuda/sampling/sampling.h"

#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {

namespace {

__device__ __forceinline__ bool better(float va, int32_t ia, float vb, int32_t ib) {
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

constexpr int kThreads = 1024;

__global__ void argmax_kernel(const float* logits, int64_t vocab, int32_t* ids) {
  const float* row = logits + int64_t(blockIdx.x) * vocab;
  float best = __int_as_float(0x7fc00000);  // NaN: loses to any number
  int32_t best_id = 0x7fffffff;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float x = row[v];
    if (better(x, int32_t(v), best, best_id)) {
      best = x;
      best_id = int32_t(v);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (better(ov, oi, best, best_id)) {
      best = ov;
      best_id = oi;
    }
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int32_t si[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (better(sv[w], si[w], best, best_id)) {
        best = sv[w];
        best_id = si[w];
      }
    ids[blockIdx.x] = best_id;
  }
}

}  // namespace

void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && vocab > 0 && vocab <= 0x7fffffff, "argmax_rows: bad sizes rows=", rows,
                " vocab=", vocab);
  SPARROW_CHECK(rows <= 0x7fffffff, "argmax_rows: too many rows");
  if (rows == 0) return;
  argmax_kernel<<<unsigned(rows), kThreads, 0, stream>>>(logits, vocab, ids);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
