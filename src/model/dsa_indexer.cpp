#include "model/dsa_indexer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace sparrow {

std::unique_ptr<DsaIndexer> DsaIndexer::load(Checkpoint& ckpt, const std::string& prefix,
                                             const DsaIndexerOptions& options) {
  SPARROW_CHECK(options.rope.rot_dim() <= options.head_dim, "DSA indexer: rotary dimension ", options.rope.rot_dim(),
                " exceeds index_head_dim ", options.head_dim);
  SPARROW_CHECK(options.topk > 0, "DSA indexer: index_topk must be positive, got ", options.topk);
  auto indexer = std::make_unique<DsaIndexer>();
  indexer->options = options;
  const int64_t heads = options.num_heads, dim = options.head_dim;
  indexer->wq_b = ckpt.take(prefix + "wq_b.weight", {heads * dim, options.query_input});
  indexer->wk = ckpt.take(prefix + "wk.weight", {dim, options.hidden});
  indexer->k_norm_weight = ckpt.take(prefix + "k_norm.weight", {dim});
  indexer->k_norm_bias = ckpt.take(prefix + "k_norm.bias", {dim});
  indexer->weights_proj = ckpt.take(prefix + "weights_proj.weight", {heads, options.hidden});
  return indexer;
}

std::vector<float> DsaIndexer::scores(const float* query, const float* head_weights, const float* keys,
                                      int64_t n) const {
  const int64_t heads = options.num_heads, dim = options.head_dim;
  const float scale = 1.0f / std::sqrt(float(dim));
  // Per-head logits [heads, n] = q · kᵀ, then relu(logit * scale) as DeepseekV32Indexer.forward.
  std::vector<float> per_head(heads * n);
  cpu::gemm_nt(heads, n, dim, query, dim, keys, dim, per_head.data(), n);
  for (float& s : per_head) s = std::max(s * scale, 0.0f);
  // Weighted sum over heads: [1, heads] · [heads, n].
  std::vector<float> total(n);
  cpu::gemm_nn(1, n, heads, head_weights, heads, per_head.data(), n, total.data(), n);
  return total;
}

KeySelection DsaIndexer::select(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer) const {
  const int64_t heads = options.num_heads, dim = options.head_dim, rot = options.rope.rot_dim();
  const int64_t tokens = batch.size();

  Tensor queries = cpu::linear(q_resid, wq_b);  // [T, heads * dim]
  Tensor keys = cpu::layer_norm(cpu::linear(x, wk), k_norm_weight, k_norm_bias, options.k_norm_eps);  // [T, dim]
  Tensor head_weights = cpu::linear(x, weights_proj);  // [T, heads]
  const float weight_scale = 1.0f / std::sqrt(float(heads));
  for (int64_t i = 0; i < head_weights.numel(); ++i) head_weights.data()[i] *= weight_scale;

  // NeoX (half-split) RoPE on the leading `rot` dims of every query head and of the key; the main
  // MLA attention uses the interleaved pairing instead.
  std::vector<float> cos(rot / 2), sin(rot / 2);
  for (int64_t t = 0; t < tokens; ++t) {
    options.rope.angles(batch.positions[t], cos.data(), sin.data());
    for (int64_t h = 0; h < heads; ++h) apply_rope_neox(queries.row(t) + h * dim, cos.data(), sin.data(), int(rot));
    apply_rope_neox(keys.row(t), cos.data(), sin.data(), int(rot));
  }

  KeySelection selection;
  selection.keys.resize(tokens);
  std::vector<float> cached;  // one sequence's index keys, [end, dim]
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t end = seq.start() + seq.count;
    seq.cache().write(layer, PageKind::DsaIndexKey, seq.start(), seq.count, keys.row(seq.offset));
    if (end <= options.topk) continue;  // every query sees at most topk keys: all causal prefixes
    cached.resize(end * dim);
    seq.cache().read(layer, PageKind::DsaIndexKey, 0, end, cached.data());
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t row = seq.offset + i;
      const int64_t visible = seq.start() + i + 1;
      if (visible <= options.topk) continue;  // every visible key is selected: the causal prefix
      std::vector<float> score = scores(queries.row(row), head_weights.row(row), cached.data(), visible);
      std::vector<int32_t> top = cpu::top_k(score.data(), visible, options.topk);
      std::sort(top.begin(), top.end());
      selection.keys[row] = std::move(top);
    }
  }
  return selection;
}

}  // namespace sparrow
