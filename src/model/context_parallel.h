// Decode context parallelism (DCP; docs/parallel.md, "Decode context parallelism"): the ranks of a DCP group
// (TensorParallel::dcp_*) share out a sequence's MLA latents and DSA index keys by token, token j on dcp rank
// j mod W at local row j / W, as vLLM's DCP and the first seed article's ("W 块 GPU 中的第 r 块存储每第 W 个
// token"). What the MLA block and the DSA indexer need for it: which rows are local, and the exact global
// top-k of the indexer's scores when every rank has scored only its own keys.
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

#include "core/communicator.h"
#include "model/model.h"

namespace sparrow {

// Token-sharded prefill (docs/parallel.md, "Token-sharded prefill"): under TP, a large prefill step's rows are
// dealt over the group instead of its heads for the attention core. Each sequence's rows are cut into 2W
// pieces, piece j its rows [count * j / 2W, count * (j + 1) / 2W), and rank r takes pieces r and 2W - 1 - r,
// so that an early piece (short causal prefixes) pairs with a late one (long ones): the first seed article's
// balance. A sequence of fewer than 2W rows (decode, verification) goes whole to rank (its index mod W).
// `begin` counts from the sequence's first row in the step.
struct RowPiece {
  int seq = 0;  // index into Batch::seqs
  int64_t begin = 0, count = 0;
};
std::vector<RowPiece> token_shard_pieces(const Batch& batch, int rank, int size);
// Whether a step of `rows` rows runs token-sharded: TP without DCP or with DCP over the whole TP group (then
// "DCP prefill without a merge", below), on the CPU backend, and at least tp.token_sharded_prefill_rows rows
// (0: never).
bool token_sharded_step(const TensorParallel& tp, int64_t rows, Device device);

// Stores this step's rows of one page kind (`rows` [batch.size(), width], CPU) in the sequences' caches: every
// row, or under DCP this rank's share (token j at local row j / W when j mod W is this rank).
void store_step_rows(const TensorParallel& tp, const Batch& batch, int layer, PageKind kind, const Tensor& rows);

// The step's context of one page kind for a token-sharded step, per sequence of the batch: its rows
// [0, start + count) in order, as the cache returns them, after this step's rows are stored. Without DCP,
// read from this rank's (whole) cache; under DCP ("DCP prefill without a merge", the first seed article),
// gathered from every rank's share by one all-gather of the group, so that the token-sharded step then
// runs exactly as without DCP.
std::vector<std::vector<float>> step_context(const TensorParallel& tp, const Batch& batch, int layer, PageKind kind,
                                             int64_t width);

// The local rows among positions [0, end): how many of them rank `rank` of a DCP group of `size` holds.
inline int64_t dcp_local_rows(int64_t end, int rank, int size) {
  return end <= 0 ? 0 : (end + size - 1 - rank) / size;
}

// The exact top-k merge. Each rank takes its best ceil(kDcpCandidateShare * k / W) keys of a row (the seed's
// 1.5 k / W), as 64-bit candidates (the score, order-preserving, above the global position, so that one
// integer comparison ranks them the way the single-rank top-k does: higher score first, NaN last, ties to
// the smaller position); the group all-gathers them and every rank selects the same k. A rank whose every
// sent candidate made it into the k may hold more of them than it sent: it is detected on every rank from
// the same gathered data, and it re-sends that row's whole local top-k in a second all-gather, after which
// the selection is the single-rank top-k (every key of the global top-k is in its rank's local top-k).
inline constexpr double kDcpCandidateShare = 1.5;

// A candidate of a top-k merge across ranks as one unsigned integer, larger = ranked first: the score made
// order-preserving (negative floats flipped, positive ones above them; -0 taken as +0, which the single-rank
// top-k ties with it; NaN below everything, as it ranks last there) in the high half, 0xFFFFFFFE - position
// in the low half (ties to the smaller position). 0 is no candidate: every real one is larger. Positions
// below 2^32 - 1.
uint64_t dcp_candidate(float score, int64_t position);
int64_t dcp_candidate_position(uint64_t candidate);
float dcp_candidate_score(uint64_t candidate);  // the score back (NaN for NaN; -0 as +0)
// The best `count` of `candidates` (any order, zeros ignored), best first, zero-padded to `count`.
void dcp_best(std::vector<uint64_t>& candidates, int64_t count, uint64_t* out);

// Bytes one rank has sent to the merges so far, and what the naive merge (every rank all-gathering its
// whole local top-k) would have sent for the same rows; rows that re-sent. Process-wide, for `bench`.
struct DcpMergeCounters {
  std::atomic<int64_t> merge_bytes{0}, naive_bytes{0}, rows{0}, resent_rows{0};
};
DcpMergeCounters& dcp_merge_counters();

// For `rows` query rows of one step (the same rows, in the same order, on every rank of the group): row i
// sees global positions [0, visible[i]), more than k of them, and scores[i] holds this rank's scores of its
// local keys 0 .. dcp_local_rows(visible[i]) - 1 (local row l = position l * W + dcp_rank). Writes
// selected[i * k ..]: this rank's local rows among the row's global top-k, ascending, then -1. A collective
// of the DCP group (one all-gather, two when a rank must re-send).
void dcp_select_topk(const TensorParallel& tp, int64_t k, const std::vector<std::vector<float>>& scores,
                     const std::vector<int64_t>& visible, int32_t* selected);

// Merges each rank's attention over its own keys into the attention over all of them, by log-sum-exp
// (flash-decoding's combine): `partial` [W][n] holds this rank's outputs for the query heads of every rank
// of the group (block o: rank o's heads, n = rows x heads x width values), normalised over this rank's keys,
// and `lse` [W][rows x heads] their natural log-sum-exp (-inf: no key here). Returns this rank's heads'
// merged outputs [n]: sum over ranks of exp(lse_rank - lse_all) x partial_rank, in rank order (one
// all-gather of the lse, one reduce-scatter of the outputs).
std::vector<float> dcp_merge_attention(const TensorParallel& tp, std::vector<float>& partial, const std::vector<float>& lse,
                                       int64_t width);

}  // namespace sparrow
