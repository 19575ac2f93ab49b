// Token choice on the GPU for the common cases (greedy, and temperature / top-k / top-p with a seeded
// generator): only the chosen ids cross to the host. logits fp32 [rows, vocab].
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

// ids[r] = argmax_v logits[r, v] (ties to the smaller id, as the CPU sampler).
void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, cudaStream_t stream);

}  // namespace sparrow::cuda
