#include "model/gqa_mixer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/gqa_reference.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/lora.h"

#if SPARROW_HAVE_CUDA
#include "core/device/stream.h"
#include "kernels/cuda/gqa/gqa_attention.h"
#endif

namespace sparrow {

void norm_and_rotate_heads(Tensor& x, const Tensor& norm, float eps, bool unit_offset, const Tensor& positions,
                           const Rope& rope, bool interleaved) {
  ops::rms_norm_rope_heads_(x, norm, eps, unit_offset, positions, rope.inv_freq_on(x.device()), rope.attention_scaling,
                            interleaved);
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

void GqaAttention::key_value_rows(const Tensor& x, const Batch& batch, Tensor& k, Tensor& v) const {
  k = ops::linear(x, k_proj);  // [T, kv_heads * head_dim]
  v = ops::linear(x, v_proj);  // [T, kv_heads * head_dim]
  lora::add_(k, x, batch, prefix, "k_proj");
  lora::add_(v, x, batch, prefix, "v_proj");
  norm_and_rotate_heads(k, k_norm, norm_eps, unit_offset_norm, batch.positions_on(x.device()), rope,
                        rope_interleaved);
}

void GqaAttention::store_rows(const Tensor& x, const Batch& batch, int layer) const {
  SPARROW_CHECK(!tp.sharded(), "GQA: store_rows under tensor parallelism");
  Tensor k, v;
  key_value_rows(x, batch, k, v);
  write_rows(k, v, batch, layer);
}

Tensor GqaAttention::forward(const Tensor& x, const Batch& batch, int layer) {
  Tensor q = ops::linear(x, q_proj);  // [T, heads * head_dim]
  lora::add_(q, x, batch, prefix, "q_proj");
  const Tensor& positions = batch.positions_on(x.device());
  norm_and_rotate_heads(q, q_norm, norm_eps, unit_offset_norm, positions, rope, rope_interleaved);
  Tensor k, v;
  key_value_rows(x, batch, k, v);
  Tensor kept;  // MSA layers: the blocks each (row, index head) keeps
  if (indexer) {
    Tensor index_q, index_k;
    indexer->project(x, batch, rope, index_q, index_k);
    kept = indexer->select(index_q, index_k, batch, layer);
  }
  const Tensor attended = attend(q, k, v, kept, batch, layer);
  Tensor out = ops::linear(attended, o_proj);
  lora::add_(out, attended, batch, prefix, "o_proj");
  ops::all_reduce_(tp, out);
  return out;
}

void GqaAttention::write_rows(const Tensor& k, const Tensor& v, const Batch& batch, int layer) const {
  if (k.on_cpu()) {
    // Interleave each new token's K and V into one cache row: [K heads | V heads].
    const int64_t kv_width = kv_heads * head_dim;
    std::vector<float> new_rows;
    for (const SeqSlice& seq : batch.seqs) {
      new_rows.resize(seq.count * 2 * kv_width);
      for (int64_t i = 0; i < seq.count; ++i) {
        std::copy(k.row(seq.offset + i), k.row(seq.offset + i) + kv_width, new_rows.begin() + i * 2 * kv_width);
        std::copy(v.row(seq.offset + i), v.row(seq.offset + i) + kv_width,
                  new_rows.begin() + (i * 2 + 1) * kv_width);
      }
      seq.cache().write(layer, PageKind::GqaKeyValue, seq.start(), seq.count, new_rows.data());
    }
    return;
  }
#if SPARROW_HAVE_CUDA
  const DeviceStep& step = device_step(batch);
  const PageFormat kv_format = step.format(layer, PageKind::GqaKeyValue);
  SPARROW_CHECK(cuda::gqa_reads_kv_format(kv_format), "the GPU GQA kernels read bfloat16, fp8 or nvfp4 K/V pages "
                "(--kv-cache-dtype auto, bfloat16, fp8, fp8_per_tensor or nvfp4)");
  cuda::gqa_write_kv(k.raw(), v.raw(), batch.size(), int(kv_heads), int(head_dim), step.row_seq.as<int32_t>(),
                     step.row_pos.as<int32_t>(), step.page_table.as<int64_t>(), step.table_stride, step.block_size(),
                     step.page_base(layer, PageKind::GqaKeyValue), kv_format, cuda::stream());
#else
  (void)v, (void)batch, (void)layer;
  fail("GQA on a GPU in a build without the CUDA backend");
#endif
}

// This step's K/V rows go into the layer's pages, then every row attends over its causal prefix (or the
// whole step, non_causal; from its window's first key, sliding_window) or its kept blocks: on the CPU
// through the sequence's cache as fp32 (kernels/cpu/gqa_reference.h), on the GPU by one kernel over the
// paged cache in place (kernels/cuda/gqa).
Tensor GqaAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kept,
                            const Batch& batch, int layer) const {
  const float scale = float(std::pow(double(head_dim), -0.5));  // MiniMaxM3VLAttention.scaling
  const int64_t rows = batch.size();
  SPARROW_CHECK(!indexer || (!non_causal && sliding_window == 0), "GQA: a non-causal or windowed layer with an MSA "
                "indexer");
  write_rows(k, v, batch, layer);
  if (q.on_cpu()) {
    const int64_t kv_width = kv_heads * head_dim;
    const cpu::GqaShape shape{heads, kv_heads, head_dim, scale, sliding_window, non_causal};
    Tensor out = Tensor::zeros({rows, heads * head_dim});
    std::vector<float> cached_kv;
    for (const SeqSlice& seq : batch.seqs) {
      const int64_t end = seq.start() + seq.count;
      cached_kv.resize(end * 2 * kv_width);
      seq.cache().read(layer, PageKind::GqaKeyValue, 0, end, cached_kv.data());
      cpu::GqaKeptBlocks blocks;
      if (indexer)
        blocks = {kept.as<int32_t>() + seq.offset * indexer->heads * indexer->topk_blocks, indexer->heads,
                  indexer->topk_blocks, indexer->block_size};
      cpu::gqa_attention(shape, q.row(seq.offset), q.row_size(), seq.count, seq.start(), cached_kv.data(), blocks,
                         out.row(seq.offset), out.row_size());
    }
    return out;
  }
#if SPARROW_HAVE_CUDA
  const DeviceStep& step = device_step(batch);
  // K/V pages: bfloat16, FP8 rows (fp8, fp8_per_tensor) or NVFP4 rows (nvfp4), read in place.
  const PageFormat kv_format = step.format(layer, PageKind::GqaKeyValue);
  SPARROW_CHECK(cuda::gqa_reads_kv_format(kv_format), "the GPU GQA kernels read bfloat16, fp8 or nvfp4 K/V pages "
                "(--kv-cache-dtype auto, bfloat16, fp8, fp8_per_tensor or nvfp4)");
  cudaStream_t stream = cuda::stream();
  const int32_t* row_seq = step.row_seq.as<int32_t>();
  const int64_t* table = step.page_table.as<int64_t>();
  uint8_t* kv_pool = step.page_base(layer, PageKind::GqaKeyValue);
  // Each row sees keys row_first .. row_last: 0 .. its position, unless the DSpark block's attention says
  // otherwise (an upload then: no CUDA graph takes such a batch, DSparkDrafter::capturable).
  Tensor row_last = step.row_pos, row_first;
  if (non_causal || sliding_window > 0) {
    Tensor last = Tensor::empty({rows}, ScalarType::I32), first = Tensor::empty({rows}, ScalarType::I32);
    for (const SeqSlice& seq : batch.seqs)
      for (int64_t i = 0; i < seq.count; ++i) {
        const int64_t position = seq.start() + i;
        last.as<int32_t>()[seq.offset + i] = int32_t(non_causal ? seq.start() + seq.count - 1 : position);
        first.as<int32_t>()[seq.offset + i] =
            int32_t(sliding_window > 0 ? std::max<int64_t>(0, position - (sliding_window - 1)) : 0);
      }
    row_last = last.to(q.device());
    if (sliding_window > 0) row_first = first.to(q.device());
  }
  const int index_heads = indexer ? int(indexer->heads) : 0;
  const int max_blocks = indexer ? int(indexer->topk_blocks) : 0;
  const int index_block_size = indexer ? int(indexer->block_size) : 0;
  Tensor out = Tensor::empty({rows, heads * head_dim}, ScalarType::BF16, q.device());
  const size_t bytes = cuda::gqa_attention_workspace_bytes(rows, int(heads), int(kv_heads), int(head_dim),
                                                           step.max_visible, index_heads, max_blocks, index_block_size,
                                                           kv_format);
  Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, ScalarType::U8, q.device());
  cuda::gqa_attention(q.raw(), out.raw(), rows, int(heads), int(kv_heads), int(head_dim), scale, row_seq,
                      row_last.as<int32_t>(), step.max_visible, indexer ? kept.as<int32_t>() : nullptr, index_heads,
                      max_blocks, index_block_size, table, step.table_stride, step.block_size(), kv_pool, kv_format,
                      workspace.raw(), bytes, stream, row_first.defined() ? row_first.as<int32_t>() : nullptr);
  return out;
#else
  (void)kept, (void)layer;
  fail("GQA on a GPU in a build without the CUDA backend");
#endif
}

}  // namespace sparrow
