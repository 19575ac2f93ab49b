// MiniMax-M3 text model (transformers 5.17 MiniMaxM3VLForCausalLM, model_type "minimax_m3_vl_text", and
// the language model inside MiniMaxM3SparseForConditionalGeneration, model_type "minimax_m3_vl"):
// every layer is GQA attention with per-head q/k norms and partial RoPE (src/model/gqa_mixer.h), with
// an MSA block selector on the "minimax_m3_sparse" layers (src/model/msa_indexer.h); the feed-forward is
// a dense clamped-SwiGLU MLP or a sigmoid-routed MoE with one shared expert (src/model/feed_forward.h), per
// mlp_layer_types. All RMSNorms are Gemma-style (x̂ · (1 + w)).
// Missing config fields take MiniMaxM3VLTextConfig's defaults, as transformers would, including its
// legacy spellings (sparse_attention_config, moe_layer_freq, rope_theta, rope_scaling).
//
// Two weight layouts exist and both load:
//   transformers' names, which MiniMaxM3VLForCausalLM.save_pretrained writes (decoder prefix "model."):
//     <p>layers.N.self_attn.indexer.q_proj.weight, <p>layers.N.mlp.gate_up_proj.weight (dense),
//     <p>layers.N.mlp.{gate.weight, gate.e_score_correction_bias, experts.gate_up_proj, experts.down_proj,
//     shared_experts.gate_up_proj.weight}, lm_head.weight;
//   MiniMax's release names, which MiniMaxM3SparseForConditionalGeneration.save_pretrained writes back
//   through conversion_mapping.py's "minimax_m3_vl" entry (decoder prefix "language_model.model."):
//     <p>layers.N.self_attn.index_q_proj.weight, <p>layers.N.block_sparse_moe.{gate_proj,up_proj,down_proj}
//     (dense), <p>layers.N.block_sparse_moe.{gate.weight, e_score_correction_bias, experts.E.w1/w2/w3.weight,
//     shared_experts.gate_proj.weight}, language_model.lm_head.weight.
// The caller passes transformers' prefix ("model." or "model.language_model."); the release layout is
// recognised by its embedding, language_model.model.embed_tokens.weight.
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/families.h"
#include "model/gqa_mixer.h"
#include "model/feed_forward.h"
#include "model/msa_indexer.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/gqa/gqa_attention.h"
#endif
#include "model/tensor_parallel.h"

namespace sparrow {

namespace {

const char* const kFullAttention = "full_attention";
const char* const kSparseAttention = "minimax_m3_sparse";

// A per-layer list of strings (layer_types, mlp_layer_types), checked against the allowed values.
std::vector<std::string> layer_list(const Config& config, const std::string& key, int64_t num_layers,
                                    const std::string& supported_a, const std::string& supported_b) {
  std::vector<std::string> types = config.get_string_list(key);
  config.require(int64_t(types.size()) == num_layers, key, "a list of num_hidden_layers entries");
  for (const std::string& t : types)
    if (t != supported_a && t != supported_b) config.unsupported(key + " entry", t, supported_a + ", " + supported_b);
  return types;
}

// A legacy per-layer flag list (sparse_attention_freq, moe_layer_freq): 0/1 or false/true.
std::vector<bool> flag_list(const Config& config, const std::string& key, int64_t num_layers) {
  const nlohmann::json& value = config.json()[key];
  bool ok = value.is_array() && int64_t(value.size()) == num_layers;
  std::vector<bool> flags;
  for (size_t i = 0; ok && i < value.size(); ++i) {
    ok = value[i].is_boolean() || value[i].is_number_integer();
    if (ok) flags.push_back(value[i].is_boolean() ? value[i].get<bool>() : value[i].get<int64_t>() != 0);
  }
  config.require(ok, key, "a list of num_hidden_layers flags");
  return flags;
}

// Every field of MiniMaxM3VLTextConfig the model reads, after its __post_init__.
struct TextConfig {
  int64_t vocab, hidden, num_layers, heads, kv_heads, head_dim;
  float norm_eps;
  int64_t num_experts, top_k, intermediate, dense_intermediate, shared_intermediate;
  float routed_scaling_factor, swiglu_alpha, swiglu_limit;
  int64_t index_heads, index_head_dim, index_block_size, index_topk_blocks, index_local_blocks;
  int64_t index_init_blocks = 0;  // sparse_attention_config.sparse_init_block (vLLM reads it; 0 in the releases)
  std::vector<std::string> layer_types;      // full_attention | minimax_m3_sparse
  std::vector<std::string> mlp_layer_types;  // sparse | dense
  Rope rope;
  bool tie_word_embeddings;

  explicit TextConfig(const Config& c) {
    vocab = c.get_int("vocab_size", 200064);
    hidden = c.get_int("hidden_size", 6144);
    num_layers = c.get_int("num_hidden_layers", 60);
    heads = c.get_int("num_attention_heads", 64);
    kv_heads = c.get_int("num_key_value_heads", 4);
    head_dim = c.get_int("head_dim", 128);
    norm_eps = float(c.get_float("rms_norm_eps", 1e-6));
    num_experts = c.get_int("num_local_experts", c.get_int("num_experts", 128));
    top_k = c.get_int("num_experts_per_tok", 4);
    intermediate = c.get_int("intermediate_size", 3072);
    dense_intermediate = c.get_int("dense_intermediate_size", 12288);
    shared_intermediate = c.get_int("shared_intermediate_size", 3072);
    routed_scaling_factor = float(c.get_float("routed_scaling_factor", 2.0));
    swiglu_alpha = float(c.get_float("swiglu_alpha", 1.702));
    swiglu_limit = float(c.get_float("swiglu_limit", 7.0));
    tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "num_experts_per_tok"})
      c.require(c.get_int(key, 1) > 0, key, "a positive integer");
    c.require(heads % kv_heads == 0, "num_attention_heads", "a multiple of num_key_value_heads");
    c.require(top_k <= num_experts, "num_experts_per_tok", "at most num_local_experts");
    // hidden_act is ignored: transformers overwrites it with "silu" and computes the gate from swiglu_*.

    // MiniMaxM3VLTextConfig.__post_init__: the legacy sparse_attention_config entries win over the
    // flat index_* fields; layer_types / mlp_layer_types come from the legacy flag lists when absent.
    index_heads = c.get_int("index_n_heads", 4);
    index_head_dim = c.get_int("index_head_dim", 128);
    index_block_size = c.get_int("index_block_size", 128);
    index_topk_blocks = c.get_int("index_topk_blocks", 16);
    index_local_blocks = c.get_int("index_local_blocks", 1);
    std::optional<Config> sparse;
    if (c.has("sparse_attention_config")) {
      sparse = c.get_object("sparse_attention_config");
      index_heads = sparse->get_int("sparse_num_index_heads", index_heads);
      index_head_dim = sparse->get_int("sparse_index_dim", index_head_dim);
      index_block_size = sparse->get_int("sparse_block_size", index_block_size);
      index_topk_blocks = sparse->get_int("sparse_topk_blocks", index_topk_blocks);
      index_local_blocks = sparse->get_int("sparse_local_block", index_local_blocks);
      index_init_blocks = sparse->get_int("sparse_init_block", 0);
      sparse->require(index_init_blocks >= 0, "sparse_init_block", "a non-negative integer");
      // vLLM 0.33 (MiniMaxM3SparseAttention) scores a block by the max over its keys and builds no index
      // value / output projections: another score type is not a model either engine runs.
      if (sparse->has("sparse_score_type"))
        sparse->require(sparse->get_string("sparse_score_type") == "max", "sparse_score_type",
                        "\"max\" (the only block score vLLM and transformers compute)");
    }
    if (c.has("layer_types")) {
      layer_types = layer_list(c, "layer_types", num_layers, kFullAttention, kSparseAttention);
    } else if (sparse && sparse->has("sparse_attention_freq")) {
      for (bool on : flag_list(*sparse, "sparse_attention_freq", num_layers))
        layer_types.push_back(on ? kSparseAttention : kFullAttention);
    } else {
      layer_types.assign(num_layers, kFullAttention);
    }
    if (c.has("mlp_layer_types")) {
      mlp_layer_types = layer_list(c, "mlp_layer_types", num_layers, "sparse", "dense");
    } else if (c.has("moe_layer_freq")) {
      for (bool on : flag_list(c, "moe_layer_freq", num_layers)) mlp_layer_types.push_back(on ? "sparse" : "dense");
    } else {
      mlp_layer_types.assign(num_layers, "sparse");
    }

    // MiniMaxM3VLRotaryEmbedding: rotary dims = int(head_dim * partial_rotary_factor). The config's
    // rotary_dim field is not read by transformers, so it is not read here either.
    // MiniMaxM3VLTextConfig's defaults: default_theta 5e6, max_position_embeddings 524288.
    const int64_t max_positions = c.get_int("max_position_embeddings", 524288);
    const nlohmann::json params = c.rope_parameters(5000000.0, max_positions);
    const double partial = params.value("partial_rotary_factor", 1.0);
    const int rot_dim = int(double(head_dim) * partial);
    c.require(rot_dim > 0 && rot_dim <= head_dim && rot_dim % 2 == 0, "rope_parameters",
              "a partial_rotary_factor giving an even number of rotary dims in (0, head_dim]");
    rope = Rope::from_config(params, rot_dim, max_positions);

    if (std::find(layer_types.begin(), layer_types.end(), kSparseAttention) != layer_types.end()) {
      c.require(index_heads > 0 && heads % index_heads == 0, "index_n_heads", "a divisor of num_attention_heads");
      // The indexer rotates with the attention's cos/sin sliced to its head (cos[..., :index_head_dim]):
      // its first rotary dims, or its whole head when that is narrower (msa_indexer.cpp).
      c.require(index_head_dim > 0 && index_head_dim % 2 == 0, "index_head_dim", "a positive even number");
      c.require(index_block_size > 0, "index_block_size", "a positive integer");
      c.require(index_topk_blocks > 0, "index_topk_blocks", "a positive integer");
      c.require(index_local_blocks >= 0, "index_local_blocks", "a non-negative integer");
    }
  }
};

// The tensor names of one of the two layouts (see the top of the file).
struct WeightNames {
  std::string decoder;  // "model.", "model.language_model." or "language_model.model."
  std::string lm_head;
  bool release = false;  // MiniMax's release names

  // transformers' names under `prefix`, unless the checkpoint holds the release layout instead.
  static WeightNames find(const Checkpoint& ckpt, const std::string& prefix) {
    const std::string release_prefix = "language_model.model.";
    if (!ckpt.has(prefix + "embed_tokens.weight") && ckpt.has(release_prefix + "embed_tokens.weight"))
      return {release_prefix, "language_model.lm_head.weight", true};
    return {prefix, "lm_head.weight", false};
  }
  std::string layer(int64_t i) const { return cat(decoder, "layers.", i, "."); }
  // The MTP layer's decoder layer (vLLM 0.33 minimax_m3/nvidia/mtp.py: mtp.layers.{i}.transformer_layer).
  std::string mtp_layer(int64_t i) const { return cat(decoder, "mtp.layers.", i, "."); }
  std::string indexer(const std::string& layer_prefix, const std::string& part) const {
    return indexer_prefix(layer_prefix) + part + ".weight";
  }
  std::string indexer_prefix(const std::string& layer_prefix) const {
    return layer_prefix + (release ? "self_attn.index_" : "self_attn.indexer.");
  }
  // The feed-forward's prefix: transformers loads release checkpoints by renaming ".block_sparse_moe."
  // to ".mlp.", so either spelling may hold a layer's MLP.
  std::string mlp(const Checkpoint& ckpt, const std::string& layer_prefix) const {
    const std::string moe = layer_prefix + "block_sparse_moe.";
    return ckpt.has(moe + "gate.weight") || ckpt.has(moe + "down_proj.weight") ? moe : layer_prefix + "mlp.";
  }
};

// The attention of the layer under `layer` (a decoder layer's prefix, or the MTP layer's), MSA when `sparse`.
std::unique_ptr<Mixer> load_attention(Checkpoint& ckpt, const TextConfig& cfg, const WeightNames& names,
                                      const std::string& layer, bool sparse) {
  auto attn = std::make_unique<GqaAttention>();
  const std::string p = attn->prefix = layer + "self_attn.";
  const TensorParallel& tp = attn->tp = ckpt.tensor_parallel();
  const int64_t d = cfg.head_dim;
#if SPARROW_HAVE_CUDA
  // Refused here, not at the first step (where it read as a KV-cache sizing failure).
  SPARROW_CHECK(ckpt.device() == Device::Cpu || cuda::gqa_takes_head_dim(d),
                "the GPU attention kernel takes head_dim a multiple of 16 from 16 to 256; this model has head_dim ", d,
                " (use --device cpu)");
#endif
  const IndexRange heads = even_share(tp, cfg.heads, "num_attention_heads");
  const IndexRange kv = grouped_share(tp, cfg.heads, cfg.kv_heads, "num_key_value_heads");
  attn->heads = heads.count();
  attn->kv_heads = kv.count();
  attn->head_dim = d;
  attn->norm_eps = cfg.norm_eps;
  attn->q_proj = ckpt.take_linear(p + "q_proj.weight", {cfg.heads * d, cfg.hidden}, split_for(tp, heads, 0, d));
  attn->k_proj = ckpt.take_linear(p + "k_proj.weight", {cfg.kv_heads * d, cfg.hidden}, split_for(tp, kv, 0, d));
  attn->v_proj = ckpt.take_linear(p + "v_proj.weight", {cfg.kv_heads * d, cfg.hidden}, split_for(tp, kv, 0, d));
  attn->o_proj = ckpt.take_linear(p + "o_proj.weight", {cfg.hidden, cfg.heads * d}, split_for(tp, heads, 1, d));
  attn->q_norm = ckpt.take(p + "q_norm.weight", {d});
  attn->k_norm = ckpt.take(p + "k_norm.weight", {d});
  attn->rope = cfg.rope;
  if (sparse) {
    // Each index head serves a group of query heads: a rank keeps the ones its heads read; the index key
    // is shared by all of them and replicated.
    const IndexRange index = grouped_share(tp, cfg.heads, cfg.index_heads, "index_n_heads");
    MsaIndexer& idx = attn->indexer.emplace();
    idx.heads = index.count();
    idx.head_dim = cfg.index_head_dim;
    idx.block_size = cfg.index_block_size;
    idx.topk_blocks = cfg.index_topk_blocks;
    idx.local_blocks = cfg.index_local_blocks;
    idx.init_blocks = cfg.index_init_blocks;
    idx.norm_eps = cfg.norm_eps;
    idx.tp = tp;
    idx.prefix = names.indexer_prefix(layer);
    idx.all_heads = cfg.index_heads;
    idx.first_head = index.begin;
    idx.query_heads = cfg.heads;
    SPARROW_CHECK(!(tp.sharded() && tp.indexer_decode_cp) || ckpt.device() == Device::Cpu,
                  "--attention-config indexer_decode_cp runs on the CPU backend so far (issue 28)");
    idx.q_proj = ckpt.take(names.indexer(layer, "q_proj"), {cfg.index_heads * cfg.index_head_dim, cfg.hidden},
                           split_for(tp, index, 0, cfg.index_head_dim));
    idx.k_proj = ckpt.take(names.indexer(layer, "k_proj"), {cfg.index_head_dim, cfg.hidden});
    idx.q_norm = ckpt.take(names.indexer(layer, "q_norm"), {cfg.index_head_dim});
    idx.k_norm = ckpt.take(names.indexer(layer, "k_norm"), {cfg.index_head_dim});
  }
  return attn;
}

// The feed-forward of the layer under `layer`: the dense MLP or (`moe`) the MoE.
std::unique_ptr<FeedForward> load_feed_forward(Checkpoint& ckpt, const TextConfig& cfg, const WeightNames& names,
                                               const std::string& layer, bool moe_layer) {
  const Activation act{Glu::ClampedSwiglu, cfg.swiglu_alpha, cfg.swiglu_limit};
  const std::string p = names.mlp(ckpt, layer);
  if (!moe_layer)
    return std::make_unique<DenseMlp>(DenseMlp::load(ckpt, p, cfg.hidden, cfg.dense_intermediate, act));

  // MiniMaxM3VLSparseMoeBlock: sigmoid router with a choice-only bias, weights normalised without an
  // epsilon, routed sum times routed_scaling_factor, plus the shared expert.
  auto moe = std::make_unique<MoeBlock>();
  moe->act = act;
  SigmoidRouter& router = moe->router;
  router.weight = ckpt.take(p + "gate.weight", {cfg.num_experts, cfg.hidden});
  const std::string bias = p + (names.release ? "e_score_correction_bias" : "gate.e_score_correction_bias");
  router.bias = SigmoidRouter::load_bias(ckpt, bias, cfg.num_experts);
  router.top_k = cfg.top_k;
  router.n_group = router.topk_group = 1;
  router.normalize = true;
  router.normalize_eps = 0.0f;
  router.routed_scaling_factor = cfg.routed_scaling_factor;
  moe->load_experts(ckpt, p + "experts", cfg.num_experts, cfg.intermediate, cfg.hidden);
  moe->shared.push_back(DenseMlp::load(ckpt, p + "shared_experts.", cfg.hidden, cfg.shared_intermediate, act));
  return moe;
}

}  // namespace

std::vector<LayerCacheSpec> minimax_m3_cache_spec(const Config& text) {
  const TextConfig cfg(text);
  std::vector<LayerCacheSpec> spec;
  for (const std::string& type : cfg.layer_types)
    spec.push_back(GqaAttention::cache_spec_for(cfg.kv_heads, cfg.head_dim,
                                                type == kSparseAttention ? cfg.index_head_dim : 0));
  return spec;
}

std::unique_ptr<DecoderModel> load_minimax_m3(Checkpoint& ckpt, const Config& text, const std::string& prefix) {
  const TextConfig cfg(text);
  const WeightNames names = WeightNames::find(ckpt, prefix);
  const bool sparse = std::find(cfg.layer_types.begin(), cfg.layer_types.end(), kSparseAttention) !=
                      cfg.layer_types.end();
  SPARROW_CHECK(!sparse || ckpt.device() == Device::Cpu || cfg.index_head_dim >= cfg.rope.rot_dim(),
                "index_head_dim ", cfg.index_head_dim, " below the ", cfg.rope.rot_dim(), " rotary dims (the "
                "indexer then rotates its whole head, as transformers does) runs on the CPU only so far: use "
                "--device cpu");

  auto model = std::make_unique<DecoderModel>();
  model->type = ckpt.config().get_string("model_type");
  model->vocab = cfg.vocab;
  model->hidden = cfg.hidden;
  model->norm_eps = cfg.norm_eps;
  model->norm_unit_offset = true;  // MiniMaxM3VLRMSNorm
  // MiniMaxM3VLConfig ties when either it or its text_config says so.
  const bool tied = cfg.tie_word_embeddings || ckpt.config().get_bool("tie_word_embeddings", false);
  model->take_embeddings(ckpt, names.decoder, names.lm_head, tied);

  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    DecoderLayer layer;
    layer.input_norm = ckpt.take(names.layer(i) + "input_layernorm.weight", {cfg.hidden});
    layer.post_norm = ckpt.take(names.layer(i) + "post_attention_layernorm.weight", {cfg.hidden});
    layer.mixer = load_attention(ckpt, cfg, names, names.layer(i), cfg.layer_types[size_t(i)] == kSparseAttention);
    layer.ffn = load_feed_forward(ckpt, cfg, names, names.layer(i), cfg.mlp_layer_types[size_t(i)] != "dense");
    model->layers.push_back(std::move(layer));
  }

  // Not part of the text model: the vision tower and projector of a VL checkpoint, multi-token
  // prediction layers (transformers ignores "mtp." on load), and a tied lm_head's own copy.
  std::vector<std::string> ignored = {"vision_tower.",       "model.vision_tower.", "multi_modal_projector.",
                                      "model.multi_modal_projector.", "patch_merge_mlp.", "mtp.",
                                      "model.mtp.",          names.decoder + "mtp."};
  if (tied) ignored.push_back(names.lm_head);
  ckpt.finish(ignored);
  return model;
}

// vLLM 0.33 minimax_m3/nvidia/mtp.py (MiniMaxM3MultiTokenPredictorLayer): Gemma enorm / hnorm, eh_proj, a
// decoder layer forced to MSA and the MoE (its weights under transformer_layer.), final_layernorm before the
// model's lm_head; the embedding is the model's. The model hands it its post-norm state (MiniMaxM3Model
// returns it normed) and the layer recycles its own state before final_layernorm.
std::unique_ptr<MtpDrafter> load_minimax_m3_mtp(Checkpoint& ckpt, const Config& text, const std::string& prefix) {
  const TextConfig cfg(text);
  const WeightNames names = WeightNames::find(ckpt, prefix);
  const std::string mtp = names.mtp_layer(0);
  require_mtp_layer(ckpt, mtp);
  const std::string layer = mtp + "transformer_layer.";
  auto drafter = std::make_unique<MtpDrafter>();
  drafter->type = ckpt.config().get_string("model_type");
  drafter->placed_on = ckpt.device();
  drafter->vocab = cfg.vocab;
  drafter->hidden = cfg.hidden;
  drafter->norm_eps = cfg.norm_eps;
  drafter->norm_unit_offset = true;  // MiniMAXGemmaRMSNorm
  drafter->layer_index = int(cfg.num_layers);
  drafter->target_cache_spec = minimax_m3_cache_spec(text);
  drafter->embed = ckpt.take(names.decoder + "embed_tokens.weight", {cfg.vocab, cfg.hidden});
  const bool tied = cfg.tie_word_embeddings || ckpt.config().get_bool("tie_word_embeddings", false);
  drafter->head = tied ? drafter->embed : ckpt.take(names.lm_head, {cfg.vocab, cfg.hidden});
  drafter->enorm = ckpt.take(mtp + "enorm.weight", {cfg.hidden});
  drafter->hnorm = ckpt.take(mtp + "hnorm.weight", {cfg.hidden});
  drafter->eh_proj = ckpt.take(mtp + "eh_proj.weight", {cfg.hidden, 2 * cfg.hidden});
  drafter->norm = ckpt.take(mtp + "final_layernorm.weight", {cfg.hidden});
  drafter->layer.input_norm = ckpt.take(layer + "input_layernorm.weight", {cfg.hidden});
  drafter->layer.post_norm = ckpt.take(layer + "post_attention_layernorm.weight", {cfg.hidden});
  drafter->layer.mixer = load_attention(ckpt, cfg, names, layer, /*sparse=*/true);
  drafter->layer.ffn = load_feed_forward(ckpt, cfg, names, layer, /*moe_layer=*/true);
  // Everything else is the model's (and its vision tower's).
  ckpt.finish({names.decoder + "layers.", names.decoder + "embed_tokens.", names.decoder + "norm.", names.lm_head,
               cat(names.decoder, "mtp.layers.1"), cat(names.decoder, "mtp.layers.2"), "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
               "model.multi_modal_projector.", "patch_merge_mlp.", "lm_head."});
  return drafter;
}

}  // namespace sparrow
