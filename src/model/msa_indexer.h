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
#include "kernels/cpu/msa_reference.h"
#include "model/model.h"
#include "model/rope.h"

namespace sparrow {

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
  // Tensor parallel: `heads` are this rank's index heads, first_head .. of all_heads (grouped_share over
  // query_heads, model/tensor_parallel.h). With tp.indexer_decode_cp (the second seed article's "indexer
  // DCP"), select() splits the scoring by key block instead: the group all-gathers its index queries, rank r
  // scores every index head over the blocks b with b mod size = r (a quarter of the index cache's reads at
  // TP 4 where each rank read all of it for its own heads), and sends each head's local best topk_blocks to
  // the ranks that own the head, which merge them into the exact selection (forced blocks included: they
  // score +inf wherever they live).
  TensorParallel tp;
  int64_t all_heads = 0, first_head = 0, query_heads = 0;

  std::string prefix;  // the weights' names start with it ("model.layers.N.self_attn.indexer."): LoRA

  // Index queries [T, heads * head_dim] and keys [T, head_dim] for the batch rows x [T, hidden] at their
  // positions: projected (with the batch's adapters' terms), normalised and rotated by the first
  // rope.rot_dim() dims, or whole when head_dim < rope.rot_dim() (transformers' cos[..., :index_head_dim]).
  void project(const Tensor& x, const Batch& batch, const Rope& rope, Tensor& queries, Tensor& keys) const;

  // The one entry point of the selection, on either device: writes this step's index keys (rows of `keys`)
  // into the layer's MsaIndexKey pages and returns the kept blocks of every batch row, int32 [T, heads,
  // topk_blocks] on the keys' device: ascending block ids, then -1. The CPU runs cpu::msa_select over the
  // sequence's cached keys (kernels/cpu/msa_reference.h); the GPU runs msa_select_blocks on the paged keys in
  // place (kernels/cuda/msa/msa.h), which writes the same table.
  Tensor select(const Tensor& queries, const Tensor& keys, const Batch& batch, int layer) const;

  // select() under indexer decode context parallelism (CPU), after this step's keys are written.
  Tensor select_context_parallel(const Tensor& queries, const Batch& batch, int layer) const;

  cpu::MsaSelectShape shape() const {
    return {heads, head_dim, block_size, topk_blocks, local_blocks, init_blocks};
  }
};

}  // namespace sparrow
