// The DeepSeek Sparse Attention (DSA) "lightning indexer": for every query token it picks the cached
// key positions the main attention will look at (transformers 5.17 DeepseekV32Indexer.forward).
//
// Per token, with x the layer's normalised input and q_resid the MLA's normalised query latent
// (q_a_layernorm(q_a_proj(x))):
//   q[h]    = wq_b(q_resid) split into heads of head_dim    (h < num_heads)
//   k       = LayerNorm(wk(x))                              (weight + bias, eps 1e-6)
//   NeoX RoPE on the FIRST rope.rot_dim() dims of every q[h] and of k (the rest passes through); none
//   for Kimi K3.1 Pro, which has no RoPE anywhere
//   w[h]    = weights_proj(x)[h] * num_heads^-0.5
//   score(s) = sum_h w[h] * relu(q[h] · k_s * head_dim^-0.5)     for cached keys s <= t
// and the query attends to the `topk` highest-scoring keys (all visible keys when there are no more
// than topk of them: transformers takes the top-k over a causally masked score, so masked keys it
// picks are removed again by the attention mask).
//
// Unlike DeepSeek's own inference code, transformers computes this in fp32 without the FP8
// quantisation and Hadamard rotation; so does the CPU path. The GPU path keeps keys in FP8 as
// DeepSeek's inference code does (without the Hadamard rotation, which transformers does not have).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "kernels/cpu/dsa_reference.h"
#include "model/context_parallel.h"
#include "model/model.h"
#include "model/rope.h"

namespace sparrow {

struct DsaIndexerOptions {
  int64_t hidden = 0;       // input width of wk and weights_proj
  int64_t query_input = 0;  // input width of wq_b: the MLA's q_lora_rank
  int64_t num_heads = 0;    // index_n_heads
  int64_t head_dim = 0;     // index_head_dim
  int64_t topk = 0;         // index_topk
  std::optional<Rope> rope; // NeoX rotation of the first rope->rot_dim() dims (qk_rope_head_dim); absent: none
  float k_norm_eps = 1e-6f; // nn.LayerNorm(head_dim, eps=1e-6) in transformers
  // The indexer's cache: one key per token, head_dim floats, normalised and roped.
  PageSpec cache_page() const { return {PageKind::DsaIndexKey, head_dim}; }
};

struct DsaIndexer {
  DsaIndexerOptions options;
  Tensor wq_b;          // [num_heads * head_dim, query_input]
  Tensor wk;            // [head_dim, hidden]
  Tensor k_norm_weight; // [head_dim]
  Tensor k_norm_bias;   // [head_dim]
  Tensor weights_proj;  // [num_heads, hidden]
  // Decode context parallelism (tp.dcp_size > 1, model/context_parallel.h): this rank caches and scores every
  // dcp_size-th key, and select() returns its own local rows of the exact global top-k.
  TensorParallel tp;

  std::string prefix;  // the weights' names start with it: LoRA modules (model/lora.h)

  // prefix: "model.layers.N.self_attn.indexer." (wq_b, wk, k_norm, weights_proj).
  static std::unique_ptr<DsaIndexer> load(Checkpoint& ckpt, const std::string& prefix,
                                          const DsaIndexerOptions& options);

  // The one entry point of the selection, on either device. x: [T, hidden] (normalised layer input),
  // q_resid: [T, query_input], T = batch.size(). Writes each new token's index key to the layer's
  // DsaIndexKey pages and returns int32 [T, topk] on x's device: each row's selected key positions
  // ascending, then -1; a row that sees no more than topk keys lists its causal prefix.
  //   CPU: cpu::dsa_select (kernels/cpu/dsa_reference.h) over the sequence's cached keys, fp32 as
  //        transformers, with the queries rounded as the GPU rounds them when the keys are quantised.
  //   GPU: kernels/cuda/dsa_indexer and kernels/cuda/topk. Keys are stored in the cache's index-key format
  //        (FP8 with a scale per token, DeepSeek-V3.2's own index cache; MXFP4; NVFP4) and scored against
  //        queries quantised to FP8 per (token, head) (kernels/cuda/dsa_indexer/fp4_keys.cuh says how each
  //        format is multiplied), so the selection can differ from the CPU's where scores nearly tie.
  Tensor select(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer) const;

  // Token-sharded prefill (model/context_parallel.h): writes every row's key like select(), and returns the
  // selection of only the rows of `pieces` (CPU), int32 [their rows, topk] in piece order.
  Tensor select_pieces(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer,
                       const std::vector<RowPiece>& pieces) const;

  cpu::DsaShape shape() const { return {options.num_heads, options.head_dim, options.topk}; }

 private:
  // What both selections start from, on x's device: roped queries [T, heads * head_dim], normalised and
  // roped keys [T, head_dim], head weights [T, heads] (fp32) scaled by num_heads^-0.5.
  struct Projection {
    Tensor queries, keys, head_weights;
  };
  Projection project(const Tensor& x, const Tensor& q_resid, const Batch& batch) const;
  // select() under decode context parallelism (CPU): int32 [T, topk] of this rank's local rows.
  Tensor select_context_parallel(const Projection& p, const Batch& batch, int layer) const;
};

}  // namespace sparrow
