// One loader per family (src/model/<family>.cpp). Each reads its config, takes its weights, checks the
// config for values it does not support, and calls ckpt.finish(). Each also says what its layers cache
// from the config alone (for the cache planner). The registry below maps model_type to them.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "formats/checkpoint.h"
#include "formats/config.h"
#include "model/decoder.h"
#include "model/feed_forward.h"
#include "model/mtp.h"

namespace sparrow {

// Every loader takes the checkpoint, the config holding the text model's fields (the whole config.json,
// or its text_config for a vision-language checkpoint) and where the text model's weights live
// ("model.", "model.language_model."); every cache spec reads the same config, without weights.
using FamilyLoader = std::unique_ptr<DecoderModel> (*)(Checkpoint& ckpt, const Config& text, const std::string& prefix);
using FamilyCacheSpec = std::vector<LayerCacheSpec> (*)(const Config& text);
// The family's multi-token-prediction layer as a speculative drafter (model/mtp.h); the other weights are left.
using MtpLoader = std::unique_ptr<MtpDrafter> (*)(Checkpoint& ckpt, const Config& text, const std::string& prefix);
// A vision-language checkpoint's tower (model/vision_encoder.h) from its folder, its weights on `device` (the
// model's), or dummy weights for a config with a vision_config (--load-format dummy, as the text model's); null
// when the folder holds none (a text-only export of the same model type).
using VisionLoader = std::unique_ptr<VisionEncoder> (*)(const std::string& dir, Device device, bool dummy);

std::unique_ptr<DecoderModel> load_deepseek_v32(Checkpoint& ckpt, const Config& text, const std::string& prefix);
// kimi_linear (as transformers defines it) and kimi_k3 (the release, as vLLM defines it), one file.
std::unique_ptr<DecoderModel> load_kimi_linear(Checkpoint& ckpt, const Config& text, const std::string& prefix);
std::unique_ptr<DecoderModel> load_kimi_k3(Checkpoint& ckpt, const Config& text, const std::string& prefix);
std::unique_ptr<DecoderModel> load_minimax_m3(Checkpoint& ckpt, const Config& text, const std::string& prefix);

// Kimi K3's gated activation (hidden_act silu, or situ with activation_situ_beta / _linear_beta): its MLPs', and
// the DSpark drafter's (model/dspark.h, whose KimiMLP reads the same fields).
Activation kimi_k3_activation(const Config& config);

std::unique_ptr<MtpDrafter> load_deepseek_v32_mtp(Checkpoint& ckpt, const Config& text, const std::string& prefix);
std::unique_ptr<MtpDrafter> load_kimi_k3_mtp(Checkpoint& ckpt, const Config& text, const std::string& prefix);
std::unique_ptr<MtpDrafter> load_minimax_m3_mtp(Checkpoint& ckpt, const Config& text, const std::string& prefix);

std::unique_ptr<VisionEncoder> load_minimax_m3_vision(const std::string& dir, Device device, bool dummy);
std::unique_ptr<VisionEncoder> load_kimi_k3_vision(const std::string& dir, Device device, bool dummy);

std::vector<LayerCacheSpec> deepseek_v32_cache_spec(const Config& text);
std::vector<LayerCacheSpec> kimi_linear_cache_spec(const Config& text);
std::vector<LayerCacheSpec> kimi_k3_cache_spec(const Config& text);
std::vector<LayerCacheSpec> minimax_m3_cache_spec(const Config& text);

// The model registry: one row per config.json model_type, the only place a model_type is dispatched
// (load_model, cache_spec_from_config, bench's roofline, the tests). A new family is its file plus a row.
struct ModelFamily {
  const char* model_type;
  const char* family;         // the family file under src/model/ ("kimi_linear" serves kimi_k3 too)
  const char* text_config;    // nullptr: the text fields are at the top level; else the nested object's key
  const char* weight_prefix;  // where the text model's weights live
  FamilyLoader load;
  FamilyCacheSpec cache_spec;
  MtpLoader load_mtp = nullptr;  // nullptr: no MTP drafter in sparrow yet
  VisionLoader load_vision = nullptr;  // nullptr: no vision tower in sparrow (yet)

  // The config holding the text model's fields.
  Config text(const Config& config) const { return text_config ? config.get_object(text_config) : config; }
};

// The registry's row for config.json's model_type; a one-line error naming the supported types otherwise.
const ModelFamily& model_family(const Config& config);

}  // namespace sparrow
