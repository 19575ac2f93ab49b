// Kimi Linear (transformers 5.17 KimiLinearForCausalLM, model_type "kimi_linear") and the released Kimi K3
// and K3.1 Pro (vLLM 0.33 models/kimi_k3/nvidia/model.py KimiK3ForConditionalGeneration, model_type
// "kimi_k3": the text model is vLLM's KimiLinearConfig under text_config, its weights under
// "language_model.").
//
// Both: each layer is either Kimi Delta Attention (src/model/kda_mixer.h, "linear_attention") or MLA
// without rotary embeddings (src/model/mla.h, "full_attention": the qk_rope_head_dim "rope" dims of q and
// k are used as they are, softmax scale qk_head_dim^-0.5); its feed-forward is a dense gated MLP or a
// grouped-sigmoid-routed MoE with shared experts.
//
// Kimi K3 adds, each switched on by its own text_config field as vLLM reads it:
//   attn_res_block_size           AttnRes in place of the residual stream (model/decoder.h)
//   hidden_act "situ"             SiTU, bounded by activation_situ_beta / activation_situ_linear_beta
//                                 (kernels/glu.h), in the dense MLP, the experts and the shared experts
//   mla_use_output_gate           the MLA output times sigmoid(g_proj x) (model/mla.h)
//   linear_attn_config.use_full_rank_gate, .gate_lower_bound   K3's KDA: output gate g_proj x and the
//                                 bounded decay lb * sigmoid(exp(A_log) (f + dt_bias)) (model/kda_mixer.h)
//   routed_expert_hidden_size, latent_moe_use_norm   the latent MoE (model/feed_forward.h)
//   index_topk (index_n_heads, index_head_dim)        K3.1 Pro: a DSA indexer on every MLA layer, exactly
//                                 DeepSeek-V3.2's (model/dsa_indexer.h) but without RoPE, since K3 has
//                                 none anywhere; its weights under self_attn.indexer.
// K3.1 Pro's indexer is not public; it is built as issue 22 and ../shared/docs/real-models.md define it.
//
// The two definitions read the same fields, with different defaults (each config class's own) and two
// norm epsilons (Definition below). Kimi Linear follows transformers' KimiLinearConfig: the names Kimi's
// checkpoints use (num_experts, ...) are aliases of the transformers fields and win over them;
// linear_attn_config overrides the linear_* fields; layer types come from layer_types, else from
// linear_attn_config's 1-indexed full_attn_layers / kda_layers, else every 4th layer from layer 4
// (0-indexed) is full attention. Weights are accepted as transformers saves them and as Kimi's released
// checkpoints ship them (transformers' conversion_mapping.py "kimi_linear": block_sparse_moe,
// experts.N.w1/w2/w3, ...).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/dsa_indexer.h"
#include "model/families.h"
#include "model/feed_forward.h"
#include "model/kda_mixer.h"
#include "model/mla.h"

namespace sparrow {

namespace {

// Which code defines the model: transformers' Kimi Linear (modeling_kimi_linear.py, configuration class
// KimiLinearConfig) or vLLM 0.33's Kimi K3 (models/kimi_k3/nvidia/, transformers_utils/configs/
// kimi_linear.py). Their differences that change the numbers:
//   - defaults of absent fields (each class's __init__);
//   - q_a_layernorm / kv_a_layernorm eps: transformers builds them with RMSNorm's default 1e-6, vLLM with
//     rms_norm_eps;
//   - KDA's gated output norm eps: transformers passes rms_norm_eps, vLLM's K3 keeps FusedRMSNormGated's 1e-5;
//   - MoE layers: transformers' mlp_layer_types / first_k_dense_replace; vLLM's KimiDecoderLayer makes
//     layer l MoE iff num_experts is set, l >= first_k_dense_replace and l % moe_layer_freq == 0.
enum class Definition { TransformersKimiLinear, VllmKimiK3 };

// The default of a field under each definition.
struct Default {
  double transformers, vllm;
  double of(Definition d) const { return d == Definition::VllmKimiK3 ? vllm : transformers; }
};

// KimiLinearConfig.attribute_map (transformers): `name` is the transformers field, `alias` the name Kimi's
// own config.json uses. PreTrainedConfig stores an alias under its field, so the alias wins when both are
// set. vLLM's KimiLinearConfig has only the alias. Returns the key the value is read from (and errors name).
std::string field_key(const Config& c, const std::string& name, const std::string& alias) {
  return c.has(alias) ? alias : name;
}

// "linear_attention" or "full_attention" for every layer (KimiLinearConfig.__post_init__; vLLM's
// is_kda_layer reads only linear_attn_config).
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

// Whether each layer's feed-forward is the MoE (true) or the dense MLP, as Definition says.
std::vector<bool> moe_layers(const Config& config, Definition def, int64_t num_layers, bool has_experts) {
  std::vector<bool> moe;
  if (def == Definition::VllmKimiK3) {
    const int64_t dense = config.get_int("first_k_dense_replace", 0), freq = config.get_int("moe_layer_freq", 1);
    config.require(freq > 0, "moe_layer_freq", "a positive integer");
    for (int64_t i = 0; i < num_layers; ++i) moe.push_back(has_experts && i >= dense && i % freq == 0);
    return moe;
  }
  const int64_t moe_layer_freq = config.get_int("moe_layer_freq", 1);
  if (moe_layer_freq != 1) config.unsupported("moe_layer_freq", std::to_string(moe_layer_freq), "1");
  if (config.has("mlp_layer_types")) {
    const std::vector<std::string> types = config.get_string_list("mlp_layer_types");
    config.require(int64_t(types.size()) == num_layers, "mlp_layer_types", "a list of num_hidden_layers entries");
    for (const std::string& t : types) {
      if (t != "dense" && t != "sparse") config.unsupported("mlp_layer_types entry", t, "dense, sparse");
      moe.push_back(t == "sparse");
    }
    return moe;
  }
  const int64_t dense = config.get_int("first_k_dense_replace", 1);
  for (int64_t i = 0; i < num_layers; ++i) moe.push_back(i >= dense);
  return moe;
}

// Where a layer's feed-forward weights live: transformers saves `mlp.`, Kimi's checkpoints (and
// transformers writing in their layout) `block_sparse_moe.`, for the dense MLP as well as the MoE.
// `probe` is a tensor name present in either layout.
std::string ffn_prefix(const Checkpoint& ckpt, const std::string& layer_prefix, const std::string& probe) {
  return ckpt.has(layer_prefix + "block_sparse_moe." + probe) ? layer_prefix + "block_sparse_moe." : layer_prefix + "mlp.";
}

// The token mixers: which layers are KDA and which MLA (with a DSA indexer on Kimi K3.1 Pro), and their
// shapes. Parsed and checked once for the loader and for the cache spec.
struct Attention {
  std::vector<std::string> layer_types;  // linear_attention | full_attention, per layer
  KdaConfig kda;
  MlaOptions mla;
  bool has_indexer = false;  // Kimi K3.1 Pro
  DsaIndexerOptions index;
  float rms_norm_eps = 1e-5f;
};

Attention attention_config(const Config& config, Definition def) {
  const bool k3 = def == Definition::VllmKimiK3;
  const int64_t hidden = config.get_int("hidden_size", int64_t(Default{2304, 4096}.of(def)));
  const int64_t num_layers = config.get_int("num_hidden_layers", int64_t(Default{27, 32}.of(def)));
  const int64_t heads = config.get_int("num_attention_heads", 32);
  config.require(hidden > 0, "hidden_size", "a positive integer");
  config.require(num_layers > 0, "num_hidden_layers", "a positive integer");
  config.require(heads > 0, "num_attention_heads", "a positive integer");
  // vLLM's K3 MLA always uses the nope part (mla.py has no other path); transformers reads the flag.
  if (!k3 && !config.get_bool("mla_use_nope", true)) config.unsupported("mla_use_nope", "false", "true");
  // MLA expands its keys to one head per query head; transformers cannot repeat them further.
  const int64_t kv_heads = config.get_int("num_key_value_heads", heads);
  if (kv_heads != heads) config.unsupported("num_key_value_heads", std::to_string(kv_heads), "num_attention_heads");

  Attention attention;
  attention.rms_norm_eps = float(config.get_float("rms_norm_eps", Default{1e-5, 1e-6}.of(def)));
  config.require(attention.rms_norm_eps > 0, "rms_norm_eps", "a positive number");
  // Kimi Delta Attention: linear_attn_config (as Kimi ships it) overrides the linear_* fields.
  const Config linear_attn =
      config.has("linear_attn_config") ? config.get_object("linear_attn_config") : Config(nlohmann::json::object(), config.where());
  auto linear_size = [&](const std::string& sub_key, const std::string& key, int64_t def_value) {
    const Config& from = linear_attn.has(sub_key) ? linear_attn : config;
    const std::string& name = linear_attn.has(sub_key) ? sub_key : key;
    const int64_t value = from.get_int(name, def_value);
    from.require(value > 0, name, "a positive integer");
    return value;
  };
  KdaConfig& kda = attention.kda;
  kda.hidden = hidden;
  kda.head_dim = linear_size("head_dim", "linear_head_dim", 128);
  kda.num_heads = linear_size("num_heads", "linear_num_heads", 32);
  kda.conv_kernel = linear_size("short_conv_kernel_size", "linear_conv_kernel_dim", 4);
  kda.norm_eps = k3 ? 1e-5f : attention.rms_norm_eps;
  attention.layer_types = attention_layer_types(config, linear_attn, num_layers);
  // K3's KDA (kda.py KimiK3DeltaAttention): the full-rank output gate and the bounded decay.
  kda.full_rank_gate = k3 && linear_attn.get_bool("use_full_rank_gate", false);
  if (k3 && linear_attn.has("gate_lower_bound")) {
    kda.decay_lower_bound = float(linear_attn.get_float("gate_lower_bound"));
    linear_attn.require(kda.decay_lower_bound < 0, "gate_lower_bound", "a negative number (the decay's bound)");
  }

  // MLA without RoPE (KimiLinearAttention, vLLM mla.py with use_rope=False); q_lora_rank null means a plain
  // q_proj.
  MlaOptions& mla = attention.mla;
  mla.hidden = hidden;
  mla.num_heads = heads;
  mla.q_lora_rank = config.get_int("q_lora_rank", 0);
  mla.kv_lora_rank = config.get_int("kv_lora_rank", 512);
  mla.qk_nope_head_dim = config.get_int("qk_nope_head_dim", 128);
  mla.qk_rope_head_dim = config.get_int("qk_rope_head_dim", 64);
  mla.v_head_dim = config.get_int("v_head_dim", 128);
  mla.softmax_scale = mla_softmax_scale(mla.qk_head_dim(), nlohmann::json());  // qk_head_dim^-0.5, no YaRN factor
  mla.attention_bias = !k3 && config.get_bool("attention_bias", false);       // K3's linears have no bias
  mla.output_gate = k3 && config.get_bool("mla_use_output_gate", false);
  if (k3) mla.q_norm_eps = mla.kv_norm_eps = attention.rms_norm_eps;
  config.require(mla.q_lora_rank >= 0, "q_lora_rank", "null or a positive integer");

  // Kimi K3.1 Pro's DSA indexer: DeepSeek-V3.2's (DeepseekV32Config's defaults for absent sizes), no RoPE.
  attention.has_indexer = k3 && config.has("index_topk");
  if (attention.has_indexer) {
    config.require(mla.q_lora_rank > 0, "q_lora_rank",
                   "a positive integer with index_topk (the indexer reads the query latent)");
    DsaIndexerOptions& index = attention.index;
    index.hidden = hidden;
    index.query_input = mla.q_lora_rank;
    index.num_heads = config.get_int("index_n_heads", 64);
    index.head_dim = config.get_int("index_head_dim", 128);
    index.topk = config.get_int("index_topk");
    config.require(index.num_heads > 0, "index_n_heads", "a positive integer");
    config.require(index.head_dim > 0, "index_head_dim", "a positive integer");
    config.require(index.topk > 0, "index_topk", "a positive integer");
  }
  return attention;
}

// Kimi K3 fields that transformers' Kimi Linear does not read: a kimi_linear config that sets one means a
// network transformers would run differently, so it is refused rather than ignored.
void refuse_k3_fields(const Config& config) {
  for (const char* key : {"attn_res_block_size", "routed_expert_hidden_size", "index_topk"})
    if (config.has(key)) config.unsupported(key, "set", "absent for model_type kimi_linear (it is a Kimi K3 field; "
                                                         "a K3 checkpoint has model_type kimi_k3)");
  if (config.get_bool("mla_use_output_gate", false))
    config.unsupported("mla_use_output_gate", "true", "false for model_type kimi_linear (a Kimi K3 field)");
  if (config.has("linear_attn_config")) {
    const Config linear_attn = config.get_object("linear_attn_config");
    if (linear_attn.get_bool("use_full_rank_gate", false) || linear_attn.has("gate_lower_bound"))
      config.unsupported("linear_attn_config", "use_full_rank_gate / gate_lower_bound",
                         "neither for model_type kimi_linear (Kimi K3 fields)");
  }
}

// The gated activation of the MLPs and experts: SiLU (both), SiTU (K3).
Activation activation(const Config& config, Definition def) {
  const std::string act = config.get_string("hidden_act", "silu");
  if (act == "silu") return Activation{};
  if (act != "situ" || def != Definition::VllmKimiK3)
    config.unsupported("hidden_act", act, def == Definition::VllmKimiK3 ? "silu, situ" : "silu");
  // KimiMLP: activation_situ_beta or 1.0; the linear bound applies when set and positive.
  Activation situ{Glu::Situ, float(config.get_float("activation_situ_beta", 1.0)), 0.0f};
  if (situ.alpha == 0.0f) situ.alpha = 1.0f;  // `or 1.0`: a zero beta means the default
  config.require(situ.alpha > 0, "activation_situ_beta", "a positive number");
  situ.limit = std::max(0.0f, float(config.get_float("activation_situ_linear_beta", 0.0)));
  return situ;
}

std::vector<LayerCacheSpec> cache_spec(const Config& config, Definition def) {
  const Attention attention = attention_config(config, def);
  std::vector<LayerCacheSpec> spec;
  for (const std::string& type : attention.layer_types)
    spec.push_back(type == "linear_attention"
                       ? KdaMixer::cache_spec_for(attention.kda)
                       : MlaMixer::cache_spec_for(attention.mla, attention.has_indexer ? &attention.index : nullptr));
  return spec;
}

// One AttnRes query (model/decoder.h): <name>_norm.weight [hidden] and <name>_proj.weight [1, hidden], fp32.
AttnResQuery take_attn_res_query(Checkpoint& ckpt, const std::string& name, int64_t hidden) {
  AttnResQuery q;
  q.norm = ckpt.take_fp32(name + "_norm.weight", {hidden});
  q.proj = ckpt.take_fp32(name + "_proj.weight", {1, hidden}).reshape({hidden});
  return q;
}

// Everything the loader reads from the config besides the weights, parsed and checked once (the model's
// layers and the MTP layer share it).
struct Settings {
  bool k3 = false;
  int64_t vocab = 0, hidden = 0, num_layers = 0;
  Attention attention;
  Activation act;
  int64_t attn_res_block = 0;
  std::vector<bool> moe;  // per layer: the MoE, else the dense MLP
  GroupedMoeShape shape;
  int64_t intermediate = 0;  // the dense MLP's
  bool has_experts = false;
};

Settings settings(const Config& config, Definition def) {
  Settings s;
  s.k3 = def == Definition::VllmKimiK3;
  const bool k3 = s.k3;
  if (!k3) refuse_k3_fields(config);
  s.vocab = config.get_int("vocab_size", 163840);
  config.require(s.vocab > 0, "vocab_size", "a positive integer");
  s.attention = attention_config(config, def);
  s.hidden = s.attention.mla.hidden;
  s.num_layers = int64_t(s.attention.layer_types.size());

  // Values the reference would compute differently from what the checkpoint means.
  s.act = activation(config, def);
  const std::string router_act = config.get_string("moe_router_activation_func", "sigmoid");
  if (router_act != "sigmoid") config.unsupported("moe_router_activation_func", router_act, "sigmoid");
  s.attn_res_block = k3 ? config.get_int("attn_res_block_size", 0) : 0;
  config.require(s.attn_res_block >= 0, "attn_res_block_size", "null or a positive integer");

  // MoE (KimiLinearMoE / KimiLinearTopkRouter; vLLM KimiMoE with grouped_topk).
  const std::string experts_key = field_key(config, "num_local_experts", "num_experts");
  const std::string per_token_key = field_key(config, "num_experts_per_tok", "num_experts_per_token");
  const std::string shared_key = field_key(config, "n_shared_experts", "num_shared_experts");
  const std::string group_key = field_key(config, "n_group", "num_expert_group");
  s.has_experts = !k3 || config.has(experts_key);  // vLLM: num_experts None means no MoE layer
  s.moe = moe_layers(config, def, s.num_layers, s.has_experts);
  GroupedMoeShape& shape = s.shape;
  shape.hidden = s.hidden;
  shape.num_experts = config.get_int(experts_key, 256);
  shape.top_k = config.get_int(per_token_key, 8);
  shape.n_shared = config.get_int(shared_key, int64_t(Default{1, 0}.of(def)));
  shape.n_group = config.get_int(group_key, 1);
  shape.topk_group = config.get_int("topk_group", 1);
  shape.normalize = config.get_bool(field_key(config, "norm_topk_prob", "moe_renormalize"), true);
  shape.intermediate = config.get_int("moe_intermediate_size", 1024);
  shape.routed_scaling_factor = float(config.get_float("routed_scaling_factor", Default{2.446, 1.0}.of(def)));
  shape.act = s.act;
  if (k3) {
    shape.latent = config.get_int("routed_expert_hidden_size", 0);
    shape.latent_norm = config.get_bool("latent_moe_use_norm", false);
    shape.latent_norm_eps = s.attention.rms_norm_eps;
  }
  if (std::find(s.moe.begin(), s.moe.end(), true) != s.moe.end()) {
    config.require(shape.n_group > 0 && shape.num_experts % shape.n_group == 0, group_key, cat("a divisor of ", experts_key));
    config.require(shape.num_experts / shape.n_group >= 2, group_key,
                   cat("at most ", experts_key, " / 2 (each group is scored by its two best experts)"));
    config.require(shape.topk_group > 0 && shape.topk_group <= shape.n_group, "topk_group", cat("between 1 and ", group_key));
    config.require(shape.top_k > 0 && shape.top_k <= shape.topk_group * (shape.num_experts / shape.n_group),
                   per_token_key, "at most the experts in topk_group groups");
    config.require(k3 ? shape.n_shared >= 0 : shape.n_shared >= 1, shared_key, k3 ? "0 or more" : "at least 1");
    config.require(shape.intermediate > 0, "moe_intermediate_size", "a positive integer");
    config.require(shape.latent >= 0, "routed_expert_hidden_size", "null or a positive integer");
  }
  s.intermediate = config.get_int("intermediate_size", int64_t(Default{9216, 11008}.of(def)));
  return s;
}

// One layer's norms, mixer (KDA, or MLA with its indexer on K3.1 Pro) and feed-forward (the MoE or the
// dense MLP); AttnRes queries are the caller's.
DecoderLayer load_layer(Checkpoint& ckpt, const std::string& layer_prefix, const Settings& s, bool kda, bool moe) {
  DecoderLayer layer;
  layer.input_norm = ckpt.take(layer_prefix + "input_layernorm.weight", {s.hidden});
  layer.post_norm = ckpt.take(layer_prefix + "post_attention_layernorm.weight", {s.hidden});
  if (kda) {
    layer.mixer = KdaMixer::load(ckpt, layer_prefix + "self_attn.", s.attention.kda);
  } else {
    std::unique_ptr<DsaIndexer> indexer =
        s.attention.has_indexer ? DsaIndexer::load(ckpt, layer_prefix + "self_attn.indexer.", s.attention.index) : nullptr;
    layer.mixer = MlaMixer::load(ckpt, layer_prefix + "self_attn.", s.attention.mla, std::move(indexer));
  }
  if (moe)
    layer.ffn = MoeBlock::load_grouped(ckpt, ffn_prefix(ckpt, layer_prefix, "gate.weight"), s.shape);
  else
    layer.ffn = std::make_unique<DenseMlp>(
        DenseMlp::load(ckpt, ffn_prefix(ckpt, layer_prefix, "down_proj.weight"), s.hidden, s.intermediate, s.act));
  return layer;
}

std::unique_ptr<DecoderModel> load(Checkpoint& ckpt, const Config& config, const std::string& prefix, Definition def) {
  const Settings s = settings(config, def);
  const bool k3 = s.k3;
  const int64_t hidden = s.hidden, num_layers = s.num_layers;

  auto model = std::make_unique<DecoderModel>();
  model->type = k3 ? "kimi_k3" : config.get_string("model_type");
  model->vocab = s.vocab;
  model->hidden = hidden;
  model->norm_eps = s.attention.rms_norm_eps;
  // vLLM's Kimi K3 applies model.norm in compute_logits: its MTP layer reads the state before it.
  model->hidden_for_drafter_normed = !k3;
  // The head sits beside the decoder: "lm_head.weight" for "model.", "language_model.lm_head.weight" for
  // "language_model.model.".
  const std::string head = prefix.substr(0, prefix.size() - std::strlen("model.")) + "lm_head.weight";
  model->take_embeddings(ckpt, prefix, head, config.get_bool("tie_word_embeddings", false));
  model->attn_res_block = s.attn_res_block;
  if (s.attn_res_block > 0) model->output_attn_res = take_attn_res_query(ckpt, prefix + "output_attn_res", hidden);

  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string layer_prefix = cat(prefix, "layers.", i, ".");
    DecoderLayer layer =
        load_layer(ckpt, layer_prefix, s, s.attention.layer_types[size_t(i)] == "linear_attention", s.moe[size_t(i)]);
    if (s.attn_res_block > 0) {
      layer.before_mixer = take_attn_res_query(ckpt, layer_prefix + "self_attention_res", hidden);
      layer.before_ffn = take_attn_res_query(ckpt, layer_prefix + "mlp_res", hidden);
    }
    model->layers.push_back(std::move(layer));
  }
  // Multi-token-prediction layers after the last decoder layer are not part of the causal LM (the
  // speculative decoder reads them).
  std::vector<std::string> ignored;
  for (int64_t i = 0; i < std::max<int64_t>(1, config.get_int("num_nextn_predict_layers", 0)); ++i)
    ignored.push_back(cat(prefix, "layers.", num_layers + i, "."));
  if (k3) {
    // The release is multimodal (KimiK3ForConditionalGeneration): its MoonViT tower and projector are the vision
    // loader's (model/kimi_k3_vision.h, ModelFamily::load_vision), which reads them on its own.
    for (const char* tower : {"vision_tower.", "mm_projector."}) ignored.push_back(tower);
  }
  ckpt.finish(ignored);
  return model;
}

}  // namespace

Activation kimi_k3_activation(const Config& config) { return activation(config, Definition::VllmKimiK3); }

std::vector<LayerCacheSpec> kimi_linear_cache_spec(const Config& config) {
  return cache_spec(config, Definition::TransformersKimiLinear);
}
std::vector<LayerCacheSpec> kimi_k3_cache_spec(const Config& text) { return cache_spec(text, Definition::VllmKimiK3); }

std::unique_ptr<DecoderModel> load_kimi_linear(Checkpoint& ckpt, const Config& config, const std::string& prefix) {
  return load(ckpt, config, prefix, Definition::TransformersKimiLinear);
}
std::unique_ptr<DecoderModel> load_kimi_k3(Checkpoint& ckpt, const Config& text, const std::string& prefix) {
  return load(ckpt, text, prefix, Definition::VllmKimiK3);
}

// vLLM 0.33 mtp.py::KimiK3MultiTokenPredictorLayer (real-models.md 1.6): layer L is an MLA layer (L + 1 is
// not a KDA layer) with the feed-forward vLLM's is_moe_layer gives it, AttnRes off; the embedding is the
// model's, the head shared_head.head.
std::unique_ptr<MtpDrafter> load_kimi_k3_mtp(Checkpoint& ckpt, const Config& text, const std::string& prefix) {
  const Settings s = settings(text, Definition::VllmKimiK3);
  SPARROW_CHECK(text.get_int("num_nextn_predict_layers", 0) >= 1, "speculative decoding: method \"mtp\": the "
                "checkpoint has no multi-token-prediction layer (num_nextn_predict_layers is 0)");
  const int64_t L = s.num_layers;
  const std::string mtp = cat(prefix, "layers.", L, ".");
  require_mtp_layer(ckpt, mtp);
  const int64_t dense = text.get_int("first_k_dense_replace", 0), freq = text.get_int("moe_layer_freq", 1);
  const bool moe = s.has_experts && L >= dense && L % freq == 0;

  auto drafter = std::make_unique<MtpDrafter>();
  drafter->type = "kimi_k3";
  drafter->placed_on = ckpt.device();
  drafter->vocab = s.vocab;
  drafter->hidden = s.hidden;
  drafter->norm_eps = s.attention.rms_norm_eps;
  drafter->layer_index = int(L);
  drafter->target_cache_spec = cache_spec(text, Definition::VllmKimiK3);
  drafter->embed = ckpt.take(prefix + "embed_tokens.weight", {s.vocab, s.hidden});
  drafter->head = ckpt.take(mtp + "shared_head.head.weight", {s.vocab, s.hidden});
  drafter->enorm = ckpt.take(mtp + "enorm.weight", {s.hidden});
  drafter->hnorm = ckpt.take(mtp + "hnorm.weight", {s.hidden});
  drafter->eh_proj = ckpt.take(mtp + "eh_proj.weight", {s.hidden, 2 * s.hidden});
  drafter->norm = ckpt.take(mtp + "shared_head.norm.weight", {s.hidden});
  drafter->layer = load_layer(ckpt, mtp, s, /*kda=*/false, moe);
  // Everything else is the target's (its vision tower too).
  ckpt.finish({prefix, prefix.substr(0, prefix.size() - std::strlen("model.")), "vision_tower.", "mm_projector."});
  return drafter;
}

}  // namespace sparrow
