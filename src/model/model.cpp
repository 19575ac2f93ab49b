#include "model/model.h"

#include "core/error.h"
#include "formats/checkpoint.h"
#include "model/dense_sequence_cache.h"
#include "model/families.h"

namespace sparrow {

SequenceState standalone_sequence(std::vector<LayerCacheSpec> spec) {
  SequenceState s;
  s.owned_cache = std::make_unique<DenseSequenceCache>(std::move(spec));
  s.cache = s.owned_cache.get();
  return s;
}

Batch make_batch(const std::vector<std::pair<SequenceState*, std::vector<int32_t>>>& parts) {
  Batch batch;
  for (const auto& [state, tokens] : parts) {
    SPARROW_CHECK(!tokens.empty(), "a sequence in the batch has no new tokens");
    SPARROW_CHECK(state->cache != nullptr, "a sequence in the batch has no cache");
    batch.seqs.push_back(SeqSlice{state, batch.size(), int64_t(tokens.size())});
    for (size_t i = 0; i < tokens.size(); ++i) {
      batch.tokens.push_back(tokens[i]);
      batch.positions.push_back(state->length + int64_t(i));
    }
  }
  return batch;
}

std::unique_ptr<Model> load_model(const std::string& dir) {
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::open(dir);
  const Config& config = ckpt->config();
  const std::string type = config.get_string("model_type");
  if (type == "deepseek_v32") return load_deepseek_v32(*ckpt);
  if (type == "kimi_linear" || type == "kimi_k3") return load_kimi_linear(*ckpt);
  // MiniMax-M3: the text-only causal LM, or the text half of a vision-language checkpoint.
  if (type == "minimax_m3_vl_text" || type == "minimax_m3") return load_minimax_m3(*ckpt, config, "model.");
  if (type == "minimax_m3_vl")
    return load_minimax_m3(*ckpt, config.get_object("text_config"), "model.language_model.");
  config.unsupported("model_type", type, "deepseek_v32, kimi_linear, kimi_k3, minimax_m3_vl_text, minimax_m3_vl");
}

// Dispatches like load_model.
std::vector<LayerCacheSpec> cache_spec_from_config(const Config& config) {
  const std::string type = config.get_string("model_type");
  if (type == "deepseek_v32") return deepseek_v32_cache_spec(config);
  if (type == "kimi_linear" || type == "kimi_k3") return kimi_linear_cache_spec(config);
  if (type == "minimax_m3_vl_text" || type == "minimax_m3") return minimax_m3_cache_spec(config);
  if (type == "minimax_m3_vl") return minimax_m3_cache_spec(config.get_object("text_config"));
  config.unsupported("model_type", type, "deepseek_v32, kimi_linear, kimi_k3, minimax_m3_vl_text, minimax_m3_vl");
}

}  // namespace sparrow
