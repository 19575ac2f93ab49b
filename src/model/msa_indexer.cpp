#include "model/msa_indexer.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/gqa_mixer.h"
#include "model/selection_probe.h"

#if SPARROW_HAVE_CUDA
#include "core/device/stream.h"
#include "kernels/cuda/msa/msa.h"
#endif

namespace sparrow {

void MsaIndexer::project(const Tensor& x, const Tensor& positions, const Rope& rope, Tensor& queries,
                         Tensor& keys) const {
  queries = ops::linear(x, q_proj);  // [T, heads * head_dim]
  keys = ops::linear(x, k_proj);     // [T, head_dim]
  ops::rms_norm_(queries, q_norm, norm_eps, /*unit_offset=*/true);
  ops::rms_norm_(keys, k_norm, norm_eps, /*unit_offset=*/true);
  if (head_dim >= rope.rot_dim()) {
    rotate_heads(queries, head_dim, positions, rope);
    rotate_heads(keys, head_dim, positions, rope);
    return;
  }
  // MiniMaxM3VLIndexer slices the attention's cos/sin to index_head_dim: a head narrower than the
  // rotary dims is rotated whole, each element at its slot's frequency.
  const Tensor& inv_freq = rope.inv_freq_on(x.device());
  ops::rope_narrow_heads_(queries, positions, inv_freq, rope.attention_scaling, head_dim);
  ops::rope_narrow_heads_(keys, positions, inv_freq, rope.attention_scaling, head_dim);
}

Tensor MsaIndexer::select(const Tensor& queries, const Tensor& keys, const Batch& batch, int layer) const {
  const int64_t rows = batch.size();
  Tensor kept = Tensor::empty({rows, heads, topk_blocks}, ScalarType::I32, queries.device());
  if (queries.on_cpu()) {
    std::vector<float> cached;  // one sequence's index keys, [end, head_dim]
    for (const SeqSlice& seq : batch.seqs) {
      const int64_t end = seq.start() + seq.count;
      seq.cache().write(layer, PageKind::MsaIndexKey, seq.start(), seq.count, keys.row(seq.offset));
      cached.resize(end * head_dim);
      seq.cache().read(layer, PageKind::MsaIndexKey, 0, end, cached.data());
      int32_t* seq_kept = kept.as<int32_t>() + seq.offset * heads * topk_blocks;
      cpu::msa_select(shape(), queries.row(seq.offset), queries.row_size(), seq.count, seq.start(), cached.data(),
                      seq_kept);
      if (SelectionProbe* probe = selection_probe(); probe && seq.start() == 0) {
        // The blocks the exact fp32 keys of this prefill keep, per index head and query that has more
        // blocks to choose from than it keeps (kv-quality's recall).
        std::vector<int32_t> exact(seq.count * heads * topk_blocks);
        cpu::msa_select(shape(), queries.row(seq.offset), queries.row_size(), seq.count, 0, keys.row(seq.offset),
                        exact.data());
        auto list = [&](const int32_t* table, int64_t g, int64_t i) {
          const int32_t* first = table + (i * heads + g) * topk_blocks;
          return std::vector<int32_t>(first, std::find(first, first + topk_blocks, -1));
        };
        for (int64_t g = 0; g < heads; ++g)
          for (int64_t i = 0; i < seq.count; ++i)
            if (i / block_size + 1 > topk_blocks) probe->add(list(seq_kept, g, i), list(exact.data(), g, i));
      }
    }
    return kept;
  }
#if SPARROW_HAVE_CUDA
  // Index keys (indexer_kv_dtype): bf16 (256 B a token at dim 128), scale-free e4m3 rows (fp8, 128 B),
  // NVFP4 (72 B) or MXFP4 (68 B), read in place.
  const DeviceStep& step = device_step(batch);
  const PageFormat key_format = step.format(layer, PageKind::MsaIndexKey);
  SPARROW_CHECK(cuda::msa_reads_key_format(key_format), "the GPU MSA selector reads bfloat16, fp8, nvfp4 or mxfp4 "
                "index keys (indexer_kv_dtype auto, bfloat16, fp8, nvfp4 or mxfp4)");
  cudaStream_t stream = cuda::stream();
  const int32_t* row_seq = step.row_seq.as<int32_t>();
  const int32_t* row_pos = step.row_pos.as<int32_t>();
  const int64_t* table = step.page_table.as<int64_t>();
  uint8_t* key_pool = step.page_base(layer, PageKind::MsaIndexKey);
  cuda::msa_write_keys(keys.raw(), rows, int(head_dim), row_seq, row_pos, table, step.table_stride,
                       step.block_size(), key_pool, key_format, stream);
  const size_t bytes = cuda::msa_select_workspace_bytes(rows, int(heads), step.max_visible, int(block_size));
  Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, ScalarType::U8, queries.device());
  cuda::msa_select_blocks(queries.raw(), rows, int(heads), int(head_dim), row_seq, row_pos, step.max_visible,
                          key_pool, key_format, table, step.table_stride, step.block_size(), int(block_size),
                          int(topk_blocks), int(local_blocks), int(init_blocks), kept.as<int32_t>(), nullptr,
                          workspace.raw(), bytes, stream);
  return kept;
#else
  (void)layer;
  fail("the MSA selector on a GPU in a build without the CUDA backend");
#endif
}

}  // namespace sparrow
