#include "model/dspark.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/families.h"
#include "model/feed_forward.h"
#include "model/gqa_mixer.h"
#include "model/mla.h"

namespace sparrow {

std::vector<LayerCacheSpec> DSparkDrafter::cache_spec() const {
  std::vector<LayerCacheSpec> spec = target_cache_spec;
  for (const DecoderLayer& layer : layers) spec.push_back(layer.mixer->cache_spec());
  return spec;
}

Tensor DSparkDrafter::forward(const Batch& batch, StepMarks* marks) {
  Tensor x = placed_on != Device::Cpu ? ops::embedding(embed, device_step(batch).token_ids)
                                      : ops::embedding(embed, batch.tokens);
  x = residual_stack(layers, std::move(x), batch, {norm_eps, false, first_layer, "dspark "}, marks);
  if (!batch.all_logits) x = select_logit_rows(x, batch);
  ops::rms_norm_(x, final_norm, norm_eps);
  Tensor logits = ops::linear(x, lm_head, ScalarType::F32);
  if (logit_scale != 1.0f) ops::scale_(logits, logit_scale);
  return logits;
}

void DSparkDrafter::store_context(const Batch& batch) {
  const Tensor& aux = batch.hidden_states_in;
  SPARROW_CHECK(aux.defined() && aux.dim(0) == batch.size() && aux.dim(1) == context_proj.dim(1),
                "dspark: the context batch brings no target streams [", batch.size(), ", ", context_proj.dim(1), "]");
  Tensor c = ops::linear(aux.to(placed_on, embed.type()), context_proj);
  ops::rms_norm_(c, context_norm, norm_eps);
  for (size_t j = 0; j < layers.size(); ++j) layers[j].mixer->store_rows(c, batch, first_layer + int(j));
}

Tensor DSparkDrafter::markov_bias(const std::vector<int32_t>& previous) const {
  Tensor bias = ops::linear(ops::embedding(markov_w1, previous), markov_w2, ScalarType::F32);
  if (logit_scale != 1.0f) ops::scale_(bias, logit_scale);
  return bias;
}

int32_t DSparkDrafter::target_token(int32_t draft_id) const {
  return draft_to_target.empty() ? draft_id : int32_t(draft_id + draft_to_target[size_t(draft_id)]);
}

Tensor DSparkDrafter::target_logits(const Tensor& draft_logits) const {
  if (draft_to_target.empty()) return draft_logits;
  const int64_t rows = draft_logits.dim(0);
  Tensor out = Tensor::empty({rows, vocab});
  std::fill_n(out.data(), rows * vocab, -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < draft_vocab; ++d) out.row(r)[target_token(int32_t(d))] = draft_logits.row(r)[d];
  return out;
}

namespace {

// Where vLLM looks for a drafter's settings.
struct DraftSettings {
  Config config;
  Config dflash;  // dflash_config ({} when absent)
};

// The mask token, where vLLM's get_parallel_drafting_token_id looks for it.
int32_t mask_token_of(const DraftSettings& s, int64_t vocab) {
  const Config& config = s.config;
  const char* key = s.dflash.has("mask_token_id")          ? "mask_token_id"
                    : config.has("mask_token_id")         ? "mask_token_id"
                    : config.has("dspark_noise_token_id") ? "dspark_noise_token_id"
                                                          : nullptr;
  SPARROW_CHECK(key != nullptr, "speculative decoding: the DSpark config names no mask token "
                "(dflash_config.mask_token_id, mask_token_id or dspark_noise_token_id)");
  const int64_t mask = s.dflash.has("mask_token_id") ? s.dflash.get_int("mask_token_id") : config.get_int(key);
  config.require(mask >= 0 && mask < vocab, key, "a token id of the vocabulary");
  return int32_t(mask);
}

// The target layers whose output streams the context reads, where vLLM's get_eagle3_aux_layers_from_config
// looks for them. Its aux ids are "the stream entering layer id", so a layer t there is id t + 1 in every
// key but eagle_aux_hidden_state_layer_ids, which holds the ids themselves.
std::vector<int> target_layers_of(const DraftSettings& s, const DecoderModel& target) {
  const Config& config = s.config;
  std::vector<int64_t> layers;
  const char* key = "target_layer_ids";
  if (config.has("eagle_aux_hidden_state_layer_ids")) {
    key = "eagle_aux_hidden_state_layer_ids";
    for (int64_t id : config.get_int_list(key)) layers.push_back(id - 1);
  } else if (s.dflash.has("target_layer_ids")) {
    layers = s.dflash.get_int_list("target_layer_ids");
  } else if (config.has("dspark_target_layer_ids")) {
    key = "dspark_target_layer_ids";
    layers = config.get_int_list(key);
  } else {
    layers = config.get_int_list("target_layer_ids");
  }
  config.require(!layers.empty(), key, "a non-empty list of the target's layers");
  config.require(config.get_int("num_target_layers", int64_t(layers.size())) == int64_t(layers.size()),
                 "num_target_layers", "the length of " + std::string(key));
  std::vector<int> ids;
  for (int64_t id : layers) {
    config.require(id >= 0 && id < target.num_layers(), key,
                   "layers of the target (0 .. " + std::to_string(target.num_layers() - 1) + ")");
    ids.push_back(int(id));
  }
  return ids;
}

// K3DSparkConfig (a DeepseekV3Config): MLA layers with RoPE (vLLM mla.py use_rope: GPT-J interleaved,
// rope_theta 50000 by default, deepseek_yarn's mscale on the softmax scale), both latent norms at
// rms_norm_eps, no output gate, Kimi K3's MLP activation; names context_proj / context_norm / final_norm.
void load_k3_layers(Checkpoint& ckpt, const Config& config, DSparkDrafter& drafter) {
  // K3DSparkConfig's refusals, in its words' order.
  for (const char* key : {"mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"})
    if (config.get_bool(key, false)) config.unsupported(key, "true", "false (MLA DSpark does not support it)");
  for (const char* key : {"n_routed_experts", "n_shared_experts", "num_experts_per_tok"})
    config.require(config.get_int(key, 0) == 0, key, "0 (the DSpark drafter is dense)");
  config.require(drafter.draft_vocab == drafter.vocab, "draft_vocab_size",
                 "vocab_size (the drafter shares the target's embedding and head)");
  const int64_t hidden = drafter.hidden;
  MlaOptions mla;
  mla.hidden = hidden;
  mla.num_heads = config.get_int("num_attention_heads");
  mla.q_lora_rank = config.get_int("q_lora_rank", 0);
  config.require(mla.q_lora_rank > 0, "q_lora_rank", "a positive integer (MLA DSpark needs the query latent)");
  mla.kv_lora_rank = config.get_int("kv_lora_rank");
  mla.qk_nope_head_dim = config.get_int("qk_nope_head_dim");
  mla.qk_rope_head_dim = config.get_int("qk_rope_head_dim");
  mla.v_head_dim = config.get_int("v_head_dim");
  const int64_t max_positions = config.get_int("max_position_embeddings", 4096);
  const nlohmann::json rope_params = config.rope_parameters(50000.0, max_positions);
  mla.rope = Rope::from_config(rope_params, int(mla.qk_rope_head_dim), max_positions);
  mla.softmax_scale = mla_softmax_scale(mla.qk_head_dim(), rope_params);
  mla.q_norm_eps = mla.kv_norm_eps = drafter.norm_eps;
  mla.non_causal = true;
  const int64_t num_layers = config.get_int("num_hidden_layers");
  config.require(num_layers > 0, "num_hidden_layers", "a positive integer");
  const int64_t intermediate = config.get_int("intermediate_size");
  const Activation act = kimi_k3_activation(config);
  for (int64_t j = 0; j < num_layers; ++j) {
    const std::string prefix = "layers." + std::to_string(j) + ".";
    DecoderLayer layer;
    layer.input_norm = ckpt.take(prefix + "input_layernorm.weight", {hidden});
    layer.post_norm = ckpt.take(prefix + "post_attention_layernorm.weight", {hidden});
    layer.mixer = MlaMixer::load(ckpt, prefix + "self_attn.", mla, nullptr);
    layer.ffn = std::make_unique<DenseMlp>(DenseMlp::load(ckpt, prefix + "mlp.", hidden, intermediate, act));
    drafter.layers.push_back(std::move(layer));
  }
}

// The Qwen3 DSpark drafter (qwen3_dflash.py DFlashQwen3Model / DFlashQwen3DecoderLayer): Qwen3 attention
// (q/k RMSNorm x̂ · w over each head, RoPE over the whole head, theta 1e6 by default, NeoX unless
// is_neox_style is false), a SiLU MLP; names fc / hidden_norm / norm. Each layer's causality and sliding
// window as _resolve_layer_attention decides them: causal from is_causal, else dflash_config.causal, else
// "sliding_attention" in layer_types, else non-causal; sliding when dflash_config.use_swa (every layer, unless
// layer_types has sliding ones) or layer_types says so, with dflash_config.swa_window_size or sliding_window.
void load_qwen3_layers(Checkpoint& ckpt, const DraftSettings& s, DSparkDrafter& drafter) {
  const Config& config = s.config;
  config.require(s.dflash.get_bool("use_aux_hidden_state", config.get_bool("use_aux_hidden_state", true)),
                 "use_aux_hidden_state", "true (DSpark reads the target's hidden states)");
  if (config.get_bool("attention_bias", false))
    config.unsupported("attention_bias", "true", "false (sparrow's GQA has no projection biases)");
  if (s.dflash.get_bool("attention_sink_bias", config.get_bool("add_swa_attention_sink_bias", false)))
    config.unsupported("attention_sink_bias", "true", "false (attention sinks are not built)");
  if (s.dflash.has("attention_value_scale"))
    config.unsupported("dflash_config.attention_value_scale", "a value", "none (not built)");
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") config.unsupported("hidden_act", act, "silu");
  const int64_t hidden = drafter.hidden;
  const int64_t heads = config.get_int("num_attention_heads");
  const int64_t kv_heads = config.get_int("num_key_value_heads", heads);
  config.require(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "num_key_value_heads",
                 "a positive divisor of num_attention_heads");
  const int64_t head_dim = config.get_int("head_dim", hidden / heads);
  const int64_t num_layers = config.get_int("num_hidden_layers");
  config.require(num_layers > 0, "num_hidden_layers", "a positive integer");
  const int64_t max_positions = config.get_int("max_position_embeddings", 4096);
  const nlohmann::json rope_params = config.rope_parameters(1000000.0, max_positions);
  config.require(rope_params.value("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor",
                 "1 (Qwen3 rotates the whole head)");
  const Rope rope = Rope::from_config(rope_params, int(head_dim), max_positions);
  const std::vector<std::string> layer_types =
      config.has("layer_types") ? config.get_string_list("layer_types") : std::vector<std::string>{};
  config.require(layer_types.empty() || int64_t(layer_types.size()) == num_layers, "layer_types",
                 "one entry per layer");
  const bool use_swa = s.dflash.get_bool("use_swa", false);
  const bool any_sliding =
      std::find(layer_types.begin(), layer_types.end(), "sliding_attention") != layer_types.end();
  const int64_t intermediate = config.get_int("intermediate_size");
  for (int64_t j = 0; j < num_layers; ++j) {
    const bool typed_sliding = !layer_types.empty() && layer_types[size_t(j)] == "sliding_attention";
    const bool causal = config.has("is_causal") ? config.get_bool("is_causal")
                        : s.dflash.has("causal") ? s.dflash.get_bool("causal")
                                                 : typed_sliding;
    const bool sliding = layer_types.empty() || (use_swa && !any_sliding) ? use_swa : typed_sliding;
    int64_t window = 0;
    if (sliding) {
      window = s.dflash.has("swa_window_size") ? s.dflash.get_int("swa_window_size")
                                                : config.get_int("sliding_window", 0);
      config.require(window > 0, "dflash_config.swa_window_size", "a positive window for a sliding layer");
    }
    const std::string prefix = "layers." + std::to_string(j) + ".";
    auto attn = std::make_unique<GqaAttention>();
    attn->heads = heads;
    attn->kv_heads = kv_heads;
    attn->head_dim = head_dim;
    attn->norm_eps = drafter.norm_eps;
    attn->unit_offset_norm = false;
    attn->rope_interleaved = !config.get_bool("is_neox_style", true);
    attn->non_causal = !causal;
    attn->sliding_window = window;
    attn->rope = rope;
    const std::string a = prefix + "self_attn.";
    attn->q_proj = ckpt.take_linear(a + "q_proj.weight", {heads * head_dim, hidden});
    attn->k_proj = ckpt.take_linear(a + "k_proj.weight", {kv_heads * head_dim, hidden});
    attn->v_proj = ckpt.take_linear(a + "v_proj.weight", {kv_heads * head_dim, hidden});
    attn->o_proj = ckpt.take_linear(a + "o_proj.weight", {hidden, heads * head_dim});
    attn->q_norm = ckpt.take(a + "q_norm.weight", {head_dim});
    attn->k_norm = ckpt.take(a + "k_norm.weight", {head_dim});
    attn->prefix = a;
    DecoderLayer layer;
    layer.input_norm = ckpt.take(prefix + "input_layernorm.weight", {hidden});
    layer.post_norm = ckpt.take(prefix + "post_attention_layernorm.weight", {hidden});
    layer.mixer = std::move(attn);
    layer.ffn = std::make_unique<DenseMlp>(DenseMlp::load(ckpt, prefix + "mlp.", hidden, intermediate, Activation{}));
    drafter.layers.push_back(std::move(layer));
  }
}

}  // namespace

std::unique_ptr<DSparkDrafter> load_dspark_drafter(const std::string& dir, Model& target, const LoadOptions& options,
                                                   const std::string& target_dir) {
  auto* stack = dynamic_cast<DecoderModel*>(&target);
  SPARROW_CHECK(stack != nullptr, "speculative decoding: method \"dspark\" reads the target's layer outputs, which ",
                target.model_type(), " does not give");
  SPARROW_CHECK(!options.tensor_parallel.sharded(), "the DSpark drafter is not split over tensor-parallel ranks");
  SPARROW_CHECK(!stack->tp.sharded() || !target_dir.empty(), "speculative decoding: the DSpark drafter of a target "
                "split over tensor-parallel ranks reads its embedding and head whole from the target's folder");
  std::unique_ptr<Checkpoint> ckpt = open_checkpoint(dir, target.device(), options);
  const DraftSettings settings{ckpt->config(), ckpt->config().has("dflash_config")
                                                   ? ckpt->config().get_object("dflash_config")
                                                   : Config(nlohmann::json::object(), "dflash_config")};
  const Config& config = settings.config;
  const std::string type = config.get_string("model_type");
  // vLLM's speculative config turns DSparkDraftModel with model_type qwen3 into Qwen3DSparkModel.
  const std::vector<std::string> archs =
      config.has("architectures") ? config.get_string_list("architectures") : std::vector<std::string>{};
  const auto has_arch = [&](const char* a) { return std::find(archs.begin(), archs.end(), a) != archs.end(); };
  const bool qwen3 = type == "qwen3" && (has_arch("Qwen3DSparkModel") || has_arch("DSparkDraftModel"));
  if (type != "k3_dspark" && !qwen3)
    config.unsupported("model_type", type, "k3_dspark (K3DSparkConfig), or qwen3 with architectures "
                                           "Qwen3DSparkModel (the Qwen3 DSpark drafter)");
  // The speculators format's 1 + N block (the bonus token as a given, not a prediction) is not built.
  if (!config.get_bool("sample_from_anchor", true))
    config.unsupported("sample_from_anchor", "false", "true (the bonus token's row predicts the first draft)");
  if (config.get_bool("dspark_bonus_anchor", false) && qwen3)
    config.unsupported("dspark_bonus_anchor", "true", "false");

  auto drafter = std::make_unique<DSparkDrafter>();
  drafter->type = type;
  drafter->placed_on = target.device();
  drafter->vocab = config.get_int("vocab_size");
  drafter->hidden = config.get_int("hidden_size");
  drafter->draft_vocab = config.get_int("draft_vocab_size", drafter->vocab);
  drafter->norm_eps = float(config.get_float("rms_norm_eps", 1e-6));
  drafter->logit_scale = float(config.get_float("logit_scale", 1.0));
  SPARROW_CHECK(drafter->vocab == stack->vocab && drafter->hidden == stack->hidden,
                "speculative decoding: the DSpark drafter (hidden ", drafter->hidden, ", vocabulary ", drafter->vocab,
                ") does not fit the target (hidden ", stack->hidden, ", vocabulary ", stack->vocab,
                "): it embeds with the target's embedding");
  config.require(drafter->draft_vocab > 0 && drafter->draft_vocab <= drafter->vocab, "draft_vocab_size",
                 "at most vocab_size");
  drafter->mask_token = mask_token_of(settings, drafter->vocab);
  drafter->target_layer_ids = target_layers_of(settings, *stack);
  config.require(config.get_int("target_hidden_size", stack->hidden) == stack->hidden, "target_hidden_size",
                 "the target's hidden_size");

  drafter->first_layer = int(stack->num_layers());
  drafter->target_cache_spec = stack->cache_spec();
  const int64_t hidden = drafter->hidden;
  const int64_t context_width = stack->hidden * int64_t(drafter->target_layer_ids.size());
  if (qwen3) {
    drafter->context_proj = ckpt->take_linear("fc.weight", {hidden, context_width});
    drafter->context_norm = ckpt->take("hidden_norm.weight", {hidden});
    load_qwen3_layers(*ckpt, settings, *drafter);
    drafter->final_norm = ckpt->take("norm.weight", {hidden});
  } else {
    drafter->context_proj = ckpt->take_linear("context_proj.weight", {hidden, context_width});
    drafter->context_norm = ckpt->take("context_norm.weight", {hidden});
    load_k3_layers(*ckpt, config, *drafter);
    drafter->final_norm = ckpt->take("final_norm.weight", {hidden});
  }

  // The embedding and the head are the target's, unless a Qwen3 drafter ships its own (qwen3_dspark.py
  // load_weights and process_eagle_weight; a reduced draft vocabulary must bring its head and its d2t map).
  const bool own_embed = qwen3 && ckpt->has("embed_tokens.weight");
  const bool own_head = qwen3 && ckpt->has("lm_head.weight");
  if (own_embed) drafter->embed = ckpt->take("embed_tokens.weight", {drafter->vocab, hidden});
  const bool reduced = drafter->draft_vocab < drafter->vocab;
  SPARROW_CHECK(!reduced || own_head, "speculative decoding: the DSpark drafter's reduced vocabulary (draft_vocab_size ",
                drafter->draft_vocab, ") needs its own lm_head.weight; the target's head cannot be shared");
  if (own_head) drafter->lm_head = ckpt->take_linear("lm_head.weight", {drafter->draft_vocab, hidden});
  if (reduced) {
    SPARROW_CHECK(ckpt->has("d2t"), "speculative decoding: the DSpark drafter's reduced vocabulary needs a d2t map "
                  "(draft ids to target ids)");
    drafter->draft_to_target = ckpt->take_ints("d2t", {drafter->draft_vocab});
    for (int64_t d = 0; d < drafter->draft_vocab; ++d) {
      const int64_t t = d + drafter->draft_to_target[size_t(d)];
      SPARROW_CHECK(t >= 0 && t < drafter->vocab, "speculative decoding: the DSpark drafter's d2t maps draft id ", d,
                    " to ", t, ", outside the target's vocabulary of ", drafter->vocab);
    }
  }
  if (!stack->tp.sharded()) {
    if (!own_embed) drafter->embed = stack->embed;
    if (!own_head) drafter->lm_head = stack->lm_head;
  } else if (!own_embed || !own_head) {  // the rank holds a share of the vocabulary rows: whole ones from the
                                         // target's folder
    LoadOptions whole = options;
    whole.tensor_parallel = {};
    std::unique_ptr<Checkpoint> target_ckpt = open_checkpoint(target_dir, target.device(), whole);
    if (!own_embed) drafter->embed = target_ckpt->take(stack->embed_name, {stack->vocab, stack->hidden});
    if (!own_head)
      drafter->lm_head = stack->head_name == stack->embed_name && !own_embed
                             ? drafter->embed
                             : target_ckpt->take_linear(stack->head_name, {stack->vocab, stack->hidden});
  }
  // vLLM reads dspark_draft_topk for Qwen3 drafters only (config/speculative.py).
  if (config.has("dspark_draft_topk")) {
    config.require(qwen3, "dspark_draft_topk", "absent (vLLM takes it for Qwen3 DSpark drafters only)");
    drafter->draft_topk = config.get_int("dspark_draft_topk");
    config.require(drafter->draft_topk >= 1 && drafter->draft_topk <= drafter->draft_vocab, "dspark_draft_topk",
                   "between 1 and draft_vocab_size");
  }
  const int64_t rank = config.get_int("markov_rank");
  config.require(rank > 0, "markov_rank", "a positive integer");
  drafter->markov_w1 = ckpt->take("markov_head.markov_w1.weight", {drafter->vocab, rank});
  drafter->markov_w2 = ckpt->take_linear("markov_head.markov_w2.weight", {drafter->draft_vocab, rank});
  // Training-only parts (vLLM drops them: K3DSparkForCausalLM.hf_to_vllm_mapper, Qwen3DSparkForCausalLM's
  // t2d, the unused mask_embedding), the confidence head (adaptive verification, not built), and copies of
  // the target's.
  ckpt->finish({"confidence_head.", "embed_tokens.", "lm_head.", "t2d", "mask_embedding"});

  // The target keeps the streams the context reads from now on.
  stack->aux_hidden_layers = drafter->target_layer_ids;
  return drafter;
}

}  // namespace sparrow
