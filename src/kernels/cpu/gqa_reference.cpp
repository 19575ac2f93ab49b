#include "kernels/cpu/gqa_reference.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

void gqa_attention(const GqaShape& shape, const float* q, int64_t ld_q, int64_t count, int64_t start,
                   const float* kv, const GqaKeptBlocks& blocks, float* out, int64_t ld_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const int64_t group = heads / kv_heads;  // query heads reading one kv head, adjacent in a query row
  const int64_t kv_row = 2 * kv_heads * head_dim;
  std::vector<float> probs;
  std::vector<uint8_t> kept_block;
  // One query row at a time, every product shaped by that row alone ([group heads] x [its visible keys]):
  // a row's arithmetic is then the same whatever rows share its step (chunked prefill, batching), as
  // mla_attention does (batch invariance, tests/batch_invariance_test.cpp).
  for (int64_t i = 0; i < count; ++i) {
    const int64_t position = start + i;
    const int64_t first = shape.sliding_window > 0 ? std::max<int64_t>(0, position - (shape.sliding_window - 1)) : 0;
    const int64_t last = shape.non_causal ? start + count - 1 : position;
    const int64_t seen = last + 1 - first;  // keys first .. last
    probs.resize(group * seen);
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      const float* keys = kv + first * kv_row + kv_head * head_dim;
      const float* values = keys + kv_heads * head_dim;
      const float* queries = q + i * ld_q + kv_head * group * head_dim;
      gemm_nt(group, seen, head_dim, queries, head_dim, keys, kv_row, probs.data(), seen);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv_head * group + g;
        float* row = probs.data() + g * seen;
        if (blocks.kept) {
          // build_block_mask repeats each index head's selection over heads / index_n_heads query heads.
          const int64_t index_head = h / (heads / blocks.index_heads);
          kept_block.assign(position / blocks.block_size + 1, 0);
          const int32_t* list = blocks.kept + (i * blocks.index_heads + index_head) * blocks.topk_blocks;
          for (int64_t j = 0; j < blocks.topk_blocks && list[j] >= 0; ++j)
            if (list[j] < int64_t(kept_block.size())) kept_block[list[j]] = 1;
        }
        for (int64_t s = 0; s < seen; ++s)
          row[s] = !blocks.kept || kept_block[(first + s) / blocks.block_size] ? row[s] * shape.scale : neg_inf;
        softmax_inplace(row, seen);
      }
      gemm_nn(group, head_dim, seen, probs.data(), seen, values, kv_row, out + i * ld_out + kv_head * group * head_dim,
              head_dim);
    }
  }
}

}  // namespace sparrow::cpu
