// What the tests of the drafters that read the target (MTP: tests/mtp_test.cpp, DSpark: tests/dspark_test.cpp)
// share: a roomy cache, a sequence held as the engine holds one, one target step observed by a proposer, the
// engine's tokens for a set of requests, the squeezed engine that preempts and hits the prefix cache, the
// line `generate` prints about speculation, and the DSpark fixtures' reference cases (also read by
// tests/cuda/speculative_gpu_test.cpp).
#pragma once
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "cuda/model_test_util.h"
#include "engine/engine_core.h"
#include "engine/sequence.h"
#include "engine/speculative.h"
#include "formats/safetensors.h"
#include "model/dspark.h"
#include "runner/model_runner.h"
#include "runner/step_inputs.h"

namespace sparrow::testing {

inline CacheConfig roomy_cache(bool prefix_caching) {
  CacheConfig config;
  config.block_size = 16;
  config.kv_cache_dtype = "float32";
  config.max_num_seqs = 8;
  config.enable_prefix_caching = prefix_caching;
  config.memory_bytes = int64_t(64) << 20;
  return config;
}

// A sequence of `prompt` in `cache`, as the engine holds one (the request must outlive it).
struct Held {
  Request request;
  std::unique_ptr<Sequence> seq;
  Held(KvCache& cache, const std::vector<int32_t>& prompt) : request{"r", prompt, {}} {
    seq = std::make_unique<Sequence>(request, 0, std::vector<int32_t>{}, nullptr);
    seq->cache_id = cache.create_sequence();
    seq->state.cache = cache.view(seq->cache_id);
  }
};

// Runs `seq`'s tokens from its length up to `end` as one target step (hidden states kept), lets the proposer
// observe it and commits, as EngineCore::step does; samples the greedy next token when the prompt is done.
inline void target_step(ModelRunner& target, KvCache& cache, DraftProposer& proposer, Sequence& seq, int64_t end) {
  const int64_t start = seq.num_computed();
  ASSERT_TRUE(cache.allocate(seq.cache_id, end + 4));
  Batch batch = make_batch({{&seq.state, std::vector<int32_t>(seq.tokens.begin() + start, seq.tokens.begin() + end)}});
  batch.all_logits = false;
  batch.keep_hidden_states = true;
  const Tensor logits = target.run(batch);
  if (end == int64_t(seq.tokens.size())) seq.tokens.push_back(model_test::argmax(logits.row(0), logits.dim(1)));
  Sequence* seqs[] = {&seq};
  const int64_t kept[] = {seq.num_computed()};
  proposer.observe(batch, seqs, kept);
  cache.commit_tokens(seq.cache_id, seq.tokens, seq.num_computed());
}

// The greedy requests of the engine tests: each prompt twice (the copy hits the prefix cache), 24 tokens.
inline std::vector<Request> twice_each(const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<Request> requests;
  for (const std::vector<int32_t>& prompt : prompts)
    for (int copy = 0; copy < 2; ++copy) {
      Request r{"r" + std::to_string(requests.size()), prompt, {}};
      r.params.temperature = 0;
      r.params.max_tokens = 24;
      r.params.ignore_eos = true;
      requests.push_back(r);
    }
  return requests;
}

// Every request's tokens from an engine of `config` on `model`; every block is free at the end.
inline std::map<std::string, std::vector<int32_t>> engine_tokens(Model& model, const std::vector<Request>& requests,
                                                                 const EngineConfig& config, EngineStats* stats) {
  EngineCore engine(model, nullptr, config);
  std::map<std::string, std::vector<int32_t>> out;
  for (const Request& r : requests)
    engine.add(r, [&](const RequestOutput& e) {
      out[e.request_id].insert(out[e.request_id].end(), e.new_tokens.begin(), e.new_tokens.end());
    });
  while (engine.step()) {
  }
  EXPECT_EQ(engine.cache().num_free_blocks(), engine.cache().plan().num_blocks);
  if (stats) *stats = engine.stats();
  return out;
}

// The engine the drafter tests compare against, and the same squeezed: 3 sequences, 13 tokens a step, 45 blocks
// of 4 (180 tokens for about 320: preemption).
inline EngineConfig roomy_engine() {
  EngineConfig config;
  config.max_model_len = 160;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 4096;
  config.cache = roomy_cache(true);
  return config;
}
inline void squeeze(EngineConfig& config) {
  config.max_num_seqs = 3;
  config.max_num_batched_tokens = 13;
  config.cache.block_size = 4;
  config.cache.memory_bytes = 0;
  config.cache.num_blocks = 45;
}

// The line `generate` prints about speculation (the drafts verified and accepted), empty without one.
inline std::string speculation_line(const std::string& err) {
  const size_t at = err.find("sparrow: speculative decoding");
  return at == std::string::npos ? "" : err.substr(at, err.find('\n', at) - at);
}

// A DSpark fixture's case (tools/make_dspark_fixture.py, tools/make_qwen3_dspark_fixture.py): a prompt, the
// target's greedy next token (the block's bonus), the reference drafts (target ids) with each decision's
// top-1 - top-2 margin, and the reference tensors: the target's captured streams [n, width], the block's
// base logits and its logits with the Markov bias [k, draft vocabulary].
struct DSparkCase {
  std::vector<int32_t> prompt, drafts;
  std::vector<int32_t> base_argmax;  // each query's best base logit (a draft id), before the Markov bias
  std::vector<float> draft_gaps;
  int32_t bonus = 0;
  Tensor aux, base_logits, markov_logits;
};

inline std::vector<DSparkCase> read_dspark_cases(const std::filesystem::path& dir) {
  std::ifstream in(dir / "fixture.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  std::shared_ptr<SafetensorsFile> file = SafetensorsFile::open((dir / "dspark_reference.safetensors").string());
  std::vector<DSparkCase> cases;
  for (const nlohmann::json& c : j["cases"]) {
    const std::string i = std::to_string(cases.size());
    DSparkCase one;
    one.prompt = c["prompt"].get<std::vector<int32_t>>();
    one.drafts = c["drafts"].get<std::vector<int32_t>>();
    one.draft_gaps = c["draft_gaps"].get<std::vector<float>>();
    one.base_argmax = c["base_argmax"].get<std::vector<int32_t>>();
    one.bonus = c["bonus"].get<int32_t>();
    one.aux = to_float32(file->tensors().at("aux." + i), file);
    one.base_logits = to_float32(file->tensors().at("base_logits." + i), file);
    one.markov_logits = to_float32(file->tensors().at("markov_logits." + i), file);
    cases.push_back(std::move(one));
  }
  return cases;
}

// The drafter's base logits for a case's block: its context rows written from the reference's target streams
// (c.aux) at the prompt's positions, then the block [bonus, mask x (k - 1)] right after them, a new sequence of
// `cache` (on the drafter's device) holding both.
inline Tensor dspark_block_logits(DSparkDrafter& drafter, ModelRunner& runner, KvCache& cache, const DSparkCase& c,
                                  int64_t k) {
  const int64_t n = int64_t(c.prompt.size());
  const SeqId id = cache.create_sequence();
  SPARROW_CHECK(cache.allocate(id, n + k), "dspark_block_logits: no room for ", n + k, " rows");
  SequenceState context_state;
  context_state.cache = cache.view(id);
  Batch context = make_batch({{&context_state, c.prompt}});
  context.hidden_states_in = c.aux;
  if (drafter.device() != Device::Cpu) attach_device_step(context, drafter.device());
  drafter.store_context(context);
  SequenceState block_state;
  block_state.length = n;
  block_state.cache = cache.view(id);
  std::vector<int32_t> tokens(size_t(k), drafter.mask_token);
  tokens[0] = c.bonus;
  Batch block = make_batch({{&block_state, tokens}});
  block.all_logits = true;
  return runner.run(block);
}

}  // namespace sparrow::testing
