#include "model/mla.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace sparrow {

float mla_softmax_scale(int64_t qk_head_dim, const nlohmann::json& rope_parameters) {
  double scale = 1.0 / std::sqrt(double(qk_head_dim));
  if (!rope_parameters.is_object()) return float(scale);
  const std::string type = rope_parameters.value("rope_type", std::string("default"));
  const double mscale_all_dim =
      rope_parameters.contains("mscale_all_dim") && rope_parameters["mscale_all_dim"].is_number()
          ? rope_parameters["mscale_all_dim"].get<double>()
          : 0.0;
  if (type != "default" && mscale_all_dim != 0) {
    SPARROW_CHECK(rope_parameters.contains("factor") && rope_parameters["factor"].is_number(),
                  "config.json: rope_parameters.factor is required with mscale_all_dim");
    const double mscale = yarn_get_mscale(rope_parameters["factor"].get<double>(), mscale_all_dim);
    scale *= mscale * mscale;
  }
  return float(scale);
}

// y[t] += bias for every row t (a torch Linear's bias).
static void add_bias(Tensor& y, const Tensor& bias) {
  const int64_t n = bias.numel();
  for (int64_t t = 0; t < y.numel() / n; ++t) {
    float* row = y.data() + t * n;
    for (int64_t i = 0; i < n; ++i) row[i] += bias.data()[i];
  }
}

std::unique_ptr<MlaMixer> MlaMixer::load(Checkpoint& ckpt, const std::string& prefix, const MlaOptions& options,
                                         std::unique_ptr<DsaIndexer> indexer) {
  const MlaOptions& o = options;
  SPARROW_CHECK(o.hidden > 0 && o.num_heads > 0 && o.kv_lora_rank > 0 && o.qk_rope_head_dim >= 0 &&
                    o.qk_nope_head_dim >= 0 && o.qk_head_dim() > 0 && o.v_head_dim > 0 && o.q_lora_rank >= 0,
                "MLA: attention dimensions must be positive");
  SPARROW_CHECK(!o.rope || o.rope->rot_dim() == o.qk_rope_head_dim, "MLA: rotary dimension ",
                o.rope ? o.rope->rot_dim() : 0, " differs from qk_rope_head_dim ", o.qk_rope_head_dim);
  if (indexer) {
    SPARROW_CHECK(o.q_lora_rank > 0, "MLA: a DSA indexer needs q_lora_rank (it reads the query latent)");
    SPARROW_CHECK(indexer->options.query_input == o.q_lora_rank, "MLA: indexer query width ",
                  indexer->options.query_input, " differs from q_lora_rank ", o.q_lora_rank);
  }
  auto mla = std::make_unique<MlaMixer>();
  mla->options_ = options;
  const int64_t heads = o.num_heads;
  if (o.q_lora_rank > 0) {
    mla->q_a_proj = ckpt.take(prefix + "q_a_proj.weight", {o.q_lora_rank, o.hidden});
    if (o.attention_bias) mla->q_a_bias = ckpt.take(prefix + "q_a_proj.bias", {o.q_lora_rank});
    mla->q_a_norm = ckpt.take(prefix + "q_a_layernorm.weight", {o.q_lora_rank});
    mla->q_b_proj = ckpt.take(prefix + "q_b_proj.weight", {heads * o.qk_head_dim(), o.q_lora_rank});
  } else {
    mla->q_proj = ckpt.take(prefix + "q_proj.weight", {heads * o.qk_head_dim(), o.hidden});
  }
  mla->kv_a_proj = ckpt.take(prefix + "kv_a_proj_with_mqa.weight", {o.cache_row(), o.hidden});
  if (o.attention_bias) mla->kv_a_bias = ckpt.take(prefix + "kv_a_proj_with_mqa.bias", {o.cache_row()});
  mla->kv_a_norm = ckpt.take(prefix + "kv_a_layernorm.weight", {o.kv_lora_rank});
  mla->kv_b_proj =
      ckpt.take(prefix + "kv_b_proj.weight", {heads * (o.qk_nope_head_dim + o.v_head_dim), o.kv_lora_rank});
  mla->o_proj = ckpt.take(prefix + "o_proj.weight", {o.hidden, heads * o.v_head_dim});
  if (o.attention_bias) mla->o_bias = ckpt.take(prefix + "o_proj.bias", {o.hidden});
  mla->indexer_ = std::move(indexer);
  return mla;
}

LayerCacheSpec MlaMixer::cache_spec_for(const MlaOptions& options, const DsaIndexerOptions* index) {
  LayerCacheSpec spec;
  spec.pages.push_back(options.cache_page());
  if (index) spec.pages.push_back(index->cache_page());
  return spec;
}

LayerCacheSpec MlaMixer::cache_spec() const {
  return cache_spec_for(options_, indexer_ ? &indexer_->options : nullptr);
}

Tensor MlaMixer::forward(const Tensor& x, const Batch& batch, int layer) {
  const MlaOptions& o = options_;
  const int64_t tokens = batch.size(), heads = o.num_heads;
  const int64_t nope = o.qk_nope_head_dim, rot = o.qk_rope_head_dim, latent = o.kv_lora_rank;
  const int64_t qk = o.qk_head_dim(), row_width = o.cache_row();
  const int64_t kv_b_rows_per_head = nope + o.v_head_dim;

  // Queries [T, heads * qk], each head [q_nope | q_rot]; q_resid also feeds the indexer.
  Tensor q_resid, q;
  if (o.q_lora_rank > 0) {
    q_resid = cpu::linear(x, q_a_proj);
    if (o.attention_bias) add_bias(q_resid, q_a_bias);
    cpu::rms_norm_inplace(q_resid, q_a_norm, o.q_norm_eps);
    q = cpu::linear(q_resid, q_b_proj);
  } else {
    q = cpu::linear(x, q_proj);
  }

  // This step's cache rows [T, latent + rot]: [kv_a_layernorm(c) | k_rot], the norm on c only.
  Tensor new_rows = cpu::linear(x, kv_a_proj);
  if (o.attention_bias) add_bias(new_rows, kv_a_bias);
  for (int64_t t = 0; t < tokens; ++t) {
    float* c = new_rows.row(t);
    cpu::rms_normalize(c, latent, o.kv_norm_eps);
    for (int64_t i = 0; i < latent; ++i) c[i] *= kv_a_norm.data()[i];
  }

  if (o.rope) {
    std::vector<float> cos(rot / 2), sin(rot / 2);
    for (int64_t t = 0; t < tokens; ++t) {
      o.rope->angles(batch.positions[t], cos.data(), sin.data());
      for (int64_t h = 0; h < heads; ++h)
        apply_rope_interleaved(q.row(t) + h * qk + nope, cos.data(), sin.data(), int(rot));
      apply_rope_interleaved(new_rows.row(t) + latent, cos.data(), sin.data(), int(rot));
    }
  }

  // Absorbed queries [T, heads, latent + rot]: q_nope[h] · W_UK[h] next to q_rot[h], so that one dot
  // product with a cache row gives the expanded form's q[h] · k[h].
  Tensor q_abs = Tensor::empty({tokens, heads, row_width});
  for (int64_t h = 0; h < heads; ++h) {
    const float* w_uk = kv_b_proj.row(h * kv_b_rows_per_head);  // [nope, latent]
    cpu::gemm_nn(tokens, latent, nope, q.data() + h * qk, heads * qk, w_uk, latent, q_abs.data() + h * row_width,
                 heads * row_width);
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(q_abs.row(t) + h * row_width + latent, q.row(t) + h * qk + nope, sizeof(float) * rot);
  }

  // The indexer reads its own cache, which must see this step's tokens, like ours below.
  KeySelection selection;
  if (indexer_) selection = indexer_->select(x, q_resid, batch, layer);

  // Attention per query token, over its causal prefix or its selected keys, in latent space:
  // mixed[t, h] = sum_s softmax_s(q_abs[t, h] · row_s * scale) c_s.
  Tensor mixed = Tensor::empty({tokens, heads, latent});
  std::vector<float> probs, gathered, prefix;
  for (const SeqSlice& seq : batch.seqs) {
    // Store this step's rows, then gather the whole causal prefix (this step's tokens included).
    const int64_t end = seq.start() + seq.count;
    seq.cache().write(layer, PageKind::MlaLatent, seq.start(), seq.count, new_rows.row(seq.offset));
    prefix.resize(end * row_width);
    seq.cache().read(layer, PageKind::MlaLatent, 0, end, prefix.data());
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t row = seq.offset + i;
      const float* keys = prefix.data();
      int64_t n = seq.start() + i + 1;
      if (indexer_ && !selection.is_prefix(row)) {
        const std::vector<int32_t>& chosen = selection.keys[row];
        n = int64_t(chosen.size());
        gathered.resize(n * row_width);
        for (int64_t j = 0; j < n; ++j)
          std::memcpy(gathered.data() + j * row_width, prefix.data() + chosen[j] * row_width,
                      sizeof(float) * row_width);
        keys = gathered.data();
      }
      probs.resize(heads * n);
      cpu::gemm_nt(heads, n, row_width, q_abs.row(row), row_width, keys, row_width, probs.data(), n);
      for (int64_t h = 0; h < heads; ++h) {
        float* p = probs.data() + h * n;
        for (int64_t j = 0; j < n; ++j) p[j] *= o.softmax_scale;
        cpu::softmax_inplace(p, n);
      }
      cpu::gemm_nn(heads, latent, n, probs.data(), n, keys, row_width, mixed.row(row), latent);
    }
  }

  // Back from latent space per head: out[t, h] = W_UV[h] · mixed[t, h], then o_proj.
  Tensor attended = Tensor::empty({tokens, heads * o.v_head_dim});
  for (int64_t h = 0; h < heads; ++h) {
    const float* w_uv = kv_b_proj.row(h * kv_b_rows_per_head + nope);  // [v_head_dim, latent]
    cpu::gemm_nt(tokens, o.v_head_dim, latent, mixed.data() + h * latent, heads * latent, w_uv, latent,
                 attended.data() + h * o.v_head_dim, heads * o.v_head_dim);
  }
  Tensor out = cpu::linear(attended, o_proj);
  if (o.attention_bias) add_bias(out, o_bias);
  return out;
}

}  // namespace sparrow
