// Data parallelism (--data-parallel-size, docs/parallel.md) against one process, with real processes:
//   - the row collectives a data-parallel MoE layer runs (ops::all_gather_rows / reduce_scatter_rows, and
//     with expert parallelism ops::send_rows / return_rows) between three forked ranks with uneven counts,
//     one of them empty;
//   - when the groups' leaders stop stepping together (runner/data_parallel.h);
//   - `sparrow score` and `sparrow generate` run as a user runs them, for every family (the fixtures'
//     prompts are longer than the sparse budgets), at -dp 2 with the experts dealt out whole (-ep), split
//     inside over both groups, and with tensor parallelism inside each group (-dp 2 -tp 2): every row of
//     logits within 1e-5 of one process (relative L2) and the same greedy (and seeded) tokens. In these
//     commands each group runs its share of the prompts (every second one) and steps along with the other
//     while it has none left, its experts serving the other's tokens; rank 0 writes them all (the serving
//     test runs both groups' own requests: tests/server/test_tensor_parallel.py).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "../test_util.h"
#include "forked_ranks.h"
#include "core/error.h"
#include "distributed/gloo_communicator.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"
#include "runner/data_parallel.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using sparrow::testing::run_group;

const fs::path kFixtures = fs::path(SPARROW_SOURCE_DIR) / "tests" / "fixtures";

sparrow::testing::CliRun run(const std::string& args) { return sparrow::testing::run_sparrow(args, "", 240); }

// The logits `score` wrote, one tensor per prompt.
std::vector<Tensor> read_logits(const fs::path& path) {
  auto file = SafetensorsFile::open(path.string());
  std::vector<Tensor> out;
  for (size_t i = 0; file->tensors().count("logits." + std::to_string(i)); ++i)
    out.push_back(to_float32(file->tensors().at("logits." + std::to_string(i)), file));
  return out;
}

double row_error(const Tensor& ours, const Tensor& ref, int64_t row) {
  const int64_t n = ref.dim(1);
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += std::pow(double(ours.data()[row * n + i]) - ref.data()[row * n + i], 2);
    norm += std::pow(double(ref.data()[row * n + i]), 2);
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace

// Group d's rows land after the earlier groups' (all_gather_rows), and each group gets back its own rows
// summed over the groups (reduce_scatter_rows), whatever the counts, an empty group included.
TEST(DataParallel, RowCollectivesBetweenProcesses) {
  const std::vector<int64_t> counts = {2, 0, 3};
  const int64_t width = 5;
  const std::string failures = run_group(3, [&](Communicator& comm) {
    TensorParallel tp;
    tp.dp_rank = comm.rank();
    tp.dp_size = comm.size();
    tp.dp_comm = &comm;
    const int64_t mine = counts[size_t(comm.rank())];
    auto value = [](int64_t group, int64_t row, int64_t col) { return float(100 * group + 10 * row + col); };
    Tensor x = Tensor::zeros({mine, width});
    for (int64_t r = 0; r < mine; ++r)
      for (int64_t c = 0; c < width; ++c) x.data()[r * width + c] = value(comm.rank(), r, c);
    const Tensor all = ops::all_gather_rows(tp, x, counts);
    SPARROW_CHECK(all.dim(0) == 5 && all.dim(1) == width, "gathered ", shape_str(all.shape()));
    int64_t row = 0;
    for (int64_t g = 0; g < 3; ++g)
      for (int64_t r = 0; r < counts[size_t(g)]; ++r, ++row)
        for (int64_t c = 0; c < width; ++c)
          SPARROW_CHECK(all.data()[row * width + c] == value(g, r, c), "gathered row ", row, " column ", c);
    // Every group adds (rank + 1) x its gathered copy: each group's rows come back times 1 + 2 + 3.
    Tensor term = all.clone();
    for (int64_t i = 0; i < term.numel(); ++i) term.data()[i] *= float(comm.rank() + 1);
    const Tensor back = ops::reduce_scatter_rows(tp, term, counts);
    SPARROW_CHECK(back.dim(0) == mine, "scattered ", back.dim(0), " rows for ", mine);
    for (int64_t i = 0; i < back.numel(); ++i)
      SPARROW_CHECK(back.data()[i] == 6 * x.data()[i], "scattered element ", i, ": ", back.data()[i]);
    // A count that is not this group's rows is refused.
    bool refused = false;
    try {
      ops::all_gather_rows(tp, Tensor::zeros({mine + 1, width}), counts);
    } catch (const Error&) {
      refused = true;
    }
    SPARROW_CHECK(refused, "a wrong row count was not refused");
  });
  EXPECT_EQ(failures, "");
}

// Expert parallelism's dispatch (ops::send_rows / return_rows): each group sends some of its rows to some
// groups (one to itself, one to nobody, a row to two groups, a group with no rows at all), gets exactly the
// rows addressed to it in source order, and the terms come back added in group order onto zeros.
TEST(DataParallel, RoutedRowsGoOnlyWhereTheyAreSent) {
  const int64_t width = 3;
  const std::vector<int64_t> counts = {3, 0, 2};
  // to[g][d]: the rows of group g that go to group d.
  const std::vector<std::vector<std::vector<int64_t>>> to = {{{0}, {0, 2}, {2}}, {{}, {}, {}}, {{1}, {}, {0, 1}}};
  const std::string failures = run_group(3, [&](Communicator& comm) {
    TensorParallel tp;
    tp.dp_rank = comm.rank();
    tp.dp_size = comm.size();
    tp.dp_comm = &comm;
    const int g = comm.rank();
    auto value = [](int64_t group, int64_t row, int64_t col) { return float(100 * group + 10 * row + col); };
    Tensor x = Tensor::zeros({counts[size_t(g)], width});
    for (int64_t r = 0; r < x.dim(0); ++r)
      for (int64_t c = 0; c < width; ++c) x.data()[r * width + c] = value(g, r, c);
    ops::RowExchange exchange;
    exchange.to = to[size_t(g)];
    const Tensor got = ops::send_rows(tp, x, exchange);
    int64_t row = 0;
    for (int s = 0; s < 3; ++s) {
      SPARROW_CHECK(exchange.from[size_t(s)] == int64_t(to[size_t(s)][size_t(g)].size()), "from ", s);
      for (int64_t r : to[size_t(s)][size_t(g)]) {
        for (int64_t c = 0; c < width; ++c)
          SPARROW_CHECK(got.data()[row * width + c] == value(s, r, c), "group ", g, " row ", row, " column ", c);
        ++row;
      }
    }
    SPARROW_CHECK(got.dim(0) == row, "group ", g, " got ", got.dim(0), " rows, expected ", row);
    // Each group returns (its number + 1) x every row it got: a row comes back as the sum over the groups
    // it went to.
    Tensor terms = got.clone();
    for (int64_t i = 0; i < terms.numel(); ++i) terms.data()[i] *= float(g + 1);
    const Tensor back = ops::return_rows(tp, terms, exchange, x.dim(0));
    for (int64_t r = 0; r < x.dim(0); ++r) {
      float factor = 0.0f;
      for (int d = 0; d < 3; ++d)
        for (int64_t sent : to[size_t(g)][size_t(d)]) factor += sent == r ? float(d + 1) : 0.0f;
      for (int64_t c = 0; c < width; ++c)
        SPARROW_CHECK(back.data()[r * width + c] == factor * value(g, r, c), "group ", g, " returned row ", r);
    }
  });
  EXPECT_EQ(failures, "");
}

// The leaders stop stepping only on an exchange that shows no tokens and the same wave everywhere (a group
// that has not seen the newest wave yet keeps the others meeting), or a group that left.
TEST(DataParallel, GroupsSettleTogether) {
  EXPECT_TRUE(groups_settled({{0, 3, 0}, {0, 3, 0}}));
  EXPECT_FALSE(groups_settled({{0, 3, 0}, {0, 4, 0}}));
  EXPECT_FALSE(groups_settled({{1, 3, 0}, {0, 3, 0}}));
  EXPECT_TRUE(groups_settled({{0, 3, 0}, {2, 4, 1}}));
  EXPECT_TRUE(any_stopped({{0, 0, 0}, {0, 0, 1}}));
  EXPECT_EQ(group_tokens({{4, 0, 0}, {0, 0, 0}, {9, 1, 0}}), (std::vector<int64_t>{4, 0, 9}));
}

// Every family scores as one process does at -dp 2, whichever way the experts are split.
TEST(DataParallel, EveryFamilyScoresAsOneProcess) {
  struct Case {
    const char* fixture;
    std::vector<std::string> layouts;
  };
  const std::vector<Case> cases = {
      {"minimax_m3", {"-dp 2 -ep", "-dp 2", "-dp 2 -tp 2 -ep"}},
      // (with decode context parallelism inside each group too: four processes, two DCP groups)
      {"deepseek_v32", {"-dp 2 -ep", "-dp 2 -tp 2", "-dp 2 -tp 2 -dcp 2 -ep"}},
      {"kimi_linear", {"-dp 2 -ep", "-dp 2 -tp 2"}},
      {"kimi_k3", {"-dp 2 -ep"}},
      {"kimi_k3_1_pro", {"-dp 2 -ep", "-dp 2"}},
  };
  sparrow::testing::TempDir dir;
  for (const Case& c : cases) {
    const fs::path fixture = kFixtures / c.fixture;
    if (!fs::exists(fixture / "config.json")) GTEST_SKIP() << "fixture missing: " << fixture;
    const std::string base = "score --model " + fixture.string() + " --prompt-ids " + (fixture / "prompts.json").string();
    const std::string whole_path = dir.file(std::string(c.fixture) + ".whole.safetensors");
    const auto whole_run = run(base + " --out " + whole_path);
    ASSERT_EQ(whole_run.status, 0) << whole_run.err;
    const std::vector<Tensor> whole = read_logits(whole_path);
    ASSERT_FALSE(whole.empty());
    for (const std::string& layout : c.layouts) {
      const std::string path = dir.file(std::string(c.fixture) + ".dp.safetensors");
      const auto r = run(base + " " + layout + " --out " + path);
      ASSERT_EQ(r.status, 0) << c.fixture << " " << layout << ": " << r.err;
      const std::vector<Tensor> ours = read_logits(path);
      ASSERT_EQ(ours.size(), whole.size()) << c.fixture << " " << layout;
      for (size_t p = 0; p < whole.size(); ++p) {
        ASSERT_EQ(ours[p].shape(), whole[p].shape());
        for (int64_t t = 0; t < whole[p].dim(0); ++t)
          ASSERT_LE(row_error(ours[p], whole[p], t), 1e-5)
              << c.fixture << " " << layout << ": prompt " << p << " row " << t;
      }
    }
  }
}

// Greedy generation (the engine's loop: batched prefill, then decode steps) gives one process's tokens.
TEST(DataParallel, GreedyGenerationAsOneProcess) {
  for (const char* name : {"deepseek_v32", "kimi_k3_1_pro", "minimax_m3"}) {
    const fs::path fixture = kFixtures / name;
    if (!fs::exists(fixture / "config.json")) GTEST_SKIP() << "fixture missing: " << fixture;
    const std::string base = "generate --model " + fixture.string() + " --prompt-ids " +
                             (fixture / "prompts.json").string() + " --max-tokens 8 --temperature 0";
    const auto whole = run(base);
    ASSERT_EQ(whole.status, 0) << whole.err;
    const auto ours = run(base + " -dp 2 -ep");
    ASSERT_EQ(ours.status, 0) << name << ": " << ours.err;
    EXPECT_EQ(ours.out, whole.out) << name;
    // Each group generated its share of the three prompts: the first two of them, the second one.
    EXPECT_NE(ours.err.find("3 inputs over 2 data-parallel groups, input i to group i mod 2 (2 + 1)"), std::string::npos)
        << ours.err;
  }
}

// Seeded sampling: prompt i draws with seed + i whichever group generates it.
TEST(DataParallel, SeededSamplingAsOneProcess) {
  const fs::path fixture = kFixtures / "deepseek_v32";
  const std::string base = "generate --model " + fixture.string() + " --prompt-ids " +
                           (fixture / "prompts.json").string() + " --max-tokens 8 --temperature 1 --seed 7";
  const auto whole = run(base);
  ASSERT_EQ(whole.status, 0) << whole.err;
  const auto ours = run(base + " -dp 2 -ep");
  ASSERT_EQ(ours.status, 0) << ours.err;
  EXPECT_EQ(ours.out, whole.out);
}

// Sizes that do not fit are refused in one line before anything runs.
TEST(DataParallel, BadLayoutsAreRefused) {
  const fs::path fixture = kFixtures / "minimax_m3";
  const std::string base = "score --model " + fixture.string() + " --prompt-ids " + (fixture / "prompts.json").string() +
                           " --out x.safetensors ";
  auto r = run(base + "-dp 0");
  EXPECT_NE(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--data-parallel-size"), std::string::npos) << r.err;
  r = run(base + "-dp 2 --nnodes 3 --master-addr 127.0.0.1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("does not split evenly over --nnodes 3"), std::string::npos) << r.err;
  // A command that fails once the groups have met ends every rank with its error, not a crash.
  r = run("score --model " + fixture.string() + " --prompt-ids " + (fixture / "prompts.json").string() +
          " --out /nonexistent/dir/x.safetensors -dp 2 -ep");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/dir/x.safetensors: cannot open for writing"), std::string::npos) << r.err;
}
