// Kimi Linear (transformers 5.17 KimiLinearForCausalLM, model_type "kimi_linear") and Kimi K3
// (model_type "kimi_k3").
//
// Kimi Linear: each layer is either Kimi Delta Attention (src/model/kda_mixer.h, layer type
// "linear_attention") or MLA without rotary embeddings (src/model/mla.h, "full_attention": the
// 64 "rope" dims of q and k are used as they are, softmax scale qk_head_dim^-0.5); its feed-forward
// is a dense SiLU MLP ("dense") or a grouped-sigmoid-routed MoE with shared experts ("sparse").
//
// Kimi K3 has no public reference; it is defined as Kimi Linear (with q_lora_rank set) where every
// full-attention layer also holds a DSA indexer exactly like DeepseekV32Indexer
// (self_attn.indexer.{wq_b,wk,k_norm,weights_proj}, src/model/dsa_indexer.h). The indexer uses
// DeepSeek-V3.2's rotary embedding from `rope_parameters` over qk_rope_head_dim; its top index_topk
// keys restrict that layer's MLA, which itself stays without RoPE.
//
// Config parsing follows KimiLinearConfig: the names Kimi's checkpoints use (num_experts, ...) are
// aliases of the transformers fields and win over them; linear_attn_config overrides the linear_*
// fields; layer types come from layer_types, else from linear_attn_config's 1-indexed
// full_attn_layers / kda_layers, else every 4th layer from layer 4 (0-indexed) is full attention.
// Weights are accepted as transformers saves them and as Kimi's released checkpoints ship them
// (transformers' conversion_mapping.py "kimi_linear": block_sparse_moe, experts.N.w1/w2/w3, ...).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/dsa_indexer.h"
#include "model/families.h"
#include "model/kda_mixer.h"
#include "model/mla.h"
#include "model/feed_forward.h"

namespace sparrow {

namespace {

// KimiLinearConfig.attribute_map: `name` is the transformers field, `alias` the name Kimi's own
// config.json uses. PreTrainedConfig stores an alias under its field, so the alias wins when both are
// set. Returns the key the value is read from (and errors name).
std::string field_key(const Config& c, const std::string& name, const std::string& alias) {
  return c.has(alias) ? alias : name;
}

// "linear_attention" or "full_attention" for every layer (KimiLinearConfig.__post_init__).
std::vector<std::string> attention_layer_types(const Config& config, const Config& linear_attn, int64_t num_layers) {
  std::vector<std::string> types;
  if (config.has("layer_types")) {
    types = config.get_string_list("layer_types");
    config.require(int64_t(types.size()) == num_layers, "layer_types", "a list of num_hidden_layers entries");
  } else if (linear_attn.has("full_attn_layers") && linear_attn.has("kda_layers")) {
    types.assign(num_layers, "");
    auto place = [&](const std::string& key, const std::string& type) {
      for (int64_t layer : linear_attn.get_int_list(key)) {  // 1-indexed in the checkpoint
        linear_attn.require(layer >= 1 && layer <= num_layers, key, "layer numbers between 1 and num_hidden_layers");
        types[layer - 1] = type;
      }
    };
    place("full_attn_layers", "full_attention");
    place("kda_layers", "linear_attention");
    for (int64_t i = 0; i < num_layers; ++i)
      linear_attn.require(!types[i].empty(), "full_attn_layers",
                          cat("together with kda_layers, to list every layer (layer ", i + 1, " is in neither)"));
  } else {
    for (int64_t i = 0; i < num_layers; ++i)
      types.push_back(i > 0 && i % 4 == 0 ? "full_attention" : "linear_attention");
  }
  for (const std::string& t : types)
    if (t != "full_attention" && t != "linear_attention")
      config.unsupported("layer_types entry", t, "full_attention, linear_attention");
  return types;
}

// "dense" or "sparse" (MoE) for every layer: mlp_layer_types, else the first first_k_dense_replace
// (default 1) layers are dense.
std::vector<std::string> mlp_layer_types(const Config& config, int64_t num_layers) {
  std::vector<std::string> types;
  if (config.has("mlp_layer_types")) {
    types = config.get_string_list("mlp_layer_types");
    config.require(int64_t(types.size()) == num_layers, "mlp_layer_types", "a list of num_hidden_layers entries");
  } else {
    const int64_t dense = config.get_int("first_k_dense_replace", 1);
    for (int64_t i = 0; i < num_layers; ++i) types.push_back(i < dense ? "dense" : "sparse");
  }
  for (const std::string& t : types)
    if (t != "dense" && t != "sparse") config.unsupported("mlp_layer_types entry", t, "dense, sparse");
  return types;
}

// Where a layer's feed-forward weights live: transformers saves `mlp.`, Kimi's checkpoints (and
// transformers writing in their layout) `block_sparse_moe.`, for the dense MLP as well as the MoE.
// `probe` is a tensor name present in either layout.
std::string ffn_prefix(const Checkpoint& ckpt, const std::string& layer_prefix, const std::string& probe) {
  return ckpt.has(layer_prefix + "block_sparse_moe." + probe) ? layer_prefix + "block_sparse_moe." : layer_prefix + "mlp.";
}

// The token mixers: which layers are KDA and which MLA (with a DSA indexer on Kimi K3), and their
// shapes. Parsed and checked once for the loader and for the cache spec.
struct Attention {
  std::vector<std::string> layer_types;  // linear_attention | full_attention, per layer
  KdaConfig kda;
  MlaOptions mla;
  bool has_indexer = false;  // kimi_k3
  DsaIndexerOptions index;
};

Attention attention_config(const Config& config) {
  const bool k3 = config.get_string("model_type") == "kimi_k3";
  const int64_t hidden = config.get_int("hidden_size", 2304);
  const int64_t num_layers = config.get_int("num_hidden_layers", 27);
  const int64_t heads = config.get_int("num_attention_heads", 32);
  config.require(hidden > 0, "hidden_size", "a positive integer");
  config.require(num_layers > 0, "num_hidden_layers", "a positive integer");
  config.require(heads > 0, "num_attention_heads", "a positive integer");
  if (!config.get_bool("mla_use_nope", true)) config.unsupported("mla_use_nope", "false", "true");
  // MLA expands its keys to one head per query head; transformers cannot repeat them further.
  const int64_t kv_heads = config.get_int("num_key_value_heads", heads);
  if (kv_heads != heads) config.unsupported("num_key_value_heads", std::to_string(kv_heads), "num_attention_heads");

  Attention attention;
  attention.has_indexer = k3;
  // Kimi Delta Attention: linear_attn_config (as Kimi ships it) overrides the linear_* fields.
  const Config linear_attn =
      config.has("linear_attn_config") ? config.get_object("linear_attn_config") : Config(nlohmann::json::object(), config.where());
  auto linear_size = [&](const std::string& sub_key, const std::string& key, int64_t def) {
    const Config& from = linear_attn.has(sub_key) ? linear_attn : config;
    const std::string& name = linear_attn.has(sub_key) ? sub_key : key;
    const int64_t value = from.get_int(name, def);
    from.require(value > 0, name, "a positive integer");
    return value;
  };
  KdaConfig& kda = attention.kda;
  kda.hidden = hidden;
  kda.head_dim = linear_size("head_dim", "linear_head_dim", 128);
  kda.num_heads = linear_size("num_heads", "linear_num_heads", 32);
  kda.conv_kernel = linear_size("short_conv_kernel_size", "linear_conv_kernel_dim", 4);
  kda.norm_eps = float(config.get_float("rms_norm_eps", 1e-5));
  attention.layer_types = attention_layer_types(config, linear_attn, num_layers);

  // MLA without RoPE (KimiLinearAttention); q_lora_rank null means a plain q_proj.
  MlaOptions& mla = attention.mla;
  mla.hidden = hidden;
  mla.num_heads = heads;
  mla.q_lora_rank = config.get_int("q_lora_rank", 0);
  mla.kv_lora_rank = config.get_int("kv_lora_rank", 512);
  mla.qk_nope_head_dim = config.get_int("qk_nope_head_dim", 128);
  mla.qk_rope_head_dim = config.get_int("qk_rope_head_dim", 64);
  mla.v_head_dim = config.get_int("v_head_dim", 128);
  mla.softmax_scale = mla_softmax_scale(mla.qk_head_dim(), nlohmann::json());  // qk_head_dim^-0.5, no YaRN factor
  mla.attention_bias = config.get_bool("attention_bias", false);
  config.require(mla.q_lora_rank >= 0, "q_lora_rank", "null or a positive integer");
  if (k3) config.require(mla.q_lora_rank > 0, "q_lora_rank", "a positive integer for kimi_k3 (the indexer reads the query latent)");

  // Kimi K3's DSA indexer (DeepseekV32Indexer; DeepseekV32Config's defaults for absent fields).
  if (k3) {
    DsaIndexerOptions& index = attention.index;
    const int64_t max_positions = config.get_int(field_key(config, "max_position_embeddings", "model_max_length"), 1048576);
    index.hidden = hidden;
    index.query_input = mla.q_lora_rank;
    index.num_heads = config.get_int("index_n_heads", 64);
    index.head_dim = config.get_int("index_head_dim", 128);
    index.topk = config.get_int("index_topk", 2048);
    index.rope = Rope::from_config(config.rope_parameters(10000.0, max_positions), int(mla.qk_rope_head_dim),
                                   max_positions);
    config.require(index.num_heads > 0, "index_n_heads", "a positive integer");
    config.require(index.head_dim >= mla.qk_rope_head_dim, "index_head_dim", "at least qk_rope_head_dim");
    config.require(index.topk > 0, "index_topk", "a positive integer");
  }
  return attention;
}

}  // namespace

std::vector<LayerCacheSpec> kimi_linear_cache_spec(const Config& config) {
  const Attention attention = attention_config(config);
  std::vector<LayerCacheSpec> spec;
  for (const std::string& type : attention.layer_types)
    spec.push_back(type == "linear_attention"
                       ? KdaMixer::cache_spec_for(attention.kda)
                       : MlaMixer::cache_spec_for(attention.mla, attention.has_indexer ? &attention.index : nullptr));
  return spec;
}

std::unique_ptr<DecoderModel> load_kimi_linear(Checkpoint& ckpt, const Config& config, const std::string& prefix) {
  const std::string type = config.get_string("model_type");
  const int64_t vocab = config.get_int("vocab_size", 163840);
  config.require(vocab > 0, "vocab_size", "a positive integer");
  const Attention attention = attention_config(config);
  const int64_t hidden = attention.mla.hidden;
  const int64_t num_layers = int64_t(attention.layer_types.size());
  const std::vector<std::string>& attn_types = attention.layer_types;

  // Values transformers would silently compute differently from what the checkpoint means.
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") config.unsupported("hidden_act", act, "silu");
  const std::string router_act = config.get_string("moe_router_activation_func", "sigmoid");
  if (router_act != "sigmoid") config.unsupported("moe_router_activation_func", router_act, "sigmoid");
  const int64_t moe_layer_freq = config.get_int("moe_layer_freq", 1);
  if (moe_layer_freq != 1) config.unsupported("moe_layer_freq", std::to_string(moe_layer_freq), "1");

  // MoE (KimiLinearMoE, KimiLinearTopkRouter).
  const std::string experts_key = field_key(config, "num_local_experts", "num_experts");
  const std::string per_token_key = field_key(config, "num_experts_per_tok", "num_experts_per_token");
  const std::string shared_key = field_key(config, "n_shared_experts", "num_shared_experts");
  const std::string group_key = field_key(config, "n_group", "num_expert_group");
  const int64_t num_experts = config.get_int(experts_key, 256);
  const int64_t experts_per_token = config.get_int(per_token_key, 8);
  const int64_t n_shared = config.get_int(shared_key, 1);
  const int64_t n_group = config.get_int(group_key, 1);
  const int64_t topk_group = config.get_int("topk_group", 1);
  const bool normalize = config.get_bool(field_key(config, "norm_topk_prob", "moe_renormalize"), true);
  const int64_t moe_intermediate = config.get_int("moe_intermediate_size", 1024);
  const std::vector<std::string> mlp_types = mlp_layer_types(config, num_layers);
  if (std::find(mlp_types.begin(), mlp_types.end(), "sparse") != mlp_types.end()) {
    config.require(n_group > 0 && num_experts % n_group == 0, group_key, cat("a divisor of ", experts_key));
    config.require(num_experts / n_group >= 2, group_key,
                   cat("at most ", experts_key, " / 2 (each group is scored by its two best experts)"));
    config.require(topk_group > 0 && topk_group <= n_group, "topk_group", cat("between 1 and ", group_key));
    config.require(experts_per_token > 0 && experts_per_token <= topk_group * (num_experts / n_group), per_token_key,
                   "at most the experts in topk_group groups");
    config.require(n_shared >= 1, shared_key, "at least 1");
    config.require(moe_intermediate > 0, "moe_intermediate_size", "a positive integer");
  }

  auto model = std::make_unique<DecoderModel>();
  model->type = type;
  model->vocab = vocab;
  model->hidden = hidden;
  model->norm_eps = attention.kda.norm_eps;  // KDA's gated norm and the layer norms share rms_norm_eps
  model->take_embeddings(ckpt, prefix, "lm_head.weight", config.get_bool("tie_word_embeddings", false));

  const Activation silu_glu;
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string layer_prefix = cat(prefix, "layers.", i, ".");
    DecoderLayer layer;
    layer.input_norm = ckpt.take(layer_prefix + "input_layernorm.weight", {hidden});
    layer.post_norm = ckpt.take(layer_prefix + "post_attention_layernorm.weight", {hidden});
    if (attn_types[i] == "linear_attention") {
      layer.mixer = KdaMixer::load(ckpt, layer_prefix + "self_attn.", attention.kda);
    } else {
      std::unique_ptr<DsaIndexer> indexer =
          attention.has_indexer ? DsaIndexer::load(ckpt, layer_prefix + "self_attn.indexer.", attention.index) : nullptr;
      layer.mixer = MlaMixer::load(ckpt, layer_prefix + "self_attn.", attention.mla, std::move(indexer));
    }
    if (mlp_types[i] == "dense") {
      layer.ffn = std::make_unique<DenseMlp>(DenseMlp::load(ckpt, ffn_prefix(ckpt, layer_prefix, "down_proj.weight"), hidden,
                                                           config.get_int("intermediate_size", 9216), silu_glu));
    } else {
      layer.ffn = MoeBlock::load_grouped(
          ckpt, ffn_prefix(ckpt, layer_prefix, "gate.weight"),
          {hidden, num_experts, moe_intermediate, experts_per_token, n_group, topk_group, n_shared, normalize,
           float(config.get_float("routed_scaling_factor", 2.446))});
    }
    model->layers.push_back(std::move(layer));
  }
  // Multi-token-prediction layers after the last decoder layer are not part of the causal LM.
  ckpt.finish({cat(prefix, "layers.", num_layers, ".")});
  return model;
}

}  // namespace sparrow
