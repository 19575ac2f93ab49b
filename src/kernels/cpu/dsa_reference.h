// The DeepSeek Sparse Attention indexer's scores and top-k, the CPU reference (transformers 5.17
// DeepseekV32Indexer.forward; model/dsa_indexer.h says what the block does). kernels/cuda/dsa_indexer and
// kernels/cuda/topk are the GPU form and are tested against this.
#pragma once
#include <cstdint>
#include <vector>

namespace sparrow::cpu {

struct DsaShape {
  int64_t heads = 0;     // index_n_heads
  int64_t head_dim = 0;  // index_head_dim
  int64_t topk = 0;      // index_topk
};

// The index score of one query against n keys: scores[s] for s < n, = sum_h w[h] * relu(q[h] · k_s *
// head_dim^-0.5). `query` is one token's [heads * head_dim] roped index query, `head_weights` its [heads]
// weights (already scaled by heads^-0.5), `keys` [n, head_dim] row-major.
std::vector<float> dsa_scores(const DsaShape& shape, const float* query, const float* head_weights,
                              const float* keys, int64_t n);

// How the cache holds the keys, for rounding the queries (and MXFP4 keys) as the GPU scores them.
enum class DsaKeyRounding { None, Fp8, Mxfp4 };

// What dsa_select ranks, one piece at a time (decode context parallelism scores each rank's share of the
// keys with them, model/context_parallel.h): keys as the GPU widens them (MXFP4 keys rounded in place; the
// other roundings leave keys as they are), and one query's scores against n of them, its query rounded to
// FP8 per head first unless `rounding` is None. A key's score does not depend on the other keys.
void round_dsa_keys_like_gpu(float* keys, int64_t n, int64_t head_dim, DsaKeyRounding rounding);
std::vector<float> dsa_query_scores(const DsaShape& shape, const float* query, const float* head_weights,
                                    const float* keys, int64_t n, DsaKeyRounding rounding);

// The selected keys of `count` consecutive queries of one sequence at positions start .. start + count - 1:
// queries [heads * head_dim] and head weights [heads] are rows ld_queries / ld_weights floats apart; keys
// are the sequence's cached index keys [>= start + count, head_dim] as the cache returns them (rounded in
// place for Mxfp4). Writes selected[i * topk ...]: the key positions ascending, then -1; a query that sees
// no more than topk keys lists its causal prefix (the layout of kernels/cuda/topk's topk_rows, so both
// devices hand the attention the same table). With rounding other than None the queries are rounded to FP8
// per head first (and MXFP4 keys as the GPU widens them), so both devices select alike up to ties and the
// order of the sums. `exact_keys`, when not null, are this prefill's fp32 keys (start must be 0): the
// selection with them and the unrounded queries goes to exact_selected in the same layout (kv-quality).
void dsa_select(const DsaShape& shape, const float* queries, int64_t ld_queries, const float* head_weights,
                int64_t ld_weights, int64_t count, int64_t start, float* keys, DsaKeyRounding rounding,
                int32_t* selected, const float* exact_keys = nullptr, int32_t* exact_selected = nullptr);

}  // namespace sparrow::cpu
