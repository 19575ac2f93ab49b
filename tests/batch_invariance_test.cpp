// Batch invariance on the CPU (issue 29): a request's tokens and log-probabilities are bitwise the same
// whatever else shares its steps. The CPU products run in fixed row tiles (kernels/cpu/reference_ops.cpp),
// attention, norms, the indexers and MoE work row by row, and KDA runs its exact token-serial recurrence,
// so nothing about a row's arithmetic depends on the batch. Checked for every family on 16 requests of mixed
// lengths (past the sparse budgets) and sampling (greedy, seeded, top-k / top-p, penalties):
//   - alone (one request at a time) against all 16 in one batch, in small chunked-prefill steps, and again
//     after the prefix cache holds their prompts (a hit resumes KDA from a snapshot);
//   - the score of each sampled sequence (prompt + completion with prompt_logprobs) against the logprobs
//     recorded while sampling it: the trainer's forward pass of an RL step reproduces the rollout's.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/engine_core.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

using Choice = sparrow::testing::Gathered;
using Outputs = sparrow::testing::GatheredOutputs;

std::vector<Request> mixed_requests(int64_t vocab) {
  std::mt19937 rng(29);
  std::vector<Request> requests;
  for (int i = 0; i < 16; ++i) {
    Tokens prompt(size_t(3 + (i * 37) % 150));
    for (int32_t& id : prompt) id = int32_t(2 + rng() % uint32_t(vocab - 2));
    Request r{"r" + std::to_string(i), prompt, {}};
    r.params.max_tokens = 12;
    r.params.ignore_eos = true;
    r.params.logprobs = 3;
    if (i % 2) {
      r.params.temperature = 0.9f;
      r.params.seed = uint64_t(100 + i);
    } else {
      r.params.temperature = 0;
    }
    if (i % 4 == 1) r.params.top_k = 20, r.params.top_p = 0.9f;
    if (i % 4 == 3) r.params.repetition_penalty = 1.2f, r.params.presence_penalty = 0.3f;
    requests.push_back(r);
  }
  return requests;
}

EngineConfig config_of(int64_t max_num_seqs, int64_t step_tokens) {
  EngineConfig config;
  config.max_model_len = 256;
  config.max_num_seqs = max_num_seqs;
  config.max_num_batched_tokens = step_tokens;
  config.cache.block_size = 16;
  config.cache.max_num_seqs = 16;
  config.cache.memory_bytes = int64_t(256) << 20;
  return config;
}

// Runs the requests `rounds` times through one engine (later rounds hit the prefix cache), keeping the last.
Outputs run(Model& model, const std::vector<Request>& requests, EngineConfig config, int rounds = 1) {
  EngineCore engine(model, nullptr, config);
  Outputs out;
  for (int round = 0; round < rounds; ++round) {
    out.clear();
    for (const Request& r : requests) sparrow::testing::add_gathering(engine, r, out);
    while (engine.step()) {
    }
  }
  return out;
}

// Every request alone: one sequence at a time, nothing cached.
Outputs run_alone(Model& model, const std::vector<Request>& requests) {
  EngineConfig config = config_of(1, 4096);
  config.cache.enable_prefix_caching = false;
  Outputs out;
  for (const Request& r : requests) out[r.id] = run(model, {r}, config).at(r.id);
  return out;
}

bool same(const TokenLogprob& a, const TokenLogprob& b) {
  return a.token == b.token && a.logprob == b.logprob && a.rank == b.rank && a.top == b.top;
}

void expect_bitwise_equal(const Outputs& got, const Outputs& want, const std::string& what) {
  for (const auto& [id, w] : want) {
    const Choice& g = got.at(id);
    EXPECT_EQ(g.tokens, w.tokens) << what << ": " << id;
    ASSERT_EQ(g.logprobs.size(), w.logprobs.size()) << what << ": " << id;
    for (size_t i = 0; i < w.logprobs.size(); ++i)
      EXPECT_TRUE(same(g.logprobs[i], w.logprobs[i]))
          << what << ": " << id << " token " << i << ": logprob " << g.logprobs[i].logprob << " against "
          << w.logprobs[i].logprob;
  }
}

class BatchInvariance : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(BatchInvariance, LogprobsAreTheSameAloneBatchedChunkedAndAfterAPrefixHit) {
  auto model = load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam()).string());
  const std::vector<Request> requests = mixed_requests(model->vocab_size());
  const Outputs alone = run_alone(*model, requests);
  expect_bitwise_equal(run(*model, requests, config_of(16, 4096)), alone, "batched");
  expect_bitwise_equal(run(*model, requests, config_of(16, 7)), alone, "chunked in steps of 7 tokens");
  expect_bitwise_equal(run(*model, requests, config_of(16, 4096), 2), alone, "after a prefix hit");

  // The score of a sampled sequence: prompt + completion, prompt_logprobs, in one batch (the trainer's
  // forward pass of an RL step). Completion token i's prompt logprob is the one recorded while sampling it.
  std::vector<Request> scoring;
  for (const Request& r : requests) {
    Request s{r.id, r.prompt, {}};
    const Choice& sampled = alone.at(r.id);
    s.prompt.insert(s.prompt.end(), sampled.tokens.begin(), sampled.tokens.end());
    s.params.max_tokens = 1;
    s.params.temperature = 0;
    s.params.prompt_logprobs = 3;
    scoring.push_back(s);
  }
  const Outputs scored = run(*model, scoring, config_of(16, 4096));
  for (const Request& r : requests) {
    const Choice& sampled = alone.at(r.id);
    const std::vector<std::optional<TokenLogprob>>& prompt_logprobs = scored.at(r.id).prompt_logprobs;
    // prompt_logprobs has one entry per prompt token, the first empty: completion token i is entry
    // prompt.size() + i.
    ASSERT_EQ(prompt_logprobs.size(), r.prompt.size() + sampled.tokens.size()) << r.id;
    for (size_t i = 0; i < sampled.tokens.size(); ++i) {
      const std::optional<TokenLogprob>& score = prompt_logprobs[r.prompt.size() + i];
      ASSERT_TRUE(score.has_value()) << r.id;
      EXPECT_EQ(score->token, sampled.tokens[i]) << r.id;
      EXPECT_EQ(score->logprob, sampled.logprobs[i].logprob) << r.id << " token " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, BatchInvariance,
                         ::testing::Values("deepseek_v32", "kimi_linear", "kimi_k3", "kimi_k3_1_pro", "minimax_m3"));
