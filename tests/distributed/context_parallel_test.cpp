// Decode context parallelism's exact top-k merge (model/context_parallel.h) between real processes: every rank
// scores only its share of the keys (token j on rank j mod W), and the union of the ranks' selections must be
// the single-rank top-k of all the scores (cpu::top_k: higher first, NaN last, ties to the smaller position),
// whatever the scores: ties across ranks, NaN, -0 and +0, all of the top on one rank (the re-send), rows that
// see few keys on some ranks. The model-level check (DCP 2 and 4 against the unsharded model) is in
// tensor_parallel_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "forked_ranks.h"
#include "core/error.h"
#include "distributed/gloo_communicator.h"
#include "kernels/cpu/reference_ops.h"
#include "model/context_parallel.h"

using namespace sparrow;

namespace {

// Every row's scores over all its visible keys, the same on every rank.
using Rows = std::vector<std::vector<float>>;

// Runs the merge on W forked ranks and checks every rank's share against the single-rank top-k; `check`
// then sees this rank's counters. "" when every rank agreed.
std::string merge_on_ranks(int W, int64_t k, const Rows& rows,
                           const std::function<void(const DcpMergeCounters&)>& check = nullptr) {
  return sparrow::testing::run_group(
      W,
      [&](Communicator& group) {
        Communicator* comm = &group;
        const int rank = group.rank();
        TensorParallel tp{rank, W, comm};
        tp.dcp_rank = rank;
        tp.dcp_size = W;
        tp.dcp_comm = comm;
        std::vector<std::vector<float>> local(rows.size());
        std::vector<int64_t> visible;
        for (size_t i = 0; i < rows.size(); ++i) {
          for (size_t j = size_t(rank); j < rows[i].size(); j += size_t(W)) local[i].push_back(rows[i][j]);
          visible.push_back(int64_t(rows[i].size()));
        }
        std::vector<int32_t> selected(rows.size() * k);
        dcp_select_topk(tp, k, local, visible, selected.data());
        // Each rank's share, as global positions, is the single-rank top-k's positions on this rank; and the
        // shares of all ranks are gathered again to check that they add up to the whole top-k.
        std::vector<int32_t> all(size_t(W) * selected.size());
        comm->all_gather(selected.data(), all.data(), int64_t(selected.size()), ScalarType::I32);
        for (size_t i = 0; i < rows.size(); ++i) {
          const std::vector<int32_t> top = cpu::top_k(rows[i].data(), int64_t(rows[i].size()), k);
          const std::set<int32_t> expected(top.begin(), top.end());
          std::set<int32_t> got;
          for (int r = 0; r < W; ++r) {
            const int32_t* row = all.data() + (size_t(r) * rows.size() + i) * k;
            for (int64_t j = 0; j < k && row[j] >= 0; ++j) {
              SPARROW_CHECK(j == 0 || row[j] > row[j - 1], "row ", i, ": rank ", r, "'s local rows are not ascending");
              got.insert(row[j] * W + r);
            }
          }
          SPARROW_CHECK(got == expected, "row ", i, ": the ranks selected ", got.size(), " keys, ",
                        std::count_if(got.begin(), got.end(), [&](int32_t p) { return expected.count(p) > 0; }),
                        " of them in the single-rank top ", expected.size());
        }
        if (check) check(dcp_merge_counters());
      },
      std::chrono::seconds(120));
}

std::vector<float> random_scores(std::mt19937& rng, int64_t n, int distinct) {
  std::vector<float> s(n);
  std::uniform_int_distribution<int> value(0, distinct - 1);
  for (float& x : s) x = distinct > 0 ? float(value(rng)) * 0.25f : std::uniform_real_distribution<float>(-3, 3)(rng);
  return s;
}

TEST(ContextParallelMerge, EqualsTheSingleRankTopK) {
  std::mt19937 rng(7);
  for (int W : {2, 3, 4}) {
    Rows rows;
    for (int64_t n : {17, 40, 100, 1000, 5000}) {
      rows.push_back(random_scores(rng, n, 0));   // distinct scores
      rows.push_back(random_scores(rng, n, 5));   // heavy ties, across ranks
    }
    EXPECT_EQ(merge_on_ranks(W, 16, rows), "") << "W = " << W;
  }
}

TEST(ContextParallelMerge, NaNRanksLastAndZerosTie) {
  std::vector<float> s(200, 0.0f);
  for (size_t i = 0; i < s.size(); i += 3) s[i] = -0.0f;  // -0 ties +0 in the single-rank top-k
  for (size_t i = 0; i < s.size(); i += 7) s[i] = NAN;
  s[150] = 1.0f;
  s[151] = -1.0f;
  std::vector<float> nan_heavy(60, NAN);
  nan_heavy[59] = -INFINITY;
  EXPECT_EQ(merge_on_ranks(2, 32, {s, nan_heavy}), "");
  EXPECT_EQ(merge_on_ranks(4, 8, {s, nan_heavy}), "");
}

// All of the top on one rank: that rank's sent candidates are all selected, so it must re-send its whole local
// top-k of that row alone (the only way the result can be exact); the counters show the second round.
TEST(ContextParallelMerge, ARankHoldingMoreThanItSentReSends) {
  const int W = 4;
  const int64_t k = 64;
  std::mt19937 rng(3);
  std::vector<float> s(4096);
  for (size_t j = 0; j < s.size(); ++j) s[j] = j % W == 1 ? 100.0f + float(j) : float(j % 97);
  EXPECT_EQ(merge_on_ranks(W, k, {s, random_scores(rng, 4096, 0)},
                           [&](const DcpMergeCounters& c) {
                             const int64_t sent = (int64_t(std::ceil(kDcpCandidateShare * k)) + W - 1) / W;
                             SPARROW_CHECK(c.resent_rows == 1, "expected one re-sent row, got ", c.resent_rows.load());
                             SPARROW_CHECK(c.naive_bytes == 2 * k * 8, "naive bytes ", c.naive_bytes.load());
                             SPARROW_CHECK(c.merge_bytes == 2 * sent * 8 + k * 8, "merge bytes ", c.merge_bytes.load());
                           }),
            "");
}

// Without a re-send, a rank sends ceil(1.5 k / W) candidates a row where the naive merge sends k: W / 1.5
// times fewer bytes.
TEST(ContextParallelMerge, SendsAFractionOfTheNaiveMerge) {
  std::mt19937 rng(11);
  const int W = 4;
  const int64_t k = 2048;
  Rows rows;
  for (int i = 0; i < 3; ++i) rows.push_back(random_scores(rng, 32768, 0));
  EXPECT_EQ(merge_on_ranks(W, k, rows,
                           [&](const DcpMergeCounters& c) {
                             SPARROW_CHECK(c.resent_rows == 0, "random scores re-sent ", c.resent_rows.load(), " rows");
                             SPARROW_CHECK(c.merge_bytes * 8 == c.naive_bytes * 3, "merge ", c.merge_bytes.load(),
                                           " bytes against the naive ", c.naive_bytes.load(), " (expected 3/8)");
                           }),
            "");
}

TEST(ContextParallelMerge, LocalRows) {
  // Positions 0 .. end-1 dealt round-robin over 3 ranks.
  for (int64_t end = 0; end < 20; ++end)
    for (int r = 0; r < 3; ++r) {
      int64_t n = 0;
      for (int64_t j = 0; j < end; ++j) n += j % 3 == r;
      EXPECT_EQ(dcp_local_rows(end, r, 3), n) << end << " " << r;
    }
}

}  // namespace
