#include "cli/text_generation.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/ops.h"

namespace sparrow::cli {
namespace {

nlohmann::json read_json_object(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded() && j.is_object(), path.string(), ": not a JSON object");
  return j;
}

}  // namespace

int64_t context_length(const std::string& model_dir) {
  nlohmann::json config = read_json_object(std::filesystem::path(model_dir) / "config.json");
  for (const char* key : {"max_position_embeddings", "model_max_length"})
    if (config.contains(key) && config[key].is_number_integer() && config[key].get<int64_t>() > 0)
      return config[key].get<int64_t>();
  return 1024;
}

std::vector<int32_t> text_prompt_ids(const Tokenizer& tokenizer, const std::string& model_dir, const std::string& text) {
  std::vector<int32_t> ids = tokenizer.encode(text);
  nlohmann::json config = read_json_object(std::filesystem::path(model_dir) / "tokenizer_config.json");
  if (config.value("add_bos_token", false)) {
    SPARROW_CHECK(tokenizer.bos_id(), model_dir, "/tokenizer_config.json: add_bos_token is set but bos_token is unknown");
    ids.insert(ids.begin(), *tokenizer.bos_id());
  }
  return ids;
}

std::vector<int32_t> generate_streaming(Model& model, const std::vector<int32_t>& prompt,
                                        const SamplingParams& sampling, const std::set<int32_t>& end_tokens,
                                        int64_t max_tokens, int64_t context,
                                        const std::function<void(int32_t)>& on_token) {
  SPARROW_CHECK(!prompt.empty(), "the prompt is empty (it tokenizes to no tokens)");
  SPARROW_CHECK(int64_t(prompt.size()) < context, "the prompt has ", prompt.size(),
                " tokens, more than the model's context of ", context, " leaves room for");
  for (int32_t id : prompt)
    SPARROW_CHECK(id >= 0 && id < model.vocab_size(), "prompt token ", id, " is outside the model's vocabulary (",
                  model.vocab_size(), ")");
  Sampler sampler(sampling, std::vector<int32_t>(end_tokens.begin(), end_tokens.end()));
  SequenceState state = model.new_sequence();
  std::vector<int32_t> output;
  std::vector<int32_t> next_input = prompt;
  const int64_t room = std::min(max_tokens, context - int64_t(prompt.size()));
  while (int64_t(output.size()) < room) {
    Batch batch = make_batch({{&state, next_input}});
    batch.all_logits = false;  // only the last position's logits are sampled
    Tensor logits = model.forward(batch);  // [1, vocab] where the model runs
    std::vector<TokenDraw> draws;
    std::vector<LogitAdjustment> adjustments;
    sampler.prepare(0, prompt, output, draws, adjustments);
    const int32_t token = ops::sample_tokens(logits, draws, adjustments)[0];
    output.push_back(token);
    on_token(token);
    if (end_tokens.count(token)) break;
    next_input = {token};
  }
  return output;
}

void write_now(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace sparrow::cli
