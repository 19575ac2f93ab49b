#include "model/msa_indexer.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/context_parallel.h"
#include "model/device_step.h"
#include "model/tensor_parallel.h"
#include "model/gqa_mixer.h"
#include "model/lora.h"
#include "model/selection_probe.h"

#if SPARROW_HAVE_CUDA
#include "core/device/stream.h"
#include "kernels/cuda/msa/msa.h"
#endif

namespace sparrow {

void MsaIndexer::project(const Tensor& x, const Batch& batch, const Rope& rope, Tensor& queries, Tensor& keys) const {
  queries = ops::linear(x, q_proj);  // [T, heads * head_dim]
  lora::add_(queries, x, batch, prefix, "q_proj");
  keys = ops::linear(x, k_proj);  // [T, head_dim]
  lora::add_(keys, x, batch, prefix, "k_proj");
  const Tensor& positions = batch.positions_on(x.device());
  if (head_dim >= rope.rot_dim()) {
    norm_and_rotate_heads(queries, q_norm, norm_eps, /*unit_offset=*/true, positions, rope);
    norm_and_rotate_heads(keys, k_norm, norm_eps, /*unit_offset=*/true, positions, rope);
    return;
  }
  ops::rms_norm_(queries, q_norm, norm_eps, /*unit_offset=*/true);
  ops::rms_norm_(keys, k_norm, norm_eps, /*unit_offset=*/true);
  // MiniMaxM3VLIndexer slices the attention's cos/sin to index_head_dim: a head narrower than the
  // rotary dims is rotated whole, each element at its slot's frequency.
  const Tensor& inv_freq = rope.inv_freq_on(x.device());
  ops::rope_narrow_heads_(queries, positions, inv_freq, rope.attention_scaling, head_dim);
  ops::rope_narrow_heads_(keys, positions, inv_freq, rope.attention_scaling, head_dim);
}

Tensor MsaIndexer::select(const Tensor& queries, const Tensor& keys, const Batch& batch, int layer) const {
  if (tp.sharded() && tp.indexer_decode_cp) {
    for (const SeqSlice& seq : batch.seqs)  // the index keys stay whole on every rank
      seq.cache().write(layer, PageKind::MsaIndexKey, seq.start(), seq.count, keys.row(seq.offset));
    return select_context_parallel(queries, batch, layer);
  }
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

Tensor MsaIndexer::select_context_parallel(const Tensor& queries, const Batch& batch, int layer) const {
  SPARROW_CHECK(queries.on_cpu(), "the MSA indexer's decode context parallelism runs on the CPU backend so far");
  const int W = tp.size, me = tp.rank;
  const int64_t rows = batch.size(), H = all_heads, dim = head_dim, k = topk_blocks, bs = block_size;
  // Every head's query: each rank's own heads, all-gathered and put in place (heads a rank shares with
  // another, under grouped_share's replication, arrive twice, alike).
  std::vector<float> gathered(size_t(W * rows * heads * dim)), full(size_t(rows * H * dim));
  tp.comm->all_gather(queries.data(), gathered.data(), rows * heads * dim, ScalarType::F32);
  std::vector<int64_t> first(W);
  for (int r = 0; r < W; ++r) {
    const IndexRange range = grouped_share(TensorParallel{r, W}, query_heads, H, "index_n_heads");
    SPARROW_CHECK(range.count() == heads, "MSA indexer: rank ", r, " holds ", range.count(), " index heads, this one ", heads);
    first[r] = range.begin;
    for (int64_t t = 0; t < rows; ++t)
      std::copy_n(gathered.data() + ((r * rows + t) * heads) * dim, heads * dim, full.data() + (t * H + range.begin) * dim);
  }

  // This rank's best blocks of every (row, head), for the ranks that own the head: [owner][row][its heads][k].
  std::vector<uint64_t> send(size_t(W * rows * heads * k), 0), recv(send.size());
  std::vector<float> mine, scores;  // this rank's blocks' keys of one sequence; one row's products
  std::vector<int64_t> block_at;    // where each of this rank's blocks starts in `mine`
  std::vector<uint64_t> candidates;
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t end = seq.start() + seq.count;
    mine.clear();
    block_at.clear();
    for (int64_t b = me; b * bs < end; b += W) {  // blocks b = me, me + W, ...: the share this rank reads
      const int64_t from = b * bs, to = std::min(end, from + bs);
      block_at.push_back(int64_t(mine.size()) / dim);
      mine.resize(mine.size() + size_t((to - from) * dim));
      seq.cache().read(layer, PageKind::MsaIndexKey, from, to, mine.data() + block_at.back() * dim);
    }
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t t = seq.offset + i, position = seq.start() + i, newest = position / bs;
      // The keys this row sees among this rank's blocks: every one of its blocks before `newest`, and of
      // `newest` (when it is this rank's) those up to the row's position.
      int64_t n = 0, seen_blocks = 0;
      for (size_t j = 0; j < block_at.size(); ++j) {
        const int64_t b = me + int64_t(j) * W;
        if (b > newest) break;
        n = block_at[j] + (b < newest ? bs : position - b * bs + 1);
        seen_blocks = int64_t(j) + 1;
      }
      const std::vector<int64_t> starts(block_at.begin(), block_at.begin() + seen_blocks);
      scores.resize(size_t(H * seen_blocks));
      cpu::msa_block_scores(H, dim, full.data() + t * H * dim, mine.data(), n, starts, scores.data());
      for (int64_t g = 0; g < H; ++g) {
        candidates.clear();
        for (int64_t j = 0; j < seen_blocks; ++j) {
          const int64_t b = me + j * W;
          // select_blocks' forced blocks: the local ones and the first init_blocks, +inf wherever they live.
          const bool forced = cpu::msa_block_forced(b, newest, local_blocks, init_blocks);
          candidates.push_back(dcp_candidate(forced ? std::numeric_limits<float>::infinity() : scores[g * seen_blocks + j], b));
        }
        for (int owner = 0; owner < W; ++owner)
          if (g >= first[owner] && g < first[owner] + heads)
            dcp_best(candidates, k, send.data() + ((owner * rows + t) * heads + (g - first[owner])) * k);
      }
    }
  }
  tp.comm->all_to_all(send.data(), recv.data(), rows * heads * k, ScalarType::I64);

  // The owner's merge: the best k of every rank's best k, blocks without a visible key (-inf) dropped, in
  // ascending order (select_blocks, then msa_select's sort).
  Tensor kept = Tensor::empty({rows, heads, k}, ScalarType::I32);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      candidates.clear();
      for (int r = 0; r < W; ++r) {
        const uint64_t* from = recv.data() + ((r * rows + t) * heads + h) * k;
        candidates.insert(candidates.end(), from, from + k);
      }
      std::vector<uint64_t> best(static_cast<size_t>(k));
      dcp_best(candidates, k, best.data());
      int32_t* out = kept.as<int32_t>() + (t * heads + h) * k;
      int64_t n = 0;
      for (uint64_t c : best)
        if (c != 0 && dcp_candidate_score(c) != -std::numeric_limits<float>::infinity())
          out[n++] = int32_t(dcp_candidate_position(c));
      std::sort(out, out + n);
      std::fill(out + n, out + k, -1);
    }
  return kept;
}

}  // namespace sparrow
