// Multi-head latent attention in its absorbed form over one sequence's cached latent rows, the CPU reference
// (transformers 5.17 DeepseekV32Attention / KimiMLAAttention with W_UK folded into the query; model/mla.h
// says what the block does). kernels/cuda/mla is the GPU form and is tested against the block that calls
// this.
#pragma once
#include <cstdint>

namespace sparrow::cpu {

struct MlaShape {
  int64_t heads = 0;      // query heads
  int64_t latent = 0;     // kv_lora_rank: the width of the attended values
  int64_t row_width = 0;  // cache row: latent + the rotary dims
  float scale = 0.0f;     // softmax scale
};

// mixed[i, h] = sum_s softmax_s(q_abs[i, h] · row_s * scale) row_s[:latent] for `count` queries of one
// sequence at positions start .. start + count - 1, over each query's causal prefix or, with `selected`
// (the DSA table: topk positions per query, ascending, then -1), over the listed positions. q_abs holds
// count rows of [heads, row_width], rows [start + count, row_width], mixed count rows of [heads, latent].
void mla_attention(const MlaShape& shape, const float* q_abs, int64_t count, int64_t start, const float* rows,
                   const int32_t* selected, int64_t topk, float* mixed);

// One query's attention over n key rows (keys [n, row_width], any n >= 0), for decode context parallelism's
// share of the keys (model/context_parallel.h): mixed [heads, latent] normalised over these keys, and
// lse[h] = log sum_s exp(q_abs[h] · row_s * scale), natural log (-inf and zeros when n is 0).
void mla_attention_over(const MlaShape& shape, const float* q_abs, const float* keys, int64_t n, float* mixed,
                        float* lse);

}  // namespace sparrow::cpu
