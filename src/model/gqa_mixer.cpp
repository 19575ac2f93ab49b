#include "model/gqa_mixer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/selection_probe.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/gqa/gqa_attention.h"
#include "kernels/cuda/msa/msa.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#endif

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
  spec.pages.push_back({PageKind::GqaKeyValue, 2 * kv_heads * head_dim, 0, kv_heads});
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
  if (!x.on_cpu()) return ops::linear(attend_gpu(q, k, v, index_q, index_k, batch, layer), o_proj);

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
      if (SelectionProbe* probe = selection_probe(); probe && seq.start() == 0) {
        // The blocks the exact fp32 keys of this prefill keep, per index head and query that has more
        // blocks to choose from than it keeps (kv-quality's recall).
        const BlockSelection exact = indexer->select(index_q.row(seq.offset), index_q.row_size(), seq.count, 0,
                                                     index_k.row(seq.offset), end);
        std::vector<int32_t> kept, exact_kept;
        for (int64_t g = 0; g < exact.heads; ++g)
          for (int64_t i = 0; i < exact.queries; ++i) {
            if (i / indexer->block_size + 1 <= indexer->topk_blocks) continue;
            kept.clear();
            exact_kept.clear();
            for (int64_t b = 0; b < exact.blocks; ++b) {
              if (selection->kept(g, i, b)) kept.push_back(int32_t(b));
              if (exact.kept(g, i, b)) exact_kept.push_back(int32_t(b));
            }
            probe->add(kept, exact_kept);
          }
      }
    }
    attend(q, seq, cached_kv.data(), selection ? &*selection : nullptr, out);
  }
  return ops::linear(out, o_proj);
}

// The GPU attention: this step's K/V rows (and MSA index keys) are written into the paged cache, the MSA
// selector (kernels/cuda/msa) picks each row's blocks per index head, and one kernel (kernels/cuda/gqa)
// attends over the causal prefix or the kept blocks in place.
Tensor GqaAttention::attend_gpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& index_q,
                                const Tensor& index_k, const Batch& batch, int layer) const {
#if SPARROW_HAVE_CUDA
  const DeviceStep& step = device_step(batch);
  // K/V pages: bfloat16, FP8 rows (fp8, fp8_per_tensor) or NVFP4 rows (nvfp4), read in place.
  const PageFormat kv_format = step.format(layer, PageKind::GqaKeyValue);
  SPARROW_CHECK(cuda::gqa_reads_kv_format(kv_format), "the GPU GQA kernels read bfloat16, fp8 or nvfp4 K/V pages "
                "(--kv-cache-dtype auto, bfloat16, fp8, fp8_per_tensor or nvfp4)");
  cudaStream_t stream = cuda::stream();
  const int64_t rows = batch.size();
  const int32_t* row_seq = step.row_seq.as<int32_t>();
  const int32_t* row_pos = step.row_pos.as<int32_t>();
  const int64_t* table = step.page_table.as<int64_t>();
  uint8_t* kv_pool = step.page_base(layer, PageKind::GqaKeyValue);
  cuda::gqa_write_kv(k.raw(), v.raw(), rows, int(kv_heads), int(head_dim), row_seq, row_pos, table, step.table_stride,
                     step.block_size(), kv_pool, kv_format, stream);

  Tensor blocks;
  int index_heads = 0, max_blocks = 0, index_block_size = 0;
  if (indexer) {
    // Index keys (indexer_kv_dtype): bf16 (256 B a token at dim 128), scale-free e4m3 rows (fp8, 128 B),
    // NVFP4 (72 B) or MXFP4 (68 B), read in place.
    const PageFormat key_format = step.format(layer, PageKind::MsaIndexKey);
    SPARROW_CHECK(cuda::msa_reads_key_format(key_format), "the GPU MSA selector reads bfloat16, fp8, nvfp4 or mxfp4 "
                  "index keys (indexer_kv_dtype auto, bfloat16, fp8, nvfp4 or mxfp4)");
    uint8_t* key_pool = step.page_base(layer, PageKind::MsaIndexKey);
    cuda::msa_write_keys(index_k.raw(), rows, int(indexer->head_dim), row_seq, row_pos, table, step.table_stride,
                         step.block_size(), key_pool, key_format, stream);
    index_heads = int(indexer->heads);
    max_blocks = int(indexer->topk_blocks);
    index_block_size = int(indexer->block_size);
    blocks = Tensor::empty({rows, indexer->heads, indexer->topk_blocks}, ScalarType::I32, q.device());
    const size_t bytes = cuda::msa_select_workspace_bytes(rows, index_heads, step.max_visible, index_block_size);
    Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, ScalarType::U8, q.device());
    cuda::msa_select_blocks(index_q.raw(), rows, index_heads, int(indexer->head_dim), row_seq, row_pos,
                            step.max_visible, key_pool, key_format, table, step.table_stride, step.block_size(),
                            index_block_size, max_blocks, int(indexer->local_blocks), int(indexer->init_blocks),
                            blocks.as<int32_t>(), nullptr,
                            workspace.raw(), bytes, stream);
  }
  Tensor out = Tensor::empty({rows, heads * head_dim}, ScalarType::BF16, q.device());
  const size_t bytes = cuda::gqa_attention_workspace_bytes(rows, int(heads), int(kv_heads), int(head_dim),
                                                           step.max_visible, index_heads, max_blocks, index_block_size,
                                                           kv_format);
  Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, ScalarType::U8, q.device());
  const float scale = float(std::pow(double(head_dim), -0.5));  // MiniMaxM3VLAttention.scaling
  cuda::gqa_attention(q.raw(), out.raw(), rows, int(heads), int(kv_heads), int(head_dim), scale, row_seq, row_pos,
                      step.max_visible, indexer ? blocks.as<int32_t>() : nullptr, index_heads, max_blocks,
                      index_block_size, table, step.table_stride, step.block_size(), kv_pool, kv_format,
                      workspace.raw(), bytes, stream);
  return out;
#else
  (void)k, (void)v, (void)index_q, (void)index_k, (void)batch, (void)layer;
  fail("GQA on a GPU in a build without the CUDA backend");
#endif
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
