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

}  // namespace

std::vector<LayerCacheSpec> deepseek_v32_cache_spec(const Config& config) {
  const Attention attention = attention_config(config);
  return std::vector<LayerCacheSpec>(attention.num_layers, MlaMixer::cache_spec_for(attention.mla, &attention.index));
}

std::unique_ptr<DecoderModel> load_deepseek_v32(Checkpoint& ckpt, const Config& config, const std::string& prefix) {
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") config.unsupported("hidden_act", act, "silu");
  const Attention attention = attention_config(config);
  const MlaOptions& mla = attention.mla;
  const DsaIndexerOptions& index = attention.index;
  const int64_t vocab = config.get_int("vocab_size", 129280);
  const int64_t hidden = mla.hidden;
  const int64_t num_layers = attention.num_layers;

  // MoE (DeepseekV32MoE, DeepseekV32TopkRouter); a legacy num_experts overrides n_routed_experts.
  const int64_t num_experts = config.get_int("num_experts", config.get_int("n_routed_experts", 256));
  const int64_t n_group = config.get_int("n_group", 8);
  const int64_t topk_group = config.get_int("topk_group", 4);
  const int64_t experts_per_token = config.get_int("num_experts_per_tok", 8);
  const int64_t moe_intermediate = config.get_int("moe_intermediate_size", 2048);
  const int64_t n_shared = config.get_int("n_shared_experts", 1);
  const std::vector<std::string> mlp_types = mlp_layer_types(config, num_layers);
  const bool any_moe = std::find(mlp_types.begin(), mlp_types.end(), "sparse") != mlp_types.end();
  if (any_moe) {
    config.require(n_group > 0 && num_experts % n_group == 0, "n_group", "a divisor of n_routed_experts");
    // Each group is scored by its two best experts.
    config.require(num_experts / n_group >= 2, "n_group", "at most n_routed_experts / 2");
    config.require(topk_group > 0 && topk_group <= n_group, "topk_group", "between 1 and n_group");
    config.require(experts_per_token > 0 && experts_per_token <= topk_group * (num_experts / n_group),
                   "num_experts_per_tok", "at most the experts in topk_group groups");
    config.require(n_shared >= 1, "n_shared_experts", "at least 1");
  }

  auto model = std::make_unique<DecoderModel>();
  model->type = "deepseek_v32";
  model->vocab = vocab;
  model->hidden = hidden;
  model->norm_eps = float(config.get_float("rms_norm_eps", 1e-6));
  model->take_embeddings(ckpt, prefix, "lm_head.weight", config.get_bool("tie_word_embeddings", false));

  const Activation silu_glu;
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string layer_prefix = prefix + "layers." + std::to_string(i) + ".";
    DecoderLayer layer;
    layer.input_norm = ckpt.take(layer_prefix + "input_layernorm.weight", {hidden});
    layer.post_norm = ckpt.take(layer_prefix + "post_attention_layernorm.weight", {hidden});
    layer.mixer = MlaMixer::load(ckpt, layer_prefix + "self_attn.", mla,
                                 DsaIndexer::load(ckpt, layer_prefix + "self_attn.indexer.", index));
    if (mlp_types[i] == "dense") {
      auto mlp = std::make_unique<DenseMlp>(
          DenseMlp::load(ckpt, layer_prefix + "mlp.", hidden, config.get_int("intermediate_size", 18432), silu_glu));
      layer.ffn = std::move(mlp);
    } else {
      GroupedMoeShape shape;
      shape.hidden = hidden, shape.num_experts = num_experts, shape.intermediate = moe_intermediate;
      shape.top_k = experts_per_token, shape.n_group = n_group, shape.topk_group = topk_group, shape.n_shared = n_shared;
      shape.normalize = config.get_bool("norm_topk_prob", true);
      shape.routed_scaling_factor = float(config.get_float("routed_scaling_factor", 2.5));
      layer.ffn = MoeBlock::load_grouped(ckpt, layer_prefix + "mlp.", shape);
    }
    model->layers.push_back(std::move(layer));
  }
  // The multi-token-prediction layers after the last decoder layer are not part of the causal LM
  // (transformers drops them on load).
  std::vector<std::string> mtp_layers;
  for (int64_t i = 0; i < config.get_int("num_nextn_predict_layers", 1); ++i)
    mtp_layers.push_back(prefix + "layers." + std::to_string(num_layers + i) + ".");
  ckpt.finish(mtp_layers);
  return model;
}

}  // namespace sparrow
