// How the blocks split their heads and widths across a tensor-parallel group (docs/parallel.md), as vLLM's
// TP does (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py): the column-parallel
// projections of a block keep the rows of this rank's heads, its row-parallel output projection the matching
// columns, and the block sums its output over the group once (ops::all_reduce_). Widths that are not split
// (a latent, an index key, a router) are replicated.
#pragma once
#include <cstdint>

#include "core/communicator.h"
#include "formats/checkpoint.h"

namespace sparrow {

// [begin, end) of a run of heads (or experts, or vocabulary rows).
struct IndexRange {
  int64_t begin = 0, end = 0;
  int64_t count() const { return end - begin; }
  // The split taking these items, `width` rows or columns each, along `dim` of a stored tensor.
  Split split(int dim, int64_t width = 1, int64_t chunks = 1) const { return {dim, begin * width, end * width, chunks}; }
};

// The split taking `range` (width rows or columns per item) along `dim`; the whole tensor unsharded, so that
// an unsharded load reads weights exactly as before.
inline Split split_for(const TensorParallel& tp, const IndexRange& range, int dim, int64_t width = 1) {
  return tp.sharded() ? range.split(dim, width) : Split{};
}

// This rank's equal share of `n` (query heads, an MLP's intermediate width); a one-line error naming `what`
// and the config field when size does not divide n.
IndexRange even_share(const TensorParallel& tp, int64_t n, const char* what);  // [0, n) unsharded

// This rank's whole experts under expert parallelism, as vLLM deals them (fused_moe/layer.py
// determine_expert_map): E / size each, the first E % size ranks one more.
IndexRange expert_share(const TensorParallel& tp, int64_t num_experts);

// Grouped heads (GQA's kv heads, MSA's index heads): `groups` of them serve `heads` query heads,
// heads / groups each. The ones this rank's query heads read: its equal share when the group size divides
// `groups`, else the single group all its query heads sit in (replicated on the ranks that share it, as
// vLLM replicates kv heads when TP exceeds them).
IndexRange grouped_share(const TensorParallel& tp, int64_t heads, int64_t groups, const char* what);

// The vocabulary rows of this rank (vocab-parallel embedding and head): parts of ceil(vocab / size) rows,
// the last ones shorter.
IndexRange vocab_share(const TensorParallel& tp, int64_t vocab);

}  // namespace sparrow
