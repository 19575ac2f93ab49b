#include "engine/generate.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace sparrow {

std::vector<std::vector<int32_t>> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& options) {
  SPARROW_CHECK(options.max_tokens >= 0, "max_tokens must be >= 0, got ", options.max_tokens);
  validate(options.sampling);
  const size_t n = prompts.size();
  std::vector<std::vector<int32_t>> out(n);
  if (options.max_tokens == 0 || n == 0) return out;
  std::vector<SequenceState> states;
  std::vector<Sampler> samplers;
  for (size_t i = 0; i < n; ++i) {
    SPARROW_CHECK(!prompts[i].empty(), "prompt ", i, " is empty");
    states.push_back(model.new_sequence());
    // Each sequence draws from its own generator; with a seed, prompt i uses seed + i.
    SamplingParams p = options.sampling;
    if (p.seed) *p.seed += i;
    samplers.emplace_back(p);
  }
  std::vector<bool> done(n, false);
  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> step;
  for (size_t i = 0; i < n; ++i) step.push_back({&states[i], prompts[i]});
  while (!step.empty()) {
    Batch batch = make_batch(step);
    batch.all_logits = false;
    Tensor logits = model.forward(batch);
    std::vector<std::pair<SequenceState*, std::vector<int32_t>>> next;
    for (size_t j = 0; j < step.size(); ++j) {
      size_t i = size_t(step[j].first - states.data());
      int32_t token = samplers[i].sample(logits.row(int64_t(j)), logits.dim(1));
      out[i].push_back(token);
      if (int64_t(out[i].size()) >= options.max_tokens || options.stop_token_ids.count(token)) continue;
      next.push_back({&states[i], {token}});
    }
    step = std::move(next);
  }
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
