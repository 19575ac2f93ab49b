#include "model/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "core/error.h"

namespace sparrow {

uint64_t dcp_candidate(float score, int64_t position) {
  uint32_t ordered = 0;
  if (!std::isnan(score)) {
    if (score == 0.0f) score = 0.0f;
    uint32_t bits;
    std::memcpy(&bits, &score, sizeof bits);
    ordered = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  }
  return (uint64_t(ordered) << 32) | uint64_t(0xFFFFFFFEu - uint32_t(position));
}
int64_t dcp_candidate_position(uint64_t candidate) { return int64_t(0xFFFFFFFEu - uint32_t(candidate & 0xFFFFFFFFu)); }
float dcp_candidate_score(uint64_t candidate) {
  const uint32_t ordered = uint32_t(candidate >> 32);
  if (ordered == 0) return NAN;
  const uint32_t bits = ordered & 0x80000000u ? ordered & 0x7FFFFFFFu : ~ordered;
  float score;
  std::memcpy(&score, &bits, sizeof score);
  return score;
}
void dcp_best(std::vector<uint64_t>& candidates, int64_t count, uint64_t* out) {
  std::erase(candidates, uint64_t(0));
  const int64_t n = std::min<int64_t>(count, int64_t(candidates.size()));
  std::partial_sort(candidates.begin(), candidates.begin() + n, candidates.end(), std::greater<>());
  std::fill(out, out + count, 0);
  std::copy(candidates.begin(), candidates.begin() + n, out);
}

namespace {
// This rank's best `count` candidates of a row, best first, zero-padded.
void local_best(const std::vector<float>& scores, int rank, int size, int64_t count, uint64_t* out) {
  std::vector<uint64_t> keys(scores.size());
  for (size_t l = 0; l < scores.size(); ++l) keys[l] = dcp_candidate(scores[l], int64_t(l) * size + rank);
  dcp_best(keys, count, out);
}
}  // namespace

std::vector<RowPiece> token_shard_pieces(const Batch& batch, int rank, int size) {
  std::vector<RowPiece> pieces;
  const int64_t cuts = 2 * int64_t(size);
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const int64_t count = batch.seqs[s].count;
    if (count < cuts) {  // too short to cut (decode, verification): whole sequences, dealt round-robin
      if (int64_t(s) % size == rank) pieces.push_back({int(s), 0, count});
      continue;
    }
    for (const int64_t j : {int64_t(rank), cuts - 1 - rank}) {
      const int64_t begin = count * j / cuts, end = count * (j + 1) / cuts;
      if (end > begin) pieces.push_back({int(s), begin, end - begin});
    }
  }
  return pieces;
}

bool token_sharded_step(const TensorParallel& tp, int64_t rows, Device device) {
  return tp.sharded() && (!tp.context_parallel() || tp.dcp_size == tp.size) && device == Device::Cpu &&
         tp.token_sharded_prefill_rows > 0 && rows >= tp.token_sharded_prefill_rows;
}

void store_step_rows(const TensorParallel& tp, const Batch& batch, int layer, PageKind kind, const Tensor& rows) {
  const int W = tp.dcp_size, me = tp.dcp_rank;
  const int64_t width = rows.row_size();
  std::vector<float> local;
  for (const SeqSlice& seq : batch.seqs) {
    if (W == 1) {  // every row, as it lies in the step
      seq.cache().write(layer, kind, seq.start(), seq.count, rows.row(seq.offset));
      continue;
    }
    const int64_t first = dcp_local_rows(seq.start(), me, W), last = dcp_local_rows(seq.start() + seq.count, me, W);
    local.resize(size_t((last - first) * width));
    for (int64_t l = first; l < last; ++l)  // token l * W + me, row (l * W + me - start) of the step's sequence
      std::copy_n(rows.row(seq.offset + l * W + me - seq.start()), width, local.data() + (l - first) * width);
    seq.cache().write(layer, kind, first, last - first, local.data());
  }
}

std::vector<std::vector<float>> step_context(const TensorParallel& tp, const Batch& batch, int layer, PageKind kind,
                                             int64_t width) {
  std::vector<std::vector<float>> context(batch.seqs.size());
  if (!tp.context_parallel()) {
    for (size_t s = 0; s < batch.seqs.size(); ++s) {
      const SeqSlice& seq = batch.seqs[s];
      context[s].resize(size_t((seq.start() + seq.count) * width));
      seq.cache().read(layer, kind, 0, seq.start() + seq.count, context[s].data());
    }
    return context;
  }
  // Every rank's local rows of every sequence, each sequence padded to ceil(end / W) rows, in one all-gather.
  const int W = tp.dcp_size, me = tp.dcp_rank;
  std::vector<int64_t> at(batch.seqs.size() + 1, 0);
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const int64_t end = batch.seqs[s].start() + batch.seqs[s].count;
    at[s + 1] = at[s] + (end + W - 1) / W;
  }
  std::vector<float> mine(size_t(at.back() * width), 0.0f), all(size_t(W) * mine.size());
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SeqSlice& seq = batch.seqs[s];
    seq.cache().read(layer, kind, 0, dcp_local_rows(seq.start() + seq.count, me, W), mine.data() + at[s] * width);
  }
  tp.dcp_comm->all_gather(mine.data(), all.data(), at.back() * width, ScalarType::F32);
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const int64_t end = batch.seqs[s].start() + batch.seqs[s].count;
    context[s].resize(size_t(end * width));
    for (int64_t j = 0; j < end; ++j)  // token j: rank j mod W's local row j / W
      std::copy_n(all.data() + ((j % W) * at.back() + at[s] + j / W) * width, width, context[s].data() + j * width);
  }
  return context;
}

DcpMergeCounters& dcp_merge_counters() {
  static DcpMergeCounters counters;
  return counters;
}

void dcp_select_topk(const TensorParallel& tp, int64_t k, const std::vector<std::vector<float>>& scores,
                     const std::vector<int64_t>& visible, int32_t* selected) {
  const int W = tp.dcp_size, me = tp.dcp_rank;
  const int64_t rows = int64_t(scores.size());
  SPARROW_CHECK(W > 1 && tp.dcp_comm && tp.dcp_comm->size() == W, "dcp_select_topk: no decode-context-parallel group");
  SPARROW_CHECK(int64_t(visible.size()) == rows, "dcp_select_topk: ", visible.size(), " visible counts for ", rows, " rows");
  if (rows == 0) return;
  const int64_t sent = (int64_t(std::ceil(kDcpCandidateShare * double(k))) + W - 1) / W;

  // Round one: every rank's best `sent` of every row.
  std::vector<uint64_t> mine(rows * sent), all(W * rows * sent);
  for (int64_t i = 0; i < rows; ++i) {
    SPARROW_CHECK(int64_t(scores[i].size()) == dcp_local_rows(visible[i], me, W), "dcp_select_topk: row ", i, " has ",
                  scores[i].size(), " local scores for ", visible[i], " visible keys");
    local_best(scores[i], me, W, sent, mine.data() + i * sent);
  }
  tp.dcp_comm->all_gather(mine.data(), all.data(), rows * sent, ScalarType::I64);
  DcpMergeCounters& counters = dcp_merge_counters();
  counters.merge_bytes += rows * sent * int64_t(sizeof(uint64_t));
  counters.naive_bytes += rows * k * int64_t(sizeof(uint64_t));
  counters.rows += rows;

  // Every rank selects alike from the same candidates: the k largest of a row's, and the ranks that must
  // re-send (more local keys than they sent, every one of them selected).
  std::vector<std::vector<uint64_t>> pool(rows);
  auto gather_row = [&](int64_t i, const std::vector<const uint64_t*>& from, const std::vector<int64_t>& counts) {
    pool[i].clear();
    for (int r = 0; r < W; ++r)
      for (int64_t j = 0; j < counts[r] && from[r][j] != 0; ++j) pool[i].push_back(from[r][j]);
    const int64_t n = std::min<int64_t>(k, int64_t(pool[i].size()));
    std::nth_element(pool[i].begin(), pool[i].begin() + (n > 0 ? n - 1 : 0), pool[i].end(), std::greater<>());
    pool[i].resize(n);
  };
  std::vector<uint8_t> resend(rows * W, 0);
  std::vector<int64_t> again;  // the rows some rank re-sends, in order
  for (int64_t i = 0; i < rows; ++i) {
    std::vector<const uint64_t*> from(W);
    for (int r = 0; r < W; ++r) from[r] = all.data() + (int64_t(r) * rows + i) * sent;
    gather_row(i, from, std::vector<int64_t>(W, sent));
    const uint64_t threshold = pool[i].size() == size_t(k) ? *std::min_element(pool[i].begin(), pool[i].end()) : 0;
    for (int r = 0; r < W; ++r) {
      // The rank's smallest sent candidate is its sent-th best; it re-sends when that one is selected and
      // it holds more local keys.
      const bool more = dcp_local_rows(visible[i], r, W) > sent;
      if (more && from[r][sent - 1] >= threshold) resend[i * W + r] = 1;
    }
    if (std::any_of(resend.begin() + i * W, resend.begin() + (i + 1) * W, [](uint8_t f) { return f != 0; }))
      again.push_back(i);
  }

  // Round two, only for the rows that need it (every rank knows which): the flagged ranks' whole local top-k.
  const int64_t n_again = int64_t(again.size());
  if (n_again > 0) {
    std::vector<uint64_t> full(n_again * k, 0), all_full(W * n_again * k);
    for (int64_t a = 0; a < n_again; ++a)
      if (resend[again[a] * W + me]) local_best(scores[again[a]], me, W, k, full.data() + a * k);
    tp.dcp_comm->all_gather(full.data(), all_full.data(), n_again * k, ScalarType::I64);
    counters.merge_bytes += n_again * k * int64_t(sizeof(uint64_t));
    counters.resent_rows += n_again;
    for (int64_t a = 0; a < n_again; ++a) {
      const int64_t i = again[a];
      std::vector<const uint64_t*> from(W);
      std::vector<int64_t> counts(W, sent);
      for (int r = 0; r < W; ++r) {
        from[r] = all.data() + (int64_t(r) * rows + i) * sent;
        if (!resend[i * W + r]) continue;
        from[r] = all_full.data() + (int64_t(r) * n_again + a) * k;
        counts[r] = k;
      }
      gather_row(i, from, counts);
    }
  }

  // This rank's share of each row's selection, as local rows ascending.
  for (int64_t i = 0; i < rows; ++i) {
    int32_t* row = selected + i * k;
    int64_t n = 0;
    for (uint64_t key : pool[i]) {
      const int64_t position = dcp_candidate_position(key);
      if (position % W == me) row[n++] = int32_t(position / W);
    }
    std::sort(row, row + n);
    std::fill(row + n, row + k, -1);
  }
}

std::vector<float> dcp_merge_attention(const TensorParallel& tp, std::vector<float>& partial, const std::vector<float>& lse,
                                       int64_t width) {
  const int W = tp.dcp_size;
  SPARROW_CHECK(W > 1 && tp.dcp_comm && tp.dcp_comm->size() == W, "dcp_merge_attention: no decode-context-parallel group");
  SPARROW_CHECK(lse.size() % W == 0 && partial.size() == lse.size() * size_t(width),
                "dcp_merge_attention: ", partial.size(), " outputs for ", lse.size(), " log-sum-exps of width ", width);
  const int64_t per_rank = int64_t(lse.size()) / W;  // (rows x heads) of one rank's heads
  std::vector<float> all_lse(size_t(W) * lse.size());
  tp.dcp_comm->all_gather(lse.data(), all_lse.data(), int64_t(lse.size()), ScalarType::F32);
  // Weight each of this rank's partial outputs by its share of the total exp-sum; the reduce-scatter then
  // adds the ranks' weighted outputs for each head's owner.
  for (int64_t j = 0; j < int64_t(lse.size()); ++j) {
    float top = -INFINITY;
    for (int r = 0; r < W; ++r) top = std::max(top, all_lse[size_t(r) * lse.size() + j]);
    float total = 0.0f;
    if (top != -INFINITY)
      for (int r = 0; r < W; ++r) total += std::exp(all_lse[size_t(r) * lse.size() + j] - top);
    const float weight = top == -INFINITY || lse[j] == -INFINITY ? 0.0f : std::exp(lse[j] - top) / total;
    float* out = partial.data() + j * width;
    for (int64_t c = 0; c < width; ++c) out[c] *= weight;
  }
  std::vector<float> merged(size_t(per_rank * width));
  tp.dcp_comm->reduce_scatter(partial.data(), merged.data(), per_rank * width, ScalarType::F32);
  return merged;
}

}  // namespace sparrow
