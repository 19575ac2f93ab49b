// MiniMax-M3's MSA block selector (transformers 5.17 MiniMaxM3VLIndexer and build_block_mask).
//
// A small dot-product branch picks, for every query, which blocks of `block_size` consecutive keys the
// main attention may look at:
//   index query  q_g = rope(rmsnorm_g(Wq_g x))   one per index head g (index_n_heads of them)
//   index key    k_s = rope(rmsnorm(Wk x_s))      one per token, shared by all index heads
//   block score  B_g[b] = max over visible keys s of block b of q_g · k_s    (raw dot, no scale)
// The index_local_blocks newest blocks (the query's own block and the ones just before it) are always
// kept; the remaining slots of index_topk_blocks go to the best-scoring older blocks. Every query head
// of index group g (query heads g*H/H_idx ... (g+1)*H/H_idx - 1) attends exactly the keys of the kept
// blocks that are not in its future.
//
// Details as transformers does them:
//   * Norms are Gemma-style (x̂ · (1 + w)) over index_head_dim, per index head; RoPE is the main
//     attention's partial NeoX rotation (its first rotary dims), applied to the index q and k.
//   * A key is visible to the query at position t when its position s <= t. Only the query's own block
//     can be partially visible; its score is the max over the visible keys, and it is forced anyway
//     unless index_local_blocks is 0.
//   * Forced blocks are newest - l for l < index_local_blocks, clamped at block 0 (so early queries
//     force fewer distinct blocks).
//   * A query at block `newest` sees newest + 1 blocks; when that is at most index_topk_blocks, all of
//     them are kept. Ties between scores go to the smaller block id (torch.topk leaves them unspecified).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/rope.h"

namespace sparrow {

// The selection rule for one query and one index head. `block_scores` holds the scores of the blocks
// the query sees (blocks 0 .. position / block_size); returns the kept block ids, forced blocks first,
// then by descending score. Forced: the `local_blocks` newest and the first `init_blocks`
// (sparse_init_block; 0 in every release). vLLM scores init blocks 1e30 and local ones 1e29
// (vllm/models/minimax_m3/common/indexer.py); here both are +inf and ties go to the smaller block id,
// which ranks init blocks first the same way.
std::vector<int32_t> select_blocks(std::vector<float> block_scores, int64_t position, int64_t block_size,
                                   int64_t topk_blocks, int64_t local_blocks, int64_t init_blocks = 0);

// Which blocks each (index head, query) keeps: keep[(head * queries + i) * blocks + b].
struct BlockSelection {
  int64_t heads = 0, queries = 0, blocks = 0;
  std::vector<uint8_t> keep;
  bool kept(int64_t head, int64_t query, int64_t block) const {
    return keep[(head * queries + query) * blocks + block] != 0;
  }
};

struct MsaIndexer {
  int64_t heads = 0;         // index_n_heads: one selection per head
  int64_t head_dim = 0;      // index_head_dim
  int64_t block_size = 0;    // index_block_size keys per block
  int64_t topk_blocks = 0;   // index_topk_blocks kept per query, forced ones included
  int64_t local_blocks = 0;  // index_local_blocks newest blocks always kept
  int64_t init_blocks = 0;   // sparse_init_block first blocks always kept
  float norm_eps = 1e-6f;
  Tensor q_proj;  // [heads * head_dim, hidden]
  Tensor k_proj;  // [head_dim, hidden]
  Tensor q_norm;  // [head_dim]
  Tensor k_norm;  // [head_dim]

  // Index queries [T, heads * head_dim] and keys [T, head_dim] for the batch rows x [T, hidden] at
  // `positions`: projected, normalised and rotated by the first rope.rot_dim() dims, or whole when
  // head_dim < rope.rot_dim() (transformers' cos[..., :index_head_dim]).
  void project(const Tensor& x, const Tensor& positions, const Rope& rope, Tensor& queries,
               Tensor& keys) const;

  // The blocks kept by `count` consecutive queries of one sequence at positions start .. start+count-1,
  // given their index queries (rows of `queries`, `ld_queries` floats apart) and the sequence's index
  // keys [n_keys, head_dim], n_keys >= start + count (later keys are never looked at).
  BlockSelection select(const float* queries, int64_t ld_queries, int64_t count, int64_t start, const float* keys,
                        int64_t n_keys) const;
};

}  // namespace sparrow
