// One loader per family (src/model/<family>.cpp). Each reads its config through `ckpt.config()`,
// takes its weights, checks the config for values it does not support, and calls ckpt.finish().
// Each also says what its layers cache from the config alone (for the cache planner).
#pragma once
#include <memory>

#include "formats/checkpoint.h"
#include "model/decoder.h"

namespace sparrow {

std::unique_ptr<DecoderModel> load_deepseek_v32(Checkpoint& ckpt);
// kimi_linear and kimi_k3 (kimi_linear + a DSA indexer on every full-attention layer).
std::unique_ptr<DecoderModel> load_kimi_linear(Checkpoint& ckpt);
// minimax_m3 text model: `text` is the config holding the text fields (the whole config.json, or its
// text_config for a minimax_m3_vl checkpoint); `prefix` is where the text weights live ("model." or
// "model.language_model." — whatever transformers writes for that architecture).
std::unique_ptr<DecoderModel> load_minimax_m3(Checkpoint& ckpt, const Config& text, const std::string& prefix);

// What each family's layers cache, from its config alone (the loaders' cache_spec() without weights;
// model.h cache_spec_from_config dispatches to these).
std::vector<LayerCacheSpec> deepseek_v32_cache_spec(const Config& config);
std::vector<LayerCacheSpec> kimi_linear_cache_spec(const Config& config);
std::vector<LayerCacheSpec> minimax_m3_cache_spec(const Config& text);

}  // namespace sparrow
