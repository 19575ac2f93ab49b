// Grouped-query attention of one sequence over its cached K/V rows, the CPU reference (transformers 5.17
// MiniMaxM3VLAttention's eager path; model/gqa_mixer.h says what the block does). kernels/cuda/gqa is the
// GPU form and is tested against the block that calls this.
#pragma once
#include <cstdint>

namespace sparrow::cpu {

struct GqaShape {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;  // query head h reads kv head h / (heads / kv_heads)
  float scale = 0.0f;                             // softmax scale
  int64_t sliding_window = 0;  // > 0: the query at position q sees keys from q - (sliding_window - 1) on
  bool non_causal = false;     // every query sees all `count` new rows (the DSpark drafter's block)
};

// MSA's restriction of the keys: query head h of index group g = h / (heads / index_heads) sees the keys of
// the blocks listed in kept[(i * index_heads + g) * topk_blocks ...] (ascending or not, -1 after them;
// kernels/cpu/msa_reference.h msa_select writes it).
struct GqaKeptBlocks {
  const int32_t* kept = nullptr;
  int64_t index_heads = 0, topk_blocks = 0, block_size = 0;
};

// Causal attention of `count` new queries of one sequence, at positions start .. start + count - 1 (rows of
// q, ld_q floats apart, [heads, head_dim] each), against the sequence's cached rows kv [start + count,
// 2 * kv_heads * head_dim] ([K of kv heads | V of kv heads]). With `blocks` (kept not null) each query sees
// only the kept blocks' keys; shape.sliding_window and shape.non_causal move the first and last key a query
// sees (not with blocks). Writes rows of out (ld_out floats apart, [heads, head_dim] each).
void gqa_attention(const GqaShape& shape, const float* q, int64_t ld_q, int64_t count, int64_t start,
                   const float* kv, const GqaKeptBlocks& blocks, float* out, int64_t ld_out);

}  // namespace sparrow::cpu
