// DeepSeek-V3.2 (transformers 5.17 DeepseekV32ForCausalLM, model_type "deepseek_v32"): every layer is
// MLA with a DSA indexer (src/model/mla.h, src/model/dsa_indexer.h); the feed-forward is a dense
// SiLU MLP on the first layers and a grouped-sigmoid-routed MoE with shared experts on the rest.
// Missing config fields take DeepseekV32Config's defaults, as transformers would.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "model/dsa_indexer.h"
#include "model/families.h"
#include "model/mla.h"
#include "model/feed_forward.h"

namespace sparrow {

namespace {

// Which feed-forward each layer gets: "dense" or "sparse" (MoE). mlp_layer_types when given, else
// the first first_k_dense_replace layers are dense (DeepseekV32Config.__post_init__).
std::vector<std::string> mlp_layer_types(const Config& config, int64_t num_layers) {
  if (config.has("mlp_layer_types")) {
    std::vector<std::string> types = config.get_string_list("mlp_layer_types");
    config.require(int64_t(types.size()) == num_layers, "mlp_layer_types", "a list of num_hidden_layers entries");
    for (const std::string& t : types)
      if (t != "dense" && t != "sparse") config.unsupported("mlp_layer_types entry", t, "dense, sparse");
    return types;
  }
  const int64_t dense = std::min(config.get_int("first_k_dense_replace", 3), num_layers);
  std::vector<std::string> types(num_layers, "sparse");
  for (int64_t i = 0; i < dense; ++i) types[i] = "dense";
  return types;
}

// Every layer's attention: MLA with a DSA indexer, the same shape on every layer. Parsed and checked
// once for the loader and for the cache spec.
struct Attention {
  int64_t num_layers = 0;
  MlaOptions mla;
  DsaIndexerOptions index;
};

Attention attention_config(const Config& config) {
  const int64_t hidden = config.get_int("hidden_size", 7168);
  const int64_t num_layers = config.get_int("num_hidden_layers", 61);
  const int64_t heads = config.get_int("num_attention_heads", 128);
  const int64_t qk_rope_head_dim = config.get_int("qk_rope_head_dim", 64);

  // DeepseekV32Attention.forward always goes through q_a_proj (its query latent feeds the indexer).
  if (!config.has("q_lora_rank") && config.json().contains("q_lora_rank"))
    config.unsupported("q_lora_rank", "null", "a positive integer");
  // The expanded keys already have one head per query head; transformers cannot repeat them further.
  const int64_t kv_heads = config.get_int("num_key_value_heads", heads);
  if (kv_heads != heads)
    config.unsupported("num_key_value_heads", std::to_string(kv_heads), cat("num_attention_heads = ", heads));
  if (config.has("layer_types")) {
    std::vector<std::string> types = config.get_string_list("layer_types");
    config.require(int64_t(types.size()) == num_layers, "layer_types", "a list of num_hidden_layers entries");
    for (const std::string& t : types)
      if (t != "deepseek_sparse_attention") config.unsupported("layer_types entry", t, "deepseek_sparse_attention");
  }

  // DeepseekV32Config's defaults: rope_theta 10000, max_position_embeddings 163840.
  const int64_t max_positions = config.get_int("max_position_embeddings", 163840);
  const nlohmann::json rope_params = config.rope_parameters(10000.0, max_positions);
  const Rope rope = Rope::from_config(rope_params, int(qk_rope_head_dim), max_positions);

  Attention attention;
  attention.num_layers = num_layers;
  MlaOptions& mla = attention.mla;
  mla.hidden = hidden;
  mla.num_heads = heads;
  mla.q_lora_rank = config.get_int("q_lora_rank", 1536);
  mla.kv_lora_rank = config.get_int("kv_lora_rank", 512);
  mla.qk_nope_head_dim = config.get_int("qk_nope_head_dim", 128);
  mla.qk_rope_head_dim = qk_rope_head_dim;
  mla.v_head_dim = config.get_int("v_head_dim", 128);
  mla.softmax_scale = mla_softmax_scale(mla.qk_head_dim(), rope_params);
  mla.rope = rope;
  mla.attention_bias = config.get_bool("attention_bias", false);
  config.require(mla.q_lora_rank > 0, "q_lora_rank", "a positive integer");

  DsaIndexerOptions& index = attention.index;
  index.hidden = hidden;
  index.query_input = mla.q_lora_rank;
  index.num_heads = config.get_int("index_n_heads", 64);
  index.head_dim = config.get_int("index_head_dim", 128);
  index.topk = config.get_int("index_topk", 2048);
  index.rope = rope;
  config.require(index.head_dim >= qk_rope_head_dim, "index_head_dim", "at least qk_rope_head_dim");
  config.require(index.topk > 0, "index_topk", "a positive integer");
  return attention;
}

// The feed-forward settings (DeepseekV32MoE, DeepseekV32TopkRouter; a legacy num_experts overrides
// n_routed_experts), checked when any layer is MoE.
struct FeedForwards {
  int64_t intermediate = 0;
  GroupedMoeShape moe;
};

FeedForwards feed_forward_config(const Config& config, int64_t hidden, bool any_moe) {
  FeedForwards f;
  f.intermediate = config.get_int("intermediate_size", 18432);
  GroupedMoeShape& shape = f.moe;
  shape.hidden = hidden;
  shape.num_experts = config.get_int("num_experts", config.get_int("n_routed_experts", 256));
  shape.n_group = config.get_int("n_group", 8);
  shape.topk_group = config.get_int("topk_group", 4);
  shape.top_k = config.get_int("num_experts_per_tok", 8);
  shape.intermediate = config.get_int("moe_intermediate_size", 2048);
  shape.n_shared = config.get_int("n_shared_experts", 1);
  shape.normalize = config.get_bool("norm_topk_prob", true);
  shape.routed_scaling_factor = float(config.get_float("routed_scaling_factor", 2.5));
  if (any_moe) {
    config.require(shape.n_group > 0 && shape.num_experts % shape.n_group == 0, "n_group", "a divisor of n_routed_experts");
    // Each group is scored by its two best experts.
    config.require(shape.num_experts / shape.n_group >= 2, "n_group", "at most n_routed_experts / 2");
    config.require(shape.topk_group > 0 && shape.topk_group <= shape.n_group, "topk_group", "between 1 and n_group");
    config.require(shape.top_k > 0 && shape.top_k <= shape.topk_group * (shape.num_experts / shape.n_group),
                   "num_experts_per_tok", "at most the experts in topk_group groups");
    config.require(shape.n_shared >= 1, "n_shared_experts", "at least 1");
  }
  return f;
}

// One decoder layer under `layer_prefix`: its norms, MLA with the DSA indexer, a dense MLP or the MoE.
DecoderLayer load_layer(Checkpoint& ckpt, const std::string& layer_prefix, const Attention& attention,
                        const FeedForwards& ffn, bool dense) {
  const int64_t hidden = attention.mla.hidden;
  DecoderLayer layer;
  layer.input_norm = ckpt.take(layer_prefix + "input_layernorm.weight", {hidden});
  layer.post_norm = ckpt.take(layer_prefix + "post_attention_layernorm.weight", {hidden});
  layer.mixer = MlaMixer::load(ckpt, layer_prefix + "self_attn.", attention.mla,
                               DsaIndexer::load(ckpt, layer_prefix + "self_attn.indexer.", attention.index));
  if (dense)
    layer.ffn = std::make_unique<DenseMlp>(DenseMlp::load(ckpt, layer_prefix + "mlp.", hidden, ffn.intermediate, Activation{}));
  else
    layer.ffn = MoeBlock::load_grouped(ckpt, layer_prefix + "mlp.", ffn.moe);
  return layer;
}

void check_activation(const Config& config) {
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") config.unsupported("hidden_act", act, "silu");
}

}  // namespace

std::vector<LayerCacheSpec> deepseek_v32_cache_spec(const Config& config) {
  const Attention attention = attention_config(config);
  return std::vector<LayerCacheSpec>(attention.num_layers, MlaMixer::cache_spec_for(attention.mla, &attention.index));
}

std::unique_ptr<DecoderModel> load_deepseek_v32(Checkpoint& ckpt, const Config& config, const std::string& prefix) {
  check_activation(config);
  const Attention attention = attention_config(config);
  const int64_t vocab = config.get_int("vocab_size", 129280);
  const int64_t hidden = attention.mla.hidden;
  const int64_t num_layers = attention.num_layers;
  const std::vector<std::string> mlp_types = mlp_layer_types(config, num_layers);
  const bool any_moe = std::find(mlp_types.begin(), mlp_types.end(), "sparse") != mlp_types.end();
  const FeedForwards ffn = feed_forward_config(config, hidden, any_moe);

  auto model = std::make_unique<DecoderModel>();
  model->type = "deepseek_v32";
  model->vocab = vocab;
  model->hidden = hidden;
  model->norm_eps = float(config.get_float("rms_norm_eps", 1e-6));
  model->take_embeddings(ckpt, prefix, "lm_head.weight", config.get_bool("tie_word_embeddings", false));
  for (int64_t i = 0; i < num_layers; ++i)
    model->layers.push_back(
        load_layer(ckpt, prefix + "layers." + std::to_string(i) + ".", attention, ffn, mlp_types[i] == "dense"));
  // The multi-token-prediction layers after the last decoder layer are not part of the causal LM
  // (transformers drops them on load); speculative decoding's "mtp" loads them (load_deepseek_v32_mtp).
  std::vector<std::string> mtp_layers;
  for (int64_t i = 0; i < config.get_int("num_nextn_predict_layers", 1); ++i)
    mtp_layers.push_back(prefix + "layers." + std::to_string(num_layers + i) + ".");
  ckpt.finish(mtp_layers);
  return model;
}

std::unique_ptr<MtpDrafter> load_deepseek_v32_mtp(Checkpoint& ckpt, const Config& config, const std::string& prefix) {
  check_activation(config);
  SPARROW_CHECK(config.get_int("num_nextn_predict_layers", 1) >= 1, "speculative decoding: method \"mtp\" needs "
                "the checkpoint's multi-token-prediction layers, and config.json's num_nextn_predict_layers is 0");
  const Attention attention = attention_config(config);
  const int64_t vocab = config.get_int("vocab_size", 129280);
  const int64_t hidden = attention.mla.hidden;
  const int64_t num_layers = attention.num_layers;
  // The MTP layer is a MoE layer (vLLM builds it as DeepseekV2DecoderLayer at index L >= first_k_dense_replace).
  const FeedForwards ffn = feed_forward_config(config, hidden, true);
  const std::string mtp = prefix + "layers." + std::to_string(num_layers) + ".";
  require_mtp_layer(ckpt, mtp);

  auto drafter = std::make_unique<MtpDrafter>();
  drafter->type = "deepseek_v32";
  drafter->placed_on = ckpt.device();
  drafter->vocab = vocab;
  drafter->hidden = hidden;
  drafter->norm_eps = float(config.get_float("rms_norm_eps", 1e-6));
  drafter->layer_index = int(num_layers);
  drafter->recycles_normed = true;  // vLLM 0.33 deepseek_v32/nvidia/mtp.py: the post-norm state feeds the next step
  drafter->target_cache_spec = deepseek_v32_cache_spec(config);
  // DeepSeek-V3's checkpoints repeat the embedding and the head inside the MTP layer; else the target's.
  drafter->embed = ckpt.take(ckpt.has(mtp + "embed_tokens.weight") ? mtp + "embed_tokens.weight" : prefix + "embed_tokens.weight",
                             {vocab, hidden});
  const bool tied = config.get_bool("tie_word_embeddings", false);
  drafter->head = ckpt.has(mtp + "shared_head.head.weight") ? ckpt.take(mtp + "shared_head.head.weight", {vocab, hidden})
                  : tied ? drafter->embed
                         : ckpt.take("lm_head.weight", {vocab, hidden});
  drafter->enorm = ckpt.take(mtp + "enorm.weight", {hidden});
  drafter->hnorm = ckpt.take(mtp + "hnorm.weight", {hidden});
  drafter->eh_proj = ckpt.take(mtp + "eh_proj.weight", {hidden, 2 * hidden});
  drafter->norm = ckpt.take(mtp + "shared_head.norm.weight", {hidden});
  drafter->layer = load_layer(ckpt, mtp, attention, ffn, /*dense=*/false);
  // Everything else is the target's (and the further MTP layers, which vLLM uses only for k beyond them).
  ckpt.finish({prefix, "lm_head."});
  return drafter;
}

}  // namespace sparrow
