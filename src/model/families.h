// One loader per family (src/model/<family>.cpp). Each reads its config through `ckpt.config()`,
// takes its weights, checks the config for values it does not support, and calls ckpt.finish().
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

}  // namespace sparrow
