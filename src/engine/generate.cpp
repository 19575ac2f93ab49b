#include "engine/generate.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cache/planner.h"
#include "core/error.h"
#include "engine/engine_core.h"

namespace sparrow {

namespace {

// The serving engine's loop sized so that every prompt is prefilled in the first step and all decode
// together after it, with a cache just big enough for every sequence at its full length (prompt +
// max_tokens) and no prefix caching (nothing is shared or reused offline).
// The cache is planned for the layers the engine will cache (an MTP drafter's included).
EngineConfig offline_engine_config(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                   int64_t max_tokens, const GenerateOptions& options) {
  const int64_t speculative_tokens = options.speculative.num_speculative_tokens;
  EngineConfig config;
  config.speculative = options.speculative;
  config.draft_model = options.draft_model;
  config.max_num_seqs = int64_t(prompts.size());
  config.max_num_batched_tokens = 0;
  config.cache.enable_prefix_caching = false;
  config.cache.rollback_snapshots = speculative_tokens > 0;  // as the engine will plan it (engine_core.cpp)
  config.cache.max_num_seqs = config.max_num_seqs;
  config.cache.memory_bytes = int64_t(1) << 50;  // only to learn the row and slot sizes
  const CachePlan plan = plan_cache(engine_cache_spec(model, config), config.cache);
  int64_t blocks = 0;
  for (const auto& prompt : prompts) {
    const int64_t length = int64_t(prompt.size()) + max_tokens;
    config.max_num_batched_tokens += int64_t(prompt.size());
    config.max_model_len = std::max(config.max_model_len, length);
    blocks += (length + plan.block_size - 1) / plan.block_size;
  }
  config.cache.memory_bytes = blocks * plan.row_bytes + (plan.num_state_slots + plan.num_snapshot_slots) * plan.state_slot_bytes;
  // A decode step holds every sequence with all of its draft tokens.
  config.max_num_batched_tokens =
      std::max<int64_t>(config.max_num_batched_tokens, int64_t(prompts.size()) * (1 + speculative_tokens));
  return config;
}

}  // namespace

void generate(Model& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
              const OnGeneratedToken& on_token) {
  SPARROW_CHECK(options.max_tokens >= 0, "max_tokens must be >= 0, got ", options.max_tokens);
  if (options.max_tokens == 0 || prompts.empty()) return;

  EngineConfig config = offline_engine_config(model, prompts, options.max_tokens, options);
  // The stop ids become the engine's end-of-sequence ids and, with no tokenizer, its only ones: a sequence
  // ends right after one of them (kept in its tokens) and nowhere else, and they are masked until
  // min_tokens exist, as SamplingParams::stop_token_ids would be. The two differ only in the event's
  // stop_reason, not read here, and in ignore_eos switching these off (`sparrow generate --ignore-eos`
  // empties the set instead).
  config.eos_token_ids.assign(options.stop_token_ids.begin(), options.stop_token_ids.end());
  config.runner = options.runner;
  EngineCore engine(model, /*tokenizer=*/nullptr, config);
  bool step_failed = false;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request request{std::to_string(i), prompts[i], options.sampling, nullptr};
    request.params.max_tokens = options.max_tokens;
    SPARROW_CHECK(options.images.empty() || options.images.size() == prompts.size(), "generate: images for ",
                  options.images.size(), " prompts, not ", prompts.size());
    if (!options.images.empty()) request.images = options.images[i];
    SPARROW_CHECK(options.numbers.empty() || options.numbers.size() == prompts.size(), "generate: ", options.numbers.size(),
                  " prompt numbers for ", prompts.size(), " prompts");
    if (request.params.seed) *request.params.seed += options.numbers.empty() ? i : options.numbers[i];  // seed + its number
    engine.add(std::move(request), [&on_token, &step_failed, i](const RequestOutput& event) {
      for (int32_t token : event.new_tokens) on_token(i, token);
      step_failed |= event.finish_reason == "error";
    });
  }
  while (engine.step()) {
    // The engine ends a failed step's requests and goes on (a server must); here the output would be cut
    // short without a word, so the failure ends the generation.
    SPARROW_CHECK(!step_failed, "generation stopped: a step of the model failed (the cause is printed above)");
  }
  if (options.spec_stats) *options.spec_stats = engine.stats().spec_decode;
}

std::vector<std::vector<int32_t>> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& options) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  generate(model, prompts, options, [&out](size_t prompt, int32_t token) { out[prompt].push_back(token); });
  return out;
}

std::set<int32_t> eos_token_ids(const std::string& model_dir) {
  std::set<int32_t> ids;
  auto read = [&](const std::filesystem::path& path) {
    std::ifstream in(path);
    if (!in) return false;
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("eos_token_id")) return false;
    const auto& e = j["eos_token_id"];
    if (e.is_number_integer()) ids.insert(e.get<int32_t>());
    if (e.is_array())
      for (const auto& v : e)
        if (v.is_number_integer()) ids.insert(v.get<int32_t>());
    return !ids.empty();
  };
  if (!read(std::filesystem::path(model_dir) / "generation_config.json"))
    read(std::filesystem::path(model_dir) / "config.json");
  return ids;
}

}  // namespace sparrow
