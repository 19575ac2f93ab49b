#include "bench/roofline.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "cache/planner.h"
#include "core/error.h"
#include "formats/quantization.h"
#include "model/families.h"
#include "model/model.h"

namespace sparrow::bench {

namespace {

// How a weight is stored on the GPU (formats/checkpoint.h): matrices bfloat16; vectors float32; with an
// FP8 config, the projections read through take_linear (and the routed experts) as E4M3 codes with one
// fp32 scale per 128x128 block, when the FP8 product takes their shape (in % 16, out % 8); with an MXFP8
// config, those projections as E4M3 codes with an E8M0 scale per 32 values (in % 32).
enum class Store { Matrix, Vector, Linear };

// Under tensor parallelism (docs/parallel.md, "What is split"), `replicated` counts what every rank keeps
// whole: norms and other vectors (vector()), and the projections added with add_replicated(); the rest is
// split T ways.
struct Counter {
  bool fp8 = false, mxfp8 = false;
  double params = 0, bytes = 0;
  double replicated_params = 0, replicated_bytes = 0;

  double bytes_of(Store store, double n, int64_t out, int64_t in) const {
    if (store == Store::Vector) return 4 * n;
    if (store == Store::Linear && fp8 && in % 16 == 0 && out % 8 == 0) return n * (1.0 + 4.0 / (128.0 * 128.0));
    if (store == Store::Linear && mxfp8 && in % 32 == 0) return n * (1.0 + 1.0 / 32.0);
    return 2 * n;
  }
  void add(Store store, int64_t out, int64_t in = 1) {
    const double n = double(out) * double(in);
    params += n;
    bytes += bytes_of(store, n, out, in);
  }
  void add_replicated(Store store, int64_t out, int64_t in = 1) {
    const double before_params = params, before_bytes = bytes;
    add(store, out, in);
    replicated_params += params - before_params;
    replicated_bytes += bytes - before_bytes;
  }
  void vector(int64_t n) { add_replicated(Store::Vector, n); }
  void split_vector(int64_t n) { add(Store::Vector, n); }  // a vector split with its heads
};

// The fields the families read, with their defaults (model/deepseek_v32.cpp, kimi_linear.cpp,
// minimax_m3.cpp): kept in step by tests/bench_sweep_test.cpp, which loads every fixture with dummy weights
// and compares the parameter count.
struct Mla {
  int64_t hidden, heads, q_lora, kv_lora, nope, rope, v;
  bool bias;
  void count(Counter& c) const {
    if (q_lora > 0) {
      c.add_replicated(Store::Linear, q_lora, hidden);  // q_a_proj: every rank's query heads read it
      if (bias) c.vector(q_lora);
      c.vector(q_lora);  // q_a_layernorm
      c.add(Store::Linear, heads * (nope + rope), q_lora);
    } else {
      c.add(Store::Linear, heads * (nope + rope), hidden);
    }
    c.add_replicated(Store::Linear, kv_lora + rope, hidden);  // kv_a_proj_with_mqa: the replicated latent
    if (bias) c.vector(kv_lora + rope);
    c.vector(kv_lora);                                     // kv_a_layernorm
    c.add(Store::Matrix, heads * (nope + v), kv_lora);     // kv_b_proj (take: bf16 even when FP8)
    c.add(Store::Linear, hidden, heads * v);
    if (bias) c.vector(hidden);
  }
  // Absorbed form: each query head scores the cached latent + rope key and sums the latent.
  double flops_per_key() const { return 2.0 * double(heads) * double(kv_lora + rope + kv_lora); }
};

struct Dsa {
  int64_t hidden, query_input, heads, dim, topk;
  void count(Counter& c) const {  // computed whole on every rank, so that all select the same top-k
    c.add_replicated(Store::Linear, heads * dim, query_input);
    c.add_replicated(Store::Linear, dim, hidden);
    c.vector(2 * dim);  // k_norm weight and bias
    c.add_replicated(Store::Linear, heads, hidden);
  }
};

// DenseMlp::load: gate and up through take_linear when intermediate % 128 == 0, else take.
void count_mlp(Counter& c, int64_t hidden, int64_t intermediate) {
  const Store gate_up = intermediate % 128 == 0 ? Store::Linear : Store::Matrix;
  c.add(gate_up, intermediate, hidden);
  c.add(gate_up, intermediate, hidden);
  c.add(Store::Linear, hidden, intermediate);
}

struct Families {
  Counter dense, embedding;
  double tied_params = 0, tied_bytes = 0;  // a tied head: in `dense` (read every step) and stored once
  WeightFormat expert_packed = WeightFormat::Dense;  // group-scaled routed experts: Nvfp4, Mxfp4 or Mxfp8
  ModelCost cost;
};

// `latent` > 0: Kimi K3's latent MoE, whose experts work at that width between a down and an up projection.
void add_moe_layer(Families& f, int64_t hidden, int64_t experts, int64_t top_k, int64_t intermediate,
                   int64_t shared_intermediate, int64_t latent = 0, bool latent_norm = false) {
  f.dense.add_replicated(Store::Matrix, experts, hidden);  // router
  if (shared_intermediate > 0) count_mlp(f.dense, hidden, shared_intermediate);
  if (latent > 0) {
    f.dense.add_replicated(Store::Linear, latent, hidden), f.dense.add_replicated(Store::Linear, hidden, latent);
    if (latent_norm) f.dense.vector(latent);
    f.cost.latent_moe_layers += 1;
    f.cost.moe_latent = latent;
    hidden = latent;
  }
  if (f.cost.moe_layers == 0) {
    Counter one;
    one.fp8 = f.dense.fp8;
    one.mxfp8 = f.dense.mxfp8;
    // Routed experts follow take_experts' FP8 rule (I and H multiples of 16), which the product rule
    // above also gives for a [2I, H] and an [H, I] matrix with these sizes.
    one.add(Store::Linear, 2 * intermediate, hidden);
    one.add(Store::Linear, hidden, intermediate);
    f.cost.expert_params = one.params;
    f.cost.expert_bytes = one.bytes;
    // Group-scaled experts (take_grouped_experts: I and H multiples of 32): half a byte a weight (FP4) or
    // one (MXFP8), one scale byte per group, NVFP4's three fp32 global scales.
    const WeightFormat packed = f.expert_packed;
    if (packed != WeightFormat::Dense && intermediate % 32 == 0 && hidden % 32 == 0)
      f.cost.expert_bytes =
          one.params * ((packed == WeightFormat::Mxfp8 ? 1.0 : 0.5) + 1.0 / double(scale_group(packed))) +
          (packed == WeightFormat::Nvfp4 ? 3 * 4 : 0);
    f.cost.num_experts = experts;
    f.cost.experts_per_token = top_k;
  }
  f.cost.moe_layers += 1;
}

std::string key_or_alias(const Config& c, const std::string& name, const std::string& alias) {
  return c.has(alias) ? alias : name;
}

std::vector<std::string> dense_first(const Config& c, int64_t layers, int64_t default_dense) {
  if (c.has("mlp_layer_types")) {
    std::vector<std::string> types = c.get_string_list("mlp_layer_types");
    c.require(int64_t(types.size()) == layers, "mlp_layer_types", "a list of num_hidden_layers entries");
    return types;
  }
  const int64_t dense = c.get_int("first_k_dense_replace", default_dense);
  std::vector<std::string> types(size_t(layers), "sparse");
  for (int64_t i = 0; i < std::min(dense, layers); ++i) types[size_t(i)] = "dense";
  return types;
}

// The embedding table (a step gathers B rows of it), the final norm, and the head, which every step's
// logits read whole (when tied, the head is the embedding table: read every step, stored once).
void embeddings(Families& f, int64_t vocab, int64_t hidden, bool tied) {
  f.cost.hidden = hidden;
  f.cost.vocab = vocab;
  f.embedding.add(Store::Matrix, vocab, hidden);
  f.dense.vector(hidden);
  f.dense.add(Store::Matrix, vocab, hidden);
  if (tied) f.tied_params = f.embedding.params, f.tied_bytes = f.embedding.bytes;
}

void deepseek_v32(Families& f, const Config& c) {
  const int64_t hidden = c.get_int("hidden_size", 7168), layers = c.get_int("num_hidden_layers", 61);
  const Mla mla{hidden,
                c.get_int("num_attention_heads", 128),
                c.get_int("q_lora_rank", 1536),
                c.get_int("kv_lora_rank", 512),
                c.get_int("qk_nope_head_dim", 128),
                c.get_int("qk_rope_head_dim", 64),
                c.get_int("v_head_dim", 128),
                c.get_bool("attention_bias", false)};
  const Dsa dsa{hidden, mla.q_lora, c.get_int("index_n_heads", 64), c.get_int("index_head_dim", 128),
                c.get_int("index_topk", 2048)};
  const int64_t experts = c.get_int("num_experts", c.get_int("n_routed_experts", 256));
  const std::vector<std::string> mlp = dense_first(c, layers, 3);
  embeddings(f, c.get_int("vocab_size", 129280), hidden, c.get_bool("tie_word_embeddings", false));
  for (int64_t i = 0; i < layers; ++i) {
    f.dense.vector(2 * hidden);
    mla.count(f.dense);
    dsa.count(f.dense);
    MixerCost m;
    m.kind = "mla_dsa";
    m.heads = mla.heads;
    m.attended_limit = dsa.topk;
    m.flops_per_key = mla.flops_per_key();
    m.index_flops_per_key = 2.0 * double(dsa.heads * dsa.dim);
    f.cost.mixers.push_back(m);
    const int64_t moe_intermediate = c.get_int("moe_intermediate_size", 2048);
    if (mlp.at(size_t(i)) == "dense")
      count_mlp(f.dense, hidden, c.get_int("intermediate_size", 18432));
    else
      add_moe_layer(f, hidden, experts, c.get_int("num_experts_per_tok", 8), moe_intermediate,
                    moe_intermediate * c.get_int("n_shared_experts", 1));
  }
}

std::vector<std::string> kimi_layer_types(const Config& c, const Config& linear, int64_t layers) {
  if (c.has("layer_types")) return c.get_string_list("layer_types");
  std::vector<std::string> types(static_cast<size_t>(layers), std::string());
  if (linear.has("full_attn_layers") && linear.has("kda_layers")) {
    for (int64_t l : linear.get_int_list("full_attn_layers")) types.at(size_t(l - 1)) = "full_attention";
    for (int64_t l : linear.get_int_list("kda_layers")) types.at(size_t(l - 1)) = "linear_attention";
    return types;
  }
  for (int64_t i = 0; i < layers; ++i) types[size_t(i)] = i > 0 && i % 4 == 0 ? "full_attention" : "linear_attention";
  return types;
}

// Kimi Linear (transformers' defaults) or Kimi K3 (vLLM's defaults and K3's fields), model/kimi_linear.cpp.
void kimi_linear(Families& f, const Config& c, bool k3) {
  const int64_t hidden = c.get_int("hidden_size", k3 ? 4096 : 2304),
                layers = c.get_int("num_hidden_layers", k3 ? 32 : 27);
  const Config linear =
      c.has("linear_attn_config") ? c.get_object("linear_attn_config") : Config(nlohmann::json::object(), c.where());
  auto linear_size = [&](const std::string& sub, const std::string& key, int64_t def) {
    return linear.has(sub) ? linear.get_int(sub) : c.get_int(key, def);
  };
  const int64_t D = linear_size("head_dim", "linear_head_dim", 128),
                H = linear_size("num_heads", "linear_num_heads", 32);
  const int64_t kernel = linear_size("short_conv_kernel_size", "linear_conv_kernel_dim", 4), P = H * D;
  const Mla mla{hidden,
                c.get_int("num_attention_heads", 32),
                c.get_int("q_lora_rank", 0),
                c.get_int("kv_lora_rank", 512),
                c.get_int("qk_nope_head_dim", 128),
                c.get_int("qk_rope_head_dim", 64),
                c.get_int("v_head_dim", 128),
                !k3 && c.get_bool("attention_bias", false)};
  const Dsa dsa{hidden, mla.q_lora, c.get_int("index_n_heads", 64), c.get_int("index_head_dim", 128),
                c.get_int("index_topk", 2048)};
  const bool indexer = k3 && c.has("index_topk"), mla_gate = k3 && c.get_bool("mla_use_output_gate", false);
  const bool full_rank_gate = k3 && linear.get_bool("use_full_rank_gate", false);
  const bool attn_res = k3 && c.get_int("attn_res_block_size", 0) > 0;
  const std::string experts_key = key_or_alias(c, "num_local_experts", "num_experts");
  const int64_t experts = c.get_int(experts_key, 256);
  const int64_t top_k = c.get_int(key_or_alias(c, "num_experts_per_tok", "num_experts_per_token"), 8);
  const int64_t shared = c.get_int(key_or_alias(c, "n_shared_experts", "num_shared_experts"), k3 ? 0 : 1);
  const int64_t moe_intermediate = c.get_int("moe_intermediate_size", 1024);
  const int64_t latent = k3 ? c.get_int("routed_expert_hidden_size", 0) : 0;
  const std::vector<std::string> types = kimi_layer_types(c, linear, layers);
  std::vector<std::string> mlp = dense_first(c, layers, 1);
  if (k3) {  // vLLM's KimiDecoderLayer: MoE iff num_experts is set, l >= first_k_dense_replace, l % freq == 0
    const int64_t dense = c.get_int("first_k_dense_replace", 0), freq = c.get_int("moe_layer_freq", 1);
    c.require(freq > 0, "moe_layer_freq", "a positive integer");
    for (int64_t i = 0; i < layers; ++i)
      mlp[size_t(i)] = c.has(experts_key) && i >= dense && i % freq == 0 ? "sparse" : "dense";
  }
  embeddings(f, c.get_int("vocab_size", 163840), hidden, c.get_bool("tie_word_embeddings", false));
  if (attn_res) f.dense.vector(2 * hidden);  // output_attn_res_norm, _proj
  for (int64_t i = 0; i < layers; ++i) {
    f.dense.vector((attn_res ? 6 : 2) * hidden);  // the layer norms (and AttnRes's two queries of two vectors)
    MixerCost m;
    if (types.at(size_t(i)) == "linear_attention") {
      Counter& d = f.dense;
      d.add(Store::Linear, P, hidden), d.add(Store::Linear, P, hidden), d.add(Store::Linear, P, hidden);
      d.split_vector(3 * P * kernel);  // q/k/v short convolutions, fp32
      d.add_replicated(Store::Linear, D, hidden), d.add(Store::Linear, P, D);  // forget gate f_a, f_b
      d.split_vector(P + H);                                                  // dt_bias, A_log
      d.add(Store::Linear, H, hidden);                                        // b_proj
      if (full_rank_gate)
        d.add(Store::Linear, P, hidden);  // output gate g_proj (K3)
      else
        d.add_replicated(Store::Linear, D, hidden), d.add(Store::Linear, P, D);  // output gate g_a, g_b
      d.vector(D);                                                  // o_norm
      d.add(Store::Linear, hidden, P);
      m.kind = "kda";
      m.heads = H;
      // Decay, k^T S, the rank-one update and S^T q: four D x D passes per head, 2 FLOPs each.
      m.state_flops = 8.0 * double(H) * double(D) * double(D);
    } else {
      mla.count(f.dense);
      if (mla_gate) f.dense.add(Store::Linear, mla.heads * mla.v, hidden);  // g_proj
      m.kind = "mla";
      m.heads = mla.heads;
      m.flops_per_key = mla.flops_per_key();
      if (indexer) {
        dsa.count(f.dense);
        m.kind = "mla_dsa";
        m.attended_limit = dsa.topk;
        m.index_flops_per_key = 2.0 * double(dsa.heads * dsa.dim);
      }
    }
    f.cost.mixers.push_back(m);
    if (mlp.at(size_t(i)) == "dense")
      count_mlp(f.dense, hidden, c.get_int("intermediate_size", k3 ? 11008 : 9216));
    else
      add_moe_layer(f, hidden, experts, top_k, moe_intermediate, moe_intermediate * shared, latent,
                    c.get_bool("latent_moe_use_norm", false));
  }
}

void minimax_m3(Families& f, const Config& c, bool tied_outside) {
  const int64_t hidden = c.get_int("hidden_size", 6144), layers = c.get_int("num_hidden_layers", 60);
  const int64_t heads = c.get_int("num_attention_heads", 64), kv_heads = c.get_int("num_key_value_heads", 4);
  const int64_t head_dim = c.get_int("head_dim", 128);
  int64_t index_heads = c.get_int("index_n_heads", 4), index_dim = c.get_int("index_head_dim", 128);
  int64_t block = c.get_int("index_block_size", 128), topk_blocks = c.get_int("index_topk_blocks", 16);
  std::vector<std::string> types(size_t(layers), "full_attention");
  if (c.has("sparse_attention_config")) {
    const Config s = c.get_object("sparse_attention_config");
    index_heads = s.get_int("sparse_num_index_heads", index_heads);
    index_dim = s.get_int("sparse_index_dim", index_dim);
    block = s.get_int("sparse_block_size", block);
    topk_blocks = s.get_int("sparse_topk_blocks", topk_blocks);
    if (!c.has("layer_types") && s.has("sparse_attention_freq")) {
      const nlohmann::json& flags = s.json()["sparse_attention_freq"];
      for (size_t i = 0; i < flags.size() && i < types.size(); ++i)
        if (flags[i].is_boolean() ? flags[i].get<bool>() : flags[i].get<int64_t>() != 0) types[i] = "minimax_m3_sparse";
    }
  }
  if (c.has("layer_types")) types = c.get_string_list("layer_types");
  std::vector<std::string> mlp(size_t(layers), "sparse");
  if (c.has("mlp_layer_types")) {
    mlp = c.get_string_list("mlp_layer_types");
  } else if (c.has("moe_layer_freq")) {
    const nlohmann::json& flags = c.json()["moe_layer_freq"];
    for (size_t i = 0; i < flags.size() && i < mlp.size(); ++i)
      mlp[i] = (flags[i].is_boolean() ? flags[i].get<bool>() : flags[i].get<int64_t>() != 0) ? "sparse" : "dense";
  }
  const int64_t experts = c.get_int("num_local_experts", c.get_int("num_experts", 128));
  embeddings(f, c.get_int("vocab_size", 200064), hidden, c.get_bool("tie_word_embeddings", false) || tied_outside);
  for (int64_t i = 0; i < layers; ++i) {
    Counter& d = f.dense;
    d.vector(2 * hidden);
    // GqaAttention's projections go through take_linear() (FP8 where the checkpoint is); the indexer's
    // through take(): bf16 whatever the config's quantization.
    d.add(Store::Linear, heads * head_dim, hidden);
    d.add(Store::Linear, kv_heads * head_dim, hidden);
    d.add(Store::Linear, kv_heads * head_dim, hidden);
    d.add(Store::Linear, hidden, heads * head_dim);
    d.vector(2 * head_dim);
    MixerCost m;
    m.kind = "gqa";
    m.heads = heads;
    m.kv_heads = kv_heads;
    m.flops_per_key = 2.0 * double(heads) * double(head_dim) * 2.0;
    if (types.at(size_t(i)) == "minimax_m3_sparse") {
      d.add(Store::Matrix, index_heads * index_dim, hidden);
      d.add_replicated(Store::Matrix, index_dim, hidden);  // one index key per token serves every index head
      d.vector(2 * index_dim);
      m.kind = "gqa_msa";
      m.index_heads = index_heads;
      m.attended_limit = topk_blocks * block;
      m.index_flops_per_key = 2.0 * double(index_heads * index_dim);
    }
    f.cost.mixers.push_back(m);
    if (mlp.at(size_t(i)) == "dense")
      count_mlp(d, hidden, c.get_int("dense_intermediate_size", 12288));
    else
      add_moe_layer(f, hidden, experts, c.get_int("num_experts_per_tok", 4), c.get_int("intermediate_size", 3072),
                    c.get_int("shared_intermediate_size", 3072));
  }
}

}  // namespace

double expected_distinct_experts(int64_t num_experts, int64_t per_token, double tokens) {
  if (num_experts <= 0 || per_token <= 0 || tokens <= 0) return 0;
  const double miss = 1.0 - double(std::min(per_token, num_experts)) / double(num_experts);
  return double(num_experts) * (1.0 - std::pow(miss, tokens));
}

ModelCost model_cost(const Config& config, const std::string& kv_cache_dtype) {
  // The family's own config reader first, so that a config the engine refuses is refused here with the
  // same message (layer lists of the wrong length, unknown kinds, sizes that are not positive), and the
  // counts below only read configs it accepted.
  cache_spec_from_config(config);
  Families f;
  const std::string type = config.get_string("model_type");
  // The GPU's storage rules (Checkpoint::open_dummy): FP8 for DeepSeek's 128x128 blocks, MXFP8
  // projections, group-scaled experts.
  const QuantizationConfig quantization = quantization_from_config(config);
  f.dense.fp8 = quantization.fp8_128x128();
  f.dense.mxfp8 = quantization.linear_packed() == WeightFormat::Mxfp8;
  f.expert_packed = quantization.expert_packed();
  // The cost model of the registry's family (model/families.h), over the config of its text fields.
  const ModelFamily& family = model_family(config);
  const std::string name = family.family;
  if (name == "deepseek_v32") deepseek_v32(f, family.text(config));
  else if (name == "kimi_linear") kimi_linear(f, family.text(config), std::string(family.model_type) == "kimi_k3");
  else if (name == "minimax_m3") minimax_m3(f, family.text(config), config.get_bool("tie_word_embeddings", false));
  else fail("bench: no cost model for the ", name, " family");

  ModelCost& cost = f.cost;
  cost.model_type = type;
  cost.embedding_params = f.embedding.params;
  cost.dense_params = f.dense.params;
  cost.dense_bytes = f.dense.bytes;
  cost.replicated_params = f.dense.replicated_params;
  cost.replicated_bytes = f.dense.replicated_bytes;
  const double experts = double(cost.moe_layers * cost.num_experts);
  cost.total_params = f.dense.params + f.embedding.params - f.tied_params + experts * cost.expert_params;
  cost.weight_bytes = f.dense.bytes + f.embedding.bytes - f.tied_bytes + experts * cost.expert_bytes;

  // The cache rows per token and the recurrent state per sequence, as the paged cache on a GPU lays them out.
  CacheConfig cache;
  cache.device = Device::Cuda;
  cache.kv_cache_dtype = kv_cache_dtype;
  cache.memory_bytes = int64_t(1) << 50;  // a plan only: nothing is allocated
  const CachePlan plan = plan_cache(cache_spec_from_config(config), cache);
  for (size_t l = 0; l < cost.mixers.size(); ++l) {
    MixerCost& m = cost.mixers[l];
    for (PageKind kind : {PageKind::MlaLatent, PageKind::GqaKeyValue})
      if (const PagePlacement* p = plan.page(int(l), kind)) m.kv_bytes_per_token += double(p->token_bytes);
    for (PageKind kind : {PageKind::DsaIndexKey, PageKind::MsaIndexKey})
      if (const PagePlacement* p = plan.page(int(l), kind)) m.index_bytes_per_token += double(p->token_bytes);
    // A step reads and writes every recurrent state of the layer (fp32).
    for (StateKind kind : {StateKind::ConvTail, StateKind::Recurrent})
      if (const StatePlacement* s = plan.state(int(l), kind)) m.state_bytes += 2.0 * 4.0 * double(s->spec.size);
  }
  return cost;
}

ModelCost model_cost_from_path(const std::string& path, const std::string& kv_cache_dtype) {
  namespace fs = std::filesystem;
  const fs::path file = fs::is_directory(path) ? fs::path(path) / "config.json" : fs::path(path);
  return model_cost(Config::load(file.string()), kv_cache_dtype);
}

DecodeStep decode_roofline(const ModelCost& model, int64_t batch, double context, const HardwareLimits& hw,
                           const ParallelLayout& layout) {
  SPARROW_CHECK(batch > 0 && context >= 0, "roofline: batch must be positive and context non-negative");
  SPARROW_CHECK(hw.hbm_bytes_per_s > 0 && hw.flops_per_s > 0, "roofline: bandwidth and FLOP/s must be positive");
  SPARROW_CHECK(layout.tensor_parallel >= 1 && layout.data_parallel >= 1,
                "roofline: the tensor- and data-parallel sizes must be at least 1");
  DecodeStep s;
  s.batch = batch;
  s.context = context;
  s.layout = layout;
  const double B = double(batch), T = double(layout.tensor_parallel), D = double(layout.data_parallel);
  const double group_batch = B / D;  // each group's sequences
  // One GPU's share: what every rank keeps whole, 1 / T of the rest; the experts over all T·D GPUs.
  auto per_rank = [&](double whole, double replicated) { return replicated + (whole - replicated) / T; };
  s.distinct_experts = expected_distinct_experts(model.num_experts, model.experts_per_token, B);
  s.weight_bytes = per_rank(model.dense_bytes, model.replicated_bytes) +
                   double(model.moe_layers) * s.distinct_experts * model.expert_bytes / (T * D);
  double token_flops = 2.0 * per_rank(model.dense_params, model.replicated_params);
  const double expert_flops = 2.0 * double(model.moe_layers * model.experts_per_token) * model.expert_params;
  double per_sequence_bytes = 0;
  for (const MixerCost& m : model.mixers) {
    const double attended = m.attended_limit > 0 ? std::min(context, double(m.attended_limit)) : context;
    // MLA latents and index keys are read whole by every rank of the group; GQA K/V by kv heads, KDA by heads.
    const double kv_split = m.kv_heads > 0 ? std::min(T, double(m.kv_heads)) : 1.0;
    const double state_split = m.kind == "kda" ? T : 1.0;
    const double heads_split = m.heads > 0 ? std::min(T, double(m.heads)) : 1.0;
    const double index_split = m.index_heads > 0 ? std::min(T, double(m.index_heads)) : 1.0;
    per_sequence_bytes += attended * m.kv_bytes_per_token / kv_split + context * m.index_bytes_per_token +
                          m.state_bytes / state_split;
    token_flops += attended * m.flops_per_key / heads_split + context * m.index_flops_per_key / index_split +
                   m.state_flops / state_split;
  }
  s.kv_bytes = group_batch * per_sequence_bytes;
  s.bytes = s.weight_bytes + s.kv_bytes;
  s.flops = group_batch * token_flops + B * expert_flops / (T * D);
  s.memory_seconds = s.bytes / hw.hbm_bytes_per_s;
  s.compute_seconds = s.flops / hw.flops_per_s;

  // The collectives (docs/parallel.md): a ring moves 2 (n-1)/n of an all-reduce's bytes over each GPU's link,
  // (n-1)/n of an all-gather's or reduce-scatter's (the whole result's) bytes.
  auto collective = [&](double bus_bytes, int64_t calls) {
    s.collective_bytes += bus_bytes;
    s.collectives += calls;
  };
  const double rows = group_batch, hidden_bytes = 2.0 * double(model.hidden);
  if (layout.tensor_parallel > 1) {
    const int64_t layers = int64_t(model.mixers.size());
    const double all_reduce = 2.0 * (T - 1) / T * rows * hidden_bytes;
    collective(double(2 * layers + 1) * all_reduce, 2 * layers + 1);  // each layer's two, the embedding's
    collective(double(model.latent_moe_layers) * 2.0 * (T - 1) / T * rows * 2.0 * double(model.moe_latent),
               model.latent_moe_layers);
    collective((T - 1) / T * rows * 4.0 * double(model.vocab), 1);  // the head's fp32 logits, gathered
  }
  if (layout.data_parallel > 1)  // every group's rows gathered, and their sums scattered back
    collective(double(model.moe_layers) * 2.0 * (D - 1) / D * B * hidden_bytes, 2 * model.moe_layers);
  s.collective_seconds = s.collective_bytes / hw.link_bytes_per_s + double(s.collectives) * hw.collective_latency_s;

  s.compute_bound = s.compute_seconds > s.memory_seconds;
  s.seconds = std::max(s.memory_seconds, s.compute_seconds) + s.collective_seconds;
  s.tokens_per_s_per_user = 1.0 / s.seconds;
  s.tokens_per_s_per_gpu = B / s.seconds / double(layout.gpus());
  return s;
}

double prefill_flops(const ModelCost& model, double tokens) {
  SPARROW_CHECK(tokens >= 0, "roofline: the prompt length must be non-negative");
  const double I = tokens;
  double flops =
      I * 2.0 * (model.dense_params + double(model.moe_layers * model.experts_per_token) * model.expert_params);
  for (const MixerCost& m : model.mixers) {
    // Σ_{p=1..I} min(p, A): every earlier key until A of them, then A a query.
    const double A = m.attended_limit > 0 ? std::min(I, double(m.attended_limit)) : I;
    const double attended = A * (A + 1) / 2 + (I - A) * A;
    flops += attended * m.flops_per_key + I * (I + 1) / 2 * m.index_flops_per_key + I * m.state_flops;
  }
  return flops;
}

ServingCycle serving_roofline(const ModelCost& model, int64_t batch, double input_len, double output_len,
                              const HardwareLimits& hw, const ParallelLayout& layout) {
  SPARROW_CHECK(output_len > 0 && input_len >= 0, "roofline: the output length must be positive");
  ServingCycle c;
  c.batch = batch;
  c.input_len = input_len;
  c.output_len = output_len;
  c.context = input_len + output_len / 2;  // what an average decode step attends over
  const DecodeStep step = decode_roofline(model, batch, c.context, hw, layout);
  const double gpus = double(layout.gpus());
  c.decode_bytes = output_len * step.bytes;
  c.decode_flops = output_len * step.flops;
  c.prefill_flops = double(batch) * prefill_flops(model, input_len) / gpus;
  c.memory_seconds = c.decode_bytes / hw.hbm_bytes_per_s;
  c.compute_seconds = (c.decode_flops + c.prefill_flops) / hw.flops_per_s;
  c.collective_seconds = output_len * step.collective_seconds;
  c.compute_bound = c.compute_seconds > c.memory_seconds;
  c.seconds = std::max(c.memory_seconds, c.compute_seconds) + c.collective_seconds;
  c.tokens_per_s_per_user = output_len / c.seconds;
  c.total_tokens_per_s_per_gpu = double(batch) * (input_len + output_len) / c.seconds / gpus;
  c.output_tokens_per_s_per_gpu = double(batch) * output_len / c.seconds / gpus;
  return c;
}

Json to_json(const ServingCycle& c) {
  return Json{{"batch", c.batch},
              {"input_len", c.input_len},
              {"output_len", c.output_len},
              {"context", c.context},
              {"decode_bytes", c.decode_bytes},
              {"decode_flops", c.decode_flops},
              {"prefill_flops", c.prefill_flops},
              {"memory_seconds", c.memory_seconds},
              {"compute_seconds", c.compute_seconds},
              {"collective_seconds", c.collective_seconds},
              {"seconds", c.seconds},
              {"bound", c.compute_bound ? "compute" : "memory"},
              {"tokens_per_s_per_user", c.tokens_per_s_per_user},
              {"total_tokens_per_s_per_gpu", c.total_tokens_per_s_per_gpu},
              {"output_tokens_per_s_per_gpu", c.output_tokens_per_s_per_gpu}};
}

Json to_json(const DecodeStep& s) {
  return Json{{"batch", s.batch},
              {"context", s.context},
              {"weight_bytes", s.weight_bytes},
              {"kv_bytes", s.kv_bytes},
              {"bytes", s.bytes},
              {"flops", s.flops},
              {"distinct_experts", s.distinct_experts},
              {"tensor_parallel", s.layout.tensor_parallel},
              {"data_parallel", s.layout.data_parallel},
              {"collectives", s.collectives},
              {"collective_bytes", s.collective_bytes},
              {"memory_seconds", s.memory_seconds},
              {"compute_seconds", s.compute_seconds},
              {"collective_seconds", s.collective_seconds},
              {"seconds", s.seconds},
              {"bound", s.compute_bound ? "compute" : "memory"},
              {"tokens_per_s_per_user", s.tokens_per_s_per_user},
              {"tokens_per_s_per_gpu", s.tokens_per_s_per_gpu}};
}

Json to_json(const ModelCost& m) {
  Json kinds = Json::object();
  for (const MixerCost& mixer : m.mixers) kinds[mixer.kind] = kinds.value(mixer.kind, 0) + 1;
  return Json{{"model_type", m.model_type},
              {"layers", m.mixers.size()},
              {"mixers", kinds},
              {"total_params", m.total_params},
              {"embedding_params", m.embedding_params},
              {"dense_params", m.dense_params},
              {"dense_bytes", m.dense_bytes},
              {"replicated_bytes", m.replicated_bytes},
              {"moe_layers", m.moe_layers},
              {"num_experts", m.num_experts},
              {"experts_per_token", m.experts_per_token},
              {"expert_params", m.expert_params},
              {"expert_bytes", m.expert_bytes},
              {"weight_bytes", m.weight_bytes}};
}

}  // namespace sparrow::bench
