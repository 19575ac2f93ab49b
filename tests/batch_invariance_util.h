// Batch invariance (issue 29), checked the same way on both devices (tests/batch_invariance_test.cpp on the
// CPU, tests/cuda/batch_invariance_gpu_test.cpp on the GPU in batch-invariant mode): 16 requests of mixed
// lengths (past the fixtures' sparse budgets) and sampling (greedy, seeded, top-k / top-p, penalties) give
// bitwise the same tokens and log-probabilities
//   - alone (one request at a time) and all 16 in one batch, in small chunked-prefill steps, and again
//     after the prefix cache holds their prompts (a hit resumes KDA from a snapshot);
//   - and the score of each sampled sequence (prompt + completion with prompt_logprobs) equals the
//     logprobs recorded while sampling it: the trainer's forward pass of an RL step reproduces the rollout's.
// With LoRA adapters given, the requests take turns: the base model, then each adapter (mixed in every batch).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/engine_core.h"
#include "model/model.h"
#include "test_util.h"

namespace sparrow::testing {

inline std::vector<Request> invariance_requests(int64_t vocab,
                                                const std::vector<std::shared_ptr<const LoraAdapter>>& adapters = {}) {
  std::mt19937 rng(29);
  std::vector<Request> requests;
  for (int i = 0; i < 16; ++i) {
    std::vector<int32_t> prompt(size_t(3 + (i * 37) % 150));
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
    const size_t turn = size_t(i) % (adapters.size() + 1);
    if (turn > 0) r.lora = adapters[turn - 1];
    requests.push_back(r);
  }
  return requests;
}

inline EngineConfig invariance_config(int64_t max_num_seqs, int64_t step_tokens, int block_size) {
  EngineConfig config;
  config.max_model_len = 256;
  config.max_num_seqs = max_num_seqs;
  config.max_num_batched_tokens = step_tokens;
  config.cache.block_size = block_size;
  config.cache.max_num_seqs = 16;
  config.cache.memory_bytes = int64_t(256) << 20;
  return config;
}

// Runs the requests `rounds` times through one engine (later rounds hit the prefix cache), keeping the last.
inline GatheredOutputs run_invariance(Model& model, const std::vector<Request>& requests, EngineConfig config,
                                      int rounds = 1) {
  EngineCore engine(model, nullptr, config);
  GatheredOutputs out;
  for (int round = 0; round < rounds; ++round) {
    out.clear();
    for (const Request& r : requests) add_gathering(engine, r, out);
    while (engine.step()) {
    }
  }
  return out;
}

// How many requests of `got` differ from `want` in any token or logprob (value, rank or top list); the
// first difference is described in `first` when that is still empty.
inline int count_differences(const GatheredOutputs& got, const GatheredOutputs& want, const std::string& what,
                             std::string& first) {
  auto same = [](const TokenLogprob& a, const TokenLogprob& b) {
    return a.token == b.token && a.logprob == b.logprob && a.rank == b.rank && a.top == b.top;
  };
  int differing = 0;
  for (const auto& [id, w] : want) {
    const Gathered& g = got.at(id);
    std::string why;
    if (g.tokens != w.tokens) why = "tokens differ";
    for (size_t i = 0; why.empty() && i < std::min(g.logprobs.size(), w.logprobs.size()); ++i)
      if (!same(g.logprobs[i], w.logprobs[i]))
        why = "token " + std::to_string(i) + ": logprob " + std::to_string(g.logprobs[i].logprob) + " against " +
              std::to_string(w.logprobs[i].logprob);
    if (why.empty() && g.logprobs.size() != w.logprobs.size()) why = "logprob counts differ";
    if (why.empty()) continue;
    ++differing;
    if (first.empty()) first = what + ": " + id + ": " + why;
  }
  return differing;
}

struct InvarianceReport {
  int batched = 0, chunked = 0, prefix_hit = 0, scored = 0;  // requests that differ from their run alone
  std::string first;                                          // the first difference found
  bool invariant() const { return batched + chunked + prefix_hit + scored == 0; }
};

inline InvarianceReport batch_invariance_report(Model& model, int block_size,
                                                const std::vector<std::shared_ptr<const LoraAdapter>>& adapters = {}) {
  const std::vector<Request> requests = invariance_requests(model.vocab_size(), adapters);
  InvarianceReport report;
  GatheredOutputs alone;
  {
    // Every request alone: one sequence at a time, nothing cached.
    EngineConfig config = invariance_config(1, 4096, block_size);
    config.cache.enable_prefix_caching = false;
    for (const Request& r : requests) alone[r.id] = run_invariance(model, {r}, config).at(r.id);
  }
  report.batched = count_differences(run_invariance(model, requests, invariance_config(16, 4096, block_size)), alone,
                                     "batched", report.first);
  report.chunked = count_differences(run_invariance(model, requests, invariance_config(16, 7, block_size)), alone,
                                     "chunked in steps of 7 tokens", report.first);
  report.prefix_hit = count_differences(
      run_invariance(model, requests, invariance_config(16, 4096, block_size), 2), alone, "after a prefix hit",
      report.first);

  // The score of a sampled sequence: prompt + completion, prompt_logprobs, in one batch (the trainer's
  // forward pass of an RL step). Completion token i's prompt logprob is the one recorded while sampling it.
  std::vector<Request> scoring;
  for (const Request& r : requests) {
    Request s{r.id, r.prompt, {}};
    s.lora = r.lora;
    const Gathered& sampled = alone.at(r.id);
    s.prompt.insert(s.prompt.end(), sampled.tokens.begin(), sampled.tokens.end());
    s.params.max_tokens = 1;
    s.params.temperature = 0;
    s.params.prompt_logprobs = 3;
    scoring.push_back(s);
  }
  const GatheredOutputs scored = run_invariance(model, scoring, invariance_config(16, 4096, block_size));
  for (const Request& r : requests) {
    const Gathered& sampled = alone.at(r.id);
    // prompt_logprobs has one entry per prompt token, the first empty: completion token i is entry
    // prompt.size() + i.
    const std::vector<std::optional<TokenLogprob>>& prompt_logprobs = scored.at(r.id).prompt_logprobs;
    std::string why;
    if (prompt_logprobs.size() != r.prompt.size() + sampled.tokens.size()) why = "prompt logprob count";
    for (size_t i = 0; why.empty() && i < sampled.tokens.size(); ++i) {
      const std::optional<TokenLogprob>& score = prompt_logprobs[r.prompt.size() + i];
      if (!score || score->token != sampled.tokens[i] || score->logprob != sampled.logprobs[i].logprob)
        why = "token " + std::to_string(i) + ": scored " + (score ? std::to_string(score->logprob) : "nothing") +
              " against sampled " + std::to_string(sampled.logprobs[i].logprob);
    }
    if (why.empty()) continue;
    ++report.scored;
    if (report.first.empty()) report.first = "the score of the sampled sequence: " + r.id + ": " + why;
  }
  return report;
}

}  // namespace sparrow::testing
