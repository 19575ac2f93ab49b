// Tensor parallelism against the unsharded model, with real processes: each rank is a forked process that
// joins a gloo group on localhost (src/distributed), loads its part of a fixture (tests/fixtures, every
// family) and runs the fixture's prompts (longer than the sparse budgets: DSA's top-k, MSA's kept blocks)
// as one batched prefill, then greedy decoding against its cache. Every rank also runs the unsharded model
// and checks that its cache rows are what kv-plan's per-rank rules say, and, per position, logits within
// 1e-5 (relative L2: the sharded sums only reorder fp32 additions) and the same greedy tokens.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../cuda/model_test_util.h"  // device-free: fixtures' token lists, row errors, argmax
#include "forked_ranks.h"
#include "cache/kv_plan.h"
#include "core/error.h"
#include "distributed/gloo_communicator.h"
#include "model/model.h"
#include "model/tensor_parallel.h"
#include "runner/model_runner.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

// Forks `size` ranks, each joining a gloo group on localhost and running body(tp); "" when all exited 0. With
// dcp > 1 the ranks also form decode-context-parallel groups of dcp consecutive ranks, as ProcessGroup does.
std::string run_ranks(int size, const std::function<void(const TensorParallel&)>& body, bool expert_parallel = false,
                      int dcp = 1, bool indexer_decode_cp = false, int64_t token_sharded_prefill_rows = 0) {
  std::vector<int> context_ports;  // one rendezvous for each decode-context-parallel group
  for (int g = 0; dcp > 1 && g < size / dcp; ++g) context_ports.push_back(sparrow::testing::free_port());
  return sparrow::testing::run_group(
      size,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        TensorParallel tp{rank, size, &comm, expert_parallel};
        tp.indexer_decode_cp = indexer_decode_cp;
        tp.token_sharded_prefill_rows = token_sharded_prefill_rows;
        std::unique_ptr<Communicator> context;
        if (dcp > 1) {
          context = sparrow::testing::connect_local(rank % dcp, dcp, context_ports[rank / dcp]);
          tp.dcp_rank = rank % dcp;
          tp.dcp_size = dcp;
          tp.dcp_comm = context.get();
        }
        body(tp);
      },
      std::chrono::seconds(240));
}

using model_test::argmax;
using model_test::relative_l2;
using model_test::Tokens;

void expect_rows_match(const Tensor& sharded, const Tensor& whole, const std::string& what) {
  SPARROW_CHECK(sharded.shape() == whole.shape(), what, ": logits ", shape_str(sharded.shape()), " vs ",
                shape_str(whole.shape()));
  for (int64_t t = 0; t < whole.dim(0); ++t) {
    const double error = relative_l2(sharded.row(t), whole.row(t), whole.dim(1));
    SPARROW_CHECK(error <= 1e-5, what, ": row ", t, " relative L2 ", error, " > 1e-5");
  }
}

constexpr int kDecodeSteps = 8;

// The body every rank runs: sharded and whole models side by side, prefill then greedy decode.
void compare_with_whole(const fs::path& dir, const fs::path& prompts_file, const TensorParallel& tp) {
  LoadOptions sharded_options;
  sharded_options.tensor_parallel = tp;
  std::unique_ptr<Model> sharded = load_model(dir.string(), Device::Cpu, sharded_options);
  std::unique_ptr<Model> whole = load_model(dir.string(), Device::Cpu);
  // The KV planner's per-rank rules (cache/kv_plan.h spec_per_rank) are the sharded model's own cache.
  SPARROW_CHECK(sharded->cache_spec() == spec_per_rank(whole->cache_spec(), tp.size, tp.dcp_size),
                "the sharded model caches other rows than kv-plan's spec_per_rank says");
  ModelRunner sharded_runner(*sharded), whole_runner(*whole);
  const std::vector<Tokens> prompts = model_test::token_lists(prompts_file, "prompts");
  std::vector<SequenceState> sharded_seqs, whole_seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    sharded_seqs.push_back(sharded_runner.new_sequence());
    whole_seqs.push_back(whole_runner.new_sequence());
  }
  auto step = [&](const std::vector<Tokens>& parts, bool all_logits, const std::string& what) {
    std::vector<std::pair<SequenceState*, Tokens>> sharded_parts, whole_parts;
    for (size_t i = 0; i < parts.size(); ++i) {
      sharded_parts.emplace_back(&sharded_seqs[i], parts[i]);
      whole_parts.emplace_back(&whole_seqs[i], parts[i]);
    }
    Batch sharded_batch = make_batch(sharded_parts), whole_batch = make_batch(whole_parts);
    sharded_batch.all_logits = whole_batch.all_logits = all_logits;
    const Tensor ours = sharded_runner.run(sharded_batch), reference = whole_runner.run(whole_batch);
    expect_rows_match(ours, reference, what);
    return ours;
  };
  Tensor logits = step(prompts, /*all_logits=*/false, "prefill");
  for (int s = 0; s < kDecodeSteps; ++s) {
    std::vector<Tokens> next;
    for (int64_t i = 0; i < logits.dim(0); ++i) next.push_back({argmax(logits.row(i), logits.dim(1))});
    logits = step(next, /*all_logits=*/false, "decode step " + std::to_string(s));
  }
}

struct Case {
  std::string fixture;
  int size;
  bool expert_parallel = false;
  std::string prompts_of = "";  // the fixture whose prompts.json to run (default: its own)
  int dcp = 1;                  // decode context parallel: ranks sharing out the MLA caches' tokens
  bool indexer_decode_cp = false;  // MSA: every rank scores every index head over its share of the blocks
  int64_t token_sharded_prefill_rows = 0;  // steps of this many rows run MLA's attention core token-sharded
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.fixture << " at TP " << c.size << (c.expert_parallel ? " with expert parallelism" : "");
  if (c.dcp > 1) *os << " and DCP " << c.dcp;
  if (c.indexer_decode_cp) *os << " and the MSA indexer's decode context parallelism";
  if (c.token_sharded_prefill_rows) *os << " and token-sharded steps from " << c.token_sharded_prefill_rows << " rows";
}

class TensorParallelCpu : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelCpu, MatchesTheUnshardedModel) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam().fixture;
  const fs::path prompts = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" /
                           (GetParam().prompts_of.empty() ? GetParam().fixture : GetParam().prompts_of) / "prompts.json";
  EXPECT_EQ(run_ranks(GetParam().size, [&](const TensorParallel& tp) { compare_with_whole(dir, prompts, tp); },
                      GetParam().expert_parallel, GetParam().dcp, GetParam().indexer_decode_cp,
                      GetParam().token_sharded_prefill_rows),
            "");
}

// Expert parallelism (--enable-expert-parallel) for every family, the latent MoE (kimi_k3_1_pro) and experts
// stored as FP8 blocks and NVFP4 included: whole experts per rank, the slots of the others skipped.
INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelCpu,
                         ::testing::Values(Case{"minimax_m3", 2}, Case{"minimax_m3", 4}, Case{"deepseek_v32", 2},
                                           Case{"kimi_linear", 2}, Case{"kimi_k3", 2}, Case{"kimi_k3_1_pro", 4},
                                           Case{"deepseek_v32", 2, true}, Case{"minimax_m3", 4, true},
                                           Case{"kimi_linear", 2, true}, Case{"kimi_k3", 2, true},
                                           Case{"kimi_k3_1_pro", 4, true}, Case{"deepseek_v32_fp8", 2, true},
                                           Case{"minimax_m3_nvfp4", 2, true, "minimax_m3"},
                                           Case{"deepseek_v32_mxfp4", 2, true, "deepseek_v32"},
                                           // Decode context parallelism (the MLA families; prompts past the DSA
                                           // budget, so every rank's share and the top-k merge matter).
                                           Case{"deepseek_v32", 2, false, "", 2}, Case{"deepseek_v32", 4, false, "", 4},
                                           Case{"deepseek_v32", 4, true, "", 2}, Case{"kimi_linear", 2, false, "", 2},
                                           Case{"kimi_k3", 2, false, "", 2}, Case{"kimi_k3_1_pro", 4, false, "", 4},
                                           // MSA's indexer decode context parallelism (one index head a rank
                                           // at TP 2; at TP 4 each head shared by two ranks).
                                           Case{"minimax_m3", 2, false, "", 1, true},
                                           Case{"minimax_m3", 4, false, "", 1, true},
                                           Case{"minimax_m3_nvfp4", 2, true, "minimax_m3", 1, true},
                                           // Token-sharded prefill: every step (1 row and up: decode steps too),
                                           // or the prefill alone (16 rows and up).
                                           Case{"deepseek_v32", 2, false, "", 1, false, 1},
                                           Case{"deepseek_v32", 4, true, "", 1, false, 16},
                                           Case{"kimi_k3_1_pro", 4, false, "", 1, false, 1},
                                           Case{"kimi_linear", 2, false, "", 1, false, 16},
                                           // DCP prefill without a merge: token-sharded prefill over the context
                                           // gathered from the DCP group, decode through the DCP merge.
                                           Case{"deepseek_v32", 2, false, "", 2, false, 16},
                                           Case{"kimi_k3_1_pro", 4, false, "", 4, false, 16},
                                           Case{"kimi_linear", 2, false, "", 2, false, 1}),
                         [](const auto& info) {
                           return info.param.fixture + (info.param.expert_parallel ? "_ep" : "_tp") +
                                  std::to_string(info.param.size) +
                                  (info.param.dcp > 1 ? "_dcp" + std::to_string(info.param.dcp) : "") +
                                  (info.param.indexer_decode_cp ? "_indexer_dcp" : "") +
                                  (info.param.token_sharded_prefill_rows
                                       ? "_token_sharded" + std::to_string(info.param.token_sharded_prefill_rows)
                                       : "");
                         });

// DCP prefill without a merge (DCP over the whole TP group) is token-sharded prefill over the context
// gathered from the ranks' shares: the same bits as token-sharded prefill without DCP, for a first chunk and
// for a second one whose context is half in the cache already.
TEST(TensorParallelCpu, DcpPrefillWithoutAMergeIsBitwiseTheTokenShardedPrefill) {
  // (Named fields, not a structured binding: clang before 16 cannot capture one in the lambda below.)
  struct Layout {
    std::string fixture;
    int size;
  };
  for (const Layout& layout : {Layout{"deepseek_v32", 2}, Layout{"kimi_k3_1_pro", 4}}) {
    const std::string& fixture = layout.fixture;
    const int size = layout.size;
    const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / fixture;
    const std::vector<Tokens> prompts = model_test::token_lists(dir / "prompts.json", "prompts");
    EXPECT_EQ(run_ranks(size,
                        [&](const TensorParallel& tp) {
                          TensorParallel plain = tp;  // the same group without DCP
                          plain.dcp_rank = 0, plain.dcp_size = 1, plain.dcp_comm = nullptr;
                          LoadOptions with_dcp, without;
                          with_dcp.tensor_parallel = tp;
                          without.tensor_parallel = plain;
                          std::unique_ptr<Model> a = load_model(dir.string(), Device::Cpu, with_dcp);
                          std::unique_ptr<Model> b = load_model(dir.string(), Device::Cpu, without);
                          ModelRunner run_a(*a), run_b(*b);
                          std::vector<SequenceState> seqs_a, seqs_b;
                          for (size_t i = 0; i < prompts.size(); ++i) {
                            seqs_a.push_back(run_a.new_sequence());
                            seqs_b.push_back(run_b.new_sequence());
                          }
                          for (int chunk = 0; chunk < 2; ++chunk) {
                            std::vector<std::pair<SequenceState*, Tokens>> parts_a, parts_b;
                            for (size_t i = 0; i < prompts.size(); ++i) {
                              const size_t half = prompts[i].size() / 2;
                              const Tokens part = chunk == 0 ? Tokens(prompts[i].begin(), prompts[i].begin() + half)
                                                             : Tokens(prompts[i].begin() + half, prompts[i].end());
                              parts_a.emplace_back(&seqs_a[i], part);
                              parts_b.emplace_back(&seqs_b[i], part);
                            }
                            Batch batch_a = make_batch(parts_a), batch_b = make_batch(parts_b);
                            const Tensor x = run_a.run(batch_a), y = run_b.run(batch_b);
                            SPARROW_CHECK(x.shape() == y.shape() &&
                                              std::memcmp(x.data(), y.data(), sizeof(float) * x.numel()) == 0,
                                          fixture, " chunk ", chunk, ": DCP prefill differs from token-sharded prefill");
                          }
                        },
                        false, size, false, 1),
              "")
        << fixture;
  }
}

// vLLM's deal of whole experts (fused_moe/layer.py determine_expert_map): E / size each, the first E % size
// ranks one more, contiguous and covering every expert once.
TEST(TensorParallelCpu, ExpertShareDealsEveryExpertOnce) {
  for (int size : {1, 2, 3, 4, 8})
    for (int64_t experts : {8, 16, 10, 61}) {
      int64_t next = 0;
      for (int rank = 0; rank < size; ++rank) {
        const IndexRange mine = expert_share(TensorParallel{rank, size, nullptr, true}, experts);
        EXPECT_EQ(mine.begin, next);
        EXPECT_EQ(mine.count(), experts / size + (rank < experts % size ? 1 : 0)) << experts << " over " << size;
        next = mine.end;
      }
      EXPECT_EQ(next, experts);
    }
  EXPECT_THROW(expert_share(TensorParallel{0, 16, nullptr, true}, 8), Error);
}

// A group whose size does not divide the heads is refused at load with the flag to change.
TEST(TensorParallelCpu, SizeThatDoesNotDivideTheHeadsIsAnError) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3";
  EXPECT_EQ(run_ranks(3,
                      [&](const TensorParallel& tp) {
                        LoadOptions options;
                        options.tensor_parallel = tp;
                        try {
                          load_model(dir.string(), Device::Cpu, options);
                        } catch (const Error& e) {
                          if (std::string(e.what()).find("--tensor-parallel-size") != std::string::npos) return;
                          throw;
                        }
                        throw std::runtime_error("loaded with 4 heads over 3 ranks");
                      }),
            "");
}

}  // namespace
