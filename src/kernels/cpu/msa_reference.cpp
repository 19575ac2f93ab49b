#include "kernels/cpu/msa_reference.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
}  // namespace

std::vector<int32_t> select_blocks(std::vector<float> block_scores, int64_t position, int64_t block_size,
                                   int64_t topk_blocks, int64_t local_blocks, int64_t init_blocks) {
  const int64_t newest = position / block_size;
  const int64_t visible = int64_t(block_scores.size());
  SPARROW_CHECK(visible == newest + 1, "select_blocks: ", visible, " block scores for a query in block ", newest);
  // MiniMaxM3VLIndexer.forward: the local (and init) blocks get +inf so top-k always takes them.
  for (int64_t b = 0; b < visible; ++b)
    if (msa_block_forced(b, newest, local_blocks, init_blocks)) block_scores[b] = kInf;
  std::vector<int32_t> chosen = top_k(block_scores.data(), visible, topk_blocks);
  // A block whose score is -inf has no visible key (transformers marks such slots -1).
  std::erase_if(chosen, [&](int32_t b) { return block_scores[b] == -kInf; });
  return chosen;
}

void msa_block_scores(int64_t heads, int64_t head_dim, const float* query, const float* keys, int64_t n,
                      const std::vector<int64_t>& starts, float* scores) {
  const int64_t blocks = int64_t(starts.size());
  std::vector<float> products(heads * n);
  if (n > 0) gemm_nt(heads, n, head_dim, query, head_dim, keys, head_dim, products.data(), n);
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t end = j + 1 < blocks ? starts[j + 1] : n;
      float best = -kInf;
      for (int64_t s = starts[j]; s < end; ++s) best = std::max(best, products[g * n + s]);
      scores[g * blocks + j] = best;
    }
}

void msa_select(const MsaSelectShape& shape, const float* queries, int64_t ld_queries, int64_t count, int64_t start,
                const float* keys, int32_t* kept) {
  const int64_t heads = shape.heads, dim = shape.head_dim, block_size = shape.block_size, k = shape.topk_blocks;
  std::fill(kept, kept + count * heads * k, -1);
  std::vector<float> scores;
  // One query row at a time, its product shaped by the row alone ([index heads] x [its visible keys]), so
  // the selection is the same whatever rows share the step (batch invariance, as gqa_attention).
  for (int64_t i = 0; i < count; ++i) {
    const int64_t position = start + i, seen = position + 1;
    scores.resize(heads * seen);
    // scores[g][s] = q_g(i) · k(s), fp32 like transformers' matmul of float() copies.
    gemm_nt(heads, seen, dim, queries + i * ld_queries, dim, keys, dim, scores.data(), seen);
    parallel_for(heads, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const float* row = scores.data() + g * seen;
        // Max-pool each block over its keys.
        std::vector<float> block_scores(position / block_size + 1, -kInf);
        for (int64_t s = 0; s < seen; ++s)
          block_scores[s / block_size] = std::max(block_scores[s / block_size], row[s]);
        std::vector<int32_t> chosen = select_blocks(std::move(block_scores), position, block_size, k,
                                                    shape.local_blocks, shape.init_blocks);
        std::sort(chosen.begin(), chosen.end());
        std::copy(chosen.begin(), chosen.end(), kept + (i * heads + g) * k);
      }
    });
  }
}

}  // namespace sparrow::cpu
