#include "model/dspark.h"

#include <algorithm>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/families.h"
#include "model/feed_forward.h"
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
  for (size_t j = 0; j < layers.size(); ++j) {
    DecoderLayer& layer = layers[j];
    ops::add_(x, layer.mixer->forward(ops::rms_norm(x, layer.input_norm, norm_eps), batch, first_layer + int(j)));
    if (marks) marks->mark("dspark mixer");
    ops::add_(x, layer.ffn->forward(ops::rms_norm(x, layer.post_norm, norm_eps), batch));
    if (marks) marks->mark("dspark ffn");
  }
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
  for (size_t j = 0; j < layers.size(); ++j)
    static_cast<MlaMixer&>(*layers[j].mixer).store_rows(c, batch, first_layer + int(j));
}

Tensor DSparkDrafter::markov_bias(const std::vector<int32_t>& previous) const {
  Tensor bias = ops::linear(ops::embedding(markov_w1, previous), markov_w2, ScalarType::F32);
  if (logit_scale != 1.0f) ops::scale_(bias, logit_scale);
  return bias;
}

std::unique_ptr<DSparkDrafter> load_dspark_drafter(const std::string& dir, Model& target, const LoadOptions& options,
                                                   const std::string& target_dir) {
  auto* stack = dynamic_cast<DecoderModel*>(&target);
  SPARROW_CHECK(stack != nullptr, "speculative decoding: method \"dspark\" reads the target's layer outputs, which ",
                target.model_type(), " does not give");
  SPARROW_CHECK(!options.tensor_parallel.sharded(), "the DSpark drafter is not split over tensor-parallel ranks");
  SPARROW_CHECK(!stack->tp.sharded() || !target_dir.empty(), "speculative decoding: the DSpark drafter of a target "
                "split over tensor-parallel ranks reads its embedding and head whole from the target's folder");
  std::unique_ptr<Checkpoint> ckpt = open_checkpoint(dir, target.device(), options);
  const Config& config = ckpt->config();
  const std::string type = config.get_string("model_type");
  if (type != "k3_dspark")
    config.unsupported("model_type", type, "k3_dspark (vLLM's K3DSparkConfig; the Qwen3 / DFlash drafters are not "
                                           "built yet)");
  // K3DSparkConfig's refusals, in its words' order.
  for (const char* key : {"mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"})
    if (config.get_bool(key, false)) config.unsupported(key, "true", "false (MLA DSpark does not support it)");
  for (const char* key : {"n_routed_experts", "n_shared_experts", "num_experts_per_tok"})
    config.require(config.get_int(key, 0) == 0, key, "0 (the DSpark drafter is dense)");
  // The speculators format's 1 + N block (the bonus token as a given, not a prediction) is not built.
  if (!config.get_bool("sample_from_anchor", true))
    config.unsupported("sample_from_anchor", "false", "true (the bonus token's row predicts the first draft)");

  auto drafter = std::make_unique<DSparkDrafter>();
  drafter->placed_on = target.device();
  drafter->vocab = config.get_int("vocab_size");
  drafter->hidden = config.get_int("hidden_size");
  drafter->norm_eps = float(config.get_float("rms_norm_eps", 1e-6));
  drafter->logit_scale = float(config.get_float("logit_scale", 1.0));
  config.require(config.get_int("draft_vocab_size", drafter->vocab) == drafter->vocab, "draft_vocab_size",
                 "vocab_size (the drafter shares the target's embedding and head)");
  SPARROW_CHECK(drafter->vocab == stack->vocab && drafter->hidden == stack->hidden,
                "speculative decoding: the DSpark drafter (hidden ", drafter->hidden, ", vocabulary ", drafter->vocab,
                ") does not fit the target (hidden ", stack->hidden, ", vocabulary ", stack->vocab,
                "): it shares the target's embedding and head");
  // The mask token, where vLLM's get_parallel_drafting_token_id looks for it.
  const Config dflash = config.has("dflash_config") ? config.get_object("dflash_config")
                                                     : Config(nlohmann::json::object(), "dflash_config");
  const char* mask_key = dflash.has("mask_token_id")     ? "mask_token_id"
                         : config.has("mask_token_id")    ? "mask_token_id"
                         : config.has("dspark_noise_token_id") ? "dspark_noise_token_id"
                                                               : nullptr;
  SPARROW_CHECK(mask_key != nullptr, "speculative decoding: the DSpark config names no mask token "
                "(dflash_config.mask_token_id, mask_token_id or dspark_noise_token_id)");
  const int64_t mask = dflash.has("mask_token_id") ? dflash.get_int("mask_token_id") : config.get_int(mask_key);
  config.require(mask >= 0 && mask < drafter->vocab, mask_key, "a token id of the vocabulary");
  drafter->mask_token = int32_t(mask);

  const std::vector<int64_t> ids = config.get_int_list("target_layer_ids");
  config.require(!ids.empty(), "target_layer_ids", "a non-empty list of the target's layers");
  config.require(config.get_int("num_target_layers", int64_t(ids.size())) == int64_t(ids.size()), "num_target_layers",
                 "the length of target_layer_ids");
  config.require(config.get_int("target_hidden_size", stack->hidden) == stack->hidden, "target_hidden_size",
                 "the target's hidden_size");
  for (int64_t id : ids) {
    config.require(id >= 0 && id < stack->num_layers(), "target_layer_ids", "layers of the target (0 .. " +
                   std::to_string(stack->num_layers() - 1) + ")");
    drafter->target_layer_ids.push_back(int(id));
  }

  // The draft layers: K3's MLA with RoPE (vLLM mla.py use_rope: GPT-J interleaved, rope_theta 50000 by default,
  // deepseek_yarn's mscale on the softmax scale), both latent norms at rms_norm_eps, no output gate.
  const int64_t hidden = drafter->hidden;
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
  mla.q_norm_eps = mla.kv_norm_eps = drafter->norm_eps;
  mla.non_causal = true;
  const int64_t num_layers = config.get_int("num_hidden_layers");
  config.require(num_layers > 0, "num_hidden_layers", "a positive integer");
  const int64_t intermediate = config.get_int("intermediate_size");
  const Activation act = kimi_k3_activation(config);

  drafter->first_layer = int(stack->num_layers());
  drafter->target_cache_spec = stack->cache_spec();
  if (!stack->tp.sharded()) {
    drafter->embed = stack->embed;
    drafter->lm_head = stack->lm_head;
  } else {  // the rank holds a share of the vocabulary rows: the whole tensors from the target's folder
    LoadOptions whole = options;
    whole.tensor_parallel = {};
    std::unique_ptr<Checkpoint> target_ckpt = open_checkpoint(target_dir, target.device(), whole);
    drafter->embed = target_ckpt->take(stack->embed_name, {stack->vocab, stack->hidden});
    drafter->lm_head = stack->head_name == stack->embed_name
                           ? drafter->embed
                           : target_ckpt->take_linear(stack->head_name, {stack->vocab, stack->hidden});
  }
  const int64_t context_width = stack->hidden * int64_t(ids.size());
  drafter->context_proj = ckpt->take_linear("context_proj.weight", {hidden, context_width});
  drafter->context_norm = ckpt->take("context_norm.weight", {hidden});
  for (int64_t j = 0; j < num_layers; ++j) {
    const std::string prefix = "layers." + std::to_string(j) + ".";
    DecoderLayer layer;
    layer.input_norm = ckpt->take(prefix + "input_layernorm.weight", {hidden});
    layer.post_norm = ckpt->take(prefix + "post_attention_layernorm.weight", {hidden});
    layer.mixer = MlaMixer::load(*ckpt, prefix + "self_attn.", mla, nullptr);
    layer.ffn = std::make_unique<DenseMlp>(DenseMlp::load(*ckpt, prefix + "mlp.", hidden, intermediate, act));
    drafter->layers.push_back(std::move(layer));
  }
  drafter->final_norm = ckpt->take("final_norm.weight", {hidden});
  const int64_t rank = config.get_int("markov_rank");
  config.require(rank > 0, "markov_rank", "a positive integer");
  drafter->markov_w1 = ckpt->take("markov_head.markov_w1.weight", {drafter->vocab, rank});
  drafter->markov_w2 = ckpt->take_linear("markov_head.markov_w2.weight", {drafter->vocab, rank});
  // Training-only parts (vLLM drops them: K3DSparkForCausalLM.hf_to_vllm_mapper), and copies of the target's.
  ckpt->finish({"confidence_head.", "embed_tokens.", "lm_head."});

  // The target keeps the streams the context reads from now on.
  stack->aux_hidden_layers = drafter->target_layer_ids;
  return drafter;
}

}  // namespace sparrow
