#include "model/gqa_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/ops.h"
#include "kernels/ops.h"

namespace sparrow {

namespace {
// Queries per BLAS call: bounds the [tile, n_keys] score buffer on long prefills.
constexpr int64_t kQueryTile = 256;
}  // namespace

void rotate_heads(Tensor& x, int64_t head_dim, const Tensor& positions, const Rope& rope) {
  ops::rope_(x, positions, rope.inv_freq_on(x.device()), rope.attention_scaling, 0, x.row_size() / head_dim, head_dim,
             /*interleaved=*/false);
}

LayerCacheSpec GqaAttention::cache_spec_for(int64_t kv_heads, int64_t head_dim, int64_t index_head_dim) {
  LayerCacheSpec spec;
  spec.pages.push_back({PageKind::GqaKeyValue, 2 * kv_heads * head_dim});
  if (index_head_dim > 0) spec.pages.push_back({PageKind::MsaIndexKey, index_head_dim});
  return spec;
}

LayerCacheSpec GqaAttention::cache_spec() const {
  return cache_spec_for(kv_heads, head_dim, indexer ? indexer->head_dim : 0);
}

Tensor GqaAttention::forward(const Tensor& x, const Batch& batch, int layer) {
  Tensor q = ops::linear(x, q_proj);  // [T, heads * head_dim]
  Tensor k = ops::linear(x, k_proj);  // [T, kv_heads * head_dim]
  Tensor v = ops::linear(x, v_proj);  // [T, kv_heads * head_dim]
  ops::rms_norm_(q, q_norm, norm_eps, /*unit_offset=*/true);
  ops::rms_norm_(k, k_norm, norm_eps, /*unit_offset=*/true);
  const Tensor& positions = batch.positions_on(x.device());
  rotate_heads(q, head_dim, positions, rope);
  rotate_heads(k, head_dim, positions, rope);
  Tensor index_q, index_k;
  if (indexer) indexer->project(x, positions, rope, index_q, index_k);

  const int64_t kv_width = kv_heads * head_dim;
  Tensor out = Tensor::zeros({x.dim(0), heads * head_dim});
  std::vector<float> rows, cached_kv, cached_index_keys;
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t end = seq.start() + seq.count;
    // Interleave each new token's K and V into one cache row: [K heads | V heads].
    rows.resize(seq.count * 2 * kv_width);
    for (int64_t i = 0; i < seq.count; ++i) {
      std::copy(k.row(seq.offset + i), k.row(seq.offset + i) + kv_width, rows.begin() + i * 2 * kv_width);
      std::copy(v.row(seq.offset + i), v.row(seq.offset + i) + kv_width, rows.begin() + (i * 2 + 1) * kv_width);
    }
    seq.cache().write(layer, PageKind::GqaKeyValue, seq.start(), seq.count, rows.data());
    cached_kv.resize(end * 2 * kv_width);
    seq.cache().read(layer, PageKind::GqaKeyValue, 0, end, cached_kv.data());
    std::optional<BlockSelection> selection;
    if (indexer) {
      seq.cache().write(layer, PageKind::MsaIndexKey, seq.start(), seq.count, index_k.row(seq.offset));
      cached_index_keys.resize(end * indexer->head_dim);
      seq.cache().read(layer, PageKind::MsaIndexKey, 0, end, cached_index_keys.data());
      selection = indexer->select(index_q.row(seq.offset), index_q.row_size(), seq.count, seq.start(),
                                  cached_index_keys.data(), end);
    }
    attend(q, seq, cached_kv.data(), selection ? &*selection : nullptr, out);
  }
  return ops::linear(out, o_proj);
}

void GqaAttention::attend(const Tensor& q, const SeqSlice& seq, const float* kv, const BlockSelection* selection,
                          Tensor& out) const {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float scale = float(std::pow(double(head_dim), -0.5));  // MiniMaxM3VLAttention.scaling
  const int64_t kv_row = 2 * kv_heads * head_dim;
  const int64_t start = seq.start();
  std::vector<float> probs;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kv_head = h / (heads / kv_heads);
    // build_block_mask repeats each index head's selection over heads / index_n_heads query heads.
    const int64_t index_head = selection ? h / (heads / selection->heads) : 0;
    const float* keys = kv + kv_head * head_dim;
    const float* values = keys + kv_heads * head_dim;
    for (int64_t i0 = 0; i0 < seq.count; i0 += kQueryTile) {
      const int64_t i1 = std::min(seq.count, i0 + kQueryTile);
      const int64_t seen = start + i1;  // keys visible to the tile's last query
      probs.resize((i1 - i0) * seen);
      cpu::gemm_nt(i1 - i0, seen, head_dim, q.row(seq.offset + i0) + h * head_dim, q.row_size(), keys, kv_row,
                   probs.data(), seen);
      parallel_for(i1 - i0, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const int64_t i = i0 + r, position = start + i;
          float* row = probs.data() + r * seen;
          for (int64_t s = 0; s < seen; ++s) {
            bool visible = s <= position && (!selection || selection->kept(index_head, i, s / indexer->block_size));
            row[s] = visible ? row[s] * scale : neg_inf;
          }
          cpu::softmax_inplace(row, seen);
        }
      });
      cpu::gemm_nn(i1 - i0, head_dim, seen, probs.data(), seen, values, kv_row,
                   out.row(seq.offset + i0) + h * head_dim, out.row_size());
    }
  }
}

}  // namespace sparrow
