#include "kernels/cpu/gqa_reference.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

namespace {
// Queries per BLAS call: bounds the [tile, n_keys] score buffer on long prefills.
constexpr int64_t kQueryTile = 256;
}  // namespace

void gqa_attention(const GqaShape& shape, const float* q, int64_t ld_q, int64_t count, int64_t start,
                   const float* kv, const GqaKeptBlocks& blocks, float* out, int64_t ld_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, head_dim = shape.head_dim;
  const int64_t kv_row = 2 * kv_heads * head_dim;
  std::vector<float> probs;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kv_head = h / (heads / kv_heads);
    // build_block_mask repeats each index head's selection over heads / index_n_heads query heads.
    const int64_t index_head = blocks.kept ? h / (heads / blocks.index_heads) : 0;
    const float* keys = kv + kv_head * head_dim;
    const float* values = keys + kv_heads * head_dim;
    for (int64_t i0 = 0; i0 < count; i0 += kQueryTile) {
      const int64_t i1 = std::min(count, i0 + kQueryTile);
      const int64_t seen = start + i1;  // keys visible to the tile's last query
      probs.resize((i1 - i0) * seen);
      gemm_nt(i1 - i0, seen, head_dim, q + i0 * ld_q + h * head_dim, ld_q, keys, kv_row, probs.data(), seen);
      parallel_for(i1 - i0, [&](int64_t b, int64_t e) {
        std::vector<uint8_t> kept_block;
        for (int64_t r = b; r < e; ++r) {
          const int64_t i = i0 + r, position = start + i;
          if (blocks.kept) {
            kept_block.assign(position / blocks.block_size + 1, 0);
            const int32_t* list = blocks.kept + (i * blocks.index_heads + index_head) * blocks.topk_blocks;
            for (int64_t j = 0; j < blocks.topk_blocks && list[j] >= 0; ++j)
              if (list[j] < int64_t(kept_block.size())) kept_block[list[j]] = 1;
          }
          float* row = probs.data() + r * seen;
          for (int64_t s = 0; s < seen; ++s) {
            const bool visible = s <= position && (!blocks.kept || kept_block[s / blocks.block_size]);
            row[s] = visible ? row[s] * shape.scale : neg_inf;
          }
          softmax_inplace(row, seen);
        }
      });
      gemm_nn(i1 - i0, head_dim, seen, probs.data(), seen, values, kv_row, out + i0 * ld_out + h * head_dim, ld_out);
    }
  }
}

}  // namespace sparrow::cpu
