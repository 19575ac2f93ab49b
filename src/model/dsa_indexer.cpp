#include "model/dsa_indexer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/context_parallel.h"
#include "model/device_step.h"
#include "model/lora.h"
#include "model/selection_probe.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/dsa_indexer/index_scores.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "kernels/cuda/topk/topk.h"
#endif

namespace sparrow {

namespace {
// How the CPU rounds queries (and MXFP4 keys) to select as the GPU does with the cache's key format.
cpu::DsaKeyRounding key_rounding(const SequenceCache& cache, int layer) {
  const PagedStorage* paged = cache.paged();
  const PageFormat format = paged ? paged->page(layer, PageKind::DsaIndexKey).format : PageFormat::Float32;
  return format == PageFormat::Mxfp4Rows                                          ? cpu::DsaKeyRounding::Mxfp4
         : format == PageFormat::Fp8IndexKey || format == PageFormat::Nvfp4Rows ? cpu::DsaKeyRounding::Fp8
                                                                                 : cpu::DsaKeyRounding::None;
}
}  // namespace

std::unique_ptr<DsaIndexer> DsaIndexer::load(Checkpoint& ckpt, const std::string& prefix,
                                             const DsaIndexerOptions& options) {
  SPARROW_CHECK(!options.rope || options.rope->rot_dim() <= options.head_dim, "DSA indexer: rotary dimension ",
                options.rope ? options.rope->rot_dim() : 0, " exceeds index_head_dim ", options.head_dim);
  SPARROW_CHECK(options.topk > 0, "DSA indexer: index_topk must be positive, got ", options.topk);
  auto indexer = std::make_unique<DsaIndexer>();
  indexer->options = options;
  const int64_t heads = options.num_heads, dim = options.head_dim;
  indexer->wq_b = ckpt.take_linear(prefix + "wq_b.weight", {heads * dim, options.query_input});
  indexer->wk = ckpt.take_linear(prefix + "wk.weight", {dim, options.hidden});
  indexer->k_norm_weight = ckpt.take(prefix + "k_norm.weight", {dim});
  indexer->k_norm_bias = ckpt.take(prefix + "k_norm.bias", {dim});
  indexer->weights_proj = ckpt.take_linear(prefix + "weights_proj.weight", {heads, options.hidden});
  indexer->tp = ckpt.tensor_parallel();
  indexer->prefix = prefix;
  return indexer;
}

DsaIndexer::Projection DsaIndexer::project(const Tensor& x, const Tensor& q_resid, const Batch& batch) const {
  const int64_t heads = options.num_heads, dim = options.head_dim;
  Projection p;
  p.queries = ops::linear(q_resid, wq_b);  // [T, H * dim]
  lora::add_(p.queries, q_resid, batch, prefix, "wq_b");
  Tensor keys = ops::linear(x, wk);  // [T, dim]
  lora::add_(keys, x, batch, prefix, "wk");
  p.keys = ops::layer_norm(keys, k_norm_weight, k_norm_bias, options.k_norm_eps);
  p.head_weights = ops::linear(x, weights_proj, ScalarType::F32);  // [T, H]
  lora::add_(p.head_weights, x, batch, prefix, "weights_proj");
  ops::scale_(p.head_weights, 1.0f / std::sqrt(float(heads)));
  // NeoX (half-split) RoPE on the leading rot dims of every query head and of the key; the main MLA
  // attention uses the interleaved pairing instead.
  if (!options.rope) return p;
  const Tensor& positions = batch.positions_on(x.device());
  const Tensor& inv_freq = options.rope->inv_freq_on(x.device());
  ops::rope_(p.queries, positions, inv_freq, options.rope->attention_scaling, 0, heads, dim, /*interleaved=*/false);
  ops::rope_(p.keys, positions, inv_freq, options.rope->attention_scaling, 0, 1, dim, false);
  return p;
}

Tensor DsaIndexer::select(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer) const {
  const int64_t dim = options.head_dim, k = options.topk, rows = batch.size();
  Projection p = project(x, q_resid, batch);
  if (tp.context_parallel()) return select_context_parallel(p, batch, layer);  // decode (token-sharded: select_pieces)
  Tensor selected = Tensor::empty({rows, k}, ScalarType::I32, x.device());
  if (x.on_cpu()) {
    std::vector<float> cached;  // one sequence's index keys, [end, dim]
    std::vector<int32_t> exact;
    for (const SeqSlice& seq : batch.seqs) {
      const int64_t end = seq.start() + seq.count;
      seq.cache().write(layer, PageKind::DsaIndexKey, seq.start(), seq.count, p.keys.row(seq.offset));
      // Keys come back as the cache stores them: exact in fp32, rounded in an FP8, MXFP4 or NVFP4 cache. With
      // those keys the GPU's scoring kernels quantise the queries to FP8 (e4m3 and a scale per (token, head),
      // for every key format: kernels/cuda/dsa_indexer/fp4_keys.cuh says why), and widen the keys exactly,
      // except MXFP4 blocks far below their key's largest; cpu::dsa_select rounds the queries (and such keys)
      // the same way, so both devices select alike, up to ties and the order of the sums.
      cached.resize(end * dim);
      if (end > k) seq.cache().read(layer, PageKind::DsaIndexKey, 0, end, cached.data());
      const cpu::DsaKeyRounding rounding = key_rounding(seq.cache(), layer);
      // kv-quality's probe: the same queries, unrounded, against this prefill's exact fp32 keys.
      SelectionProbe* probe = seq.start() == 0 ? selection_probe() : nullptr;
      if (probe) exact.resize(seq.count * k);
      int32_t* seq_selected = selected.as<int32_t>() + seq.offset * k;
      cpu::dsa_select(shape(), p.queries.row(seq.offset), p.queries.row_size(), p.head_weights.row(seq.offset),
                      p.head_weights.row_size(), seq.count, seq.start(), cached.data(), rounding, seq_selected,
                      probe ? p.keys.row(seq.offset) : nullptr, probe ? exact.data() : nullptr);
      if (!probe) continue;
      auto list = [&](const int32_t* row) { return std::vector<int32_t>(row, std::find(row, row + k, -1)); };
      for (int64_t i = k; i < seq.count; ++i)  // rows that see more than k keys
        probe->add(list(seq_selected + i * k), list(exact.data() + i * k));
    }
    return selected;
  }
#if SPARROW_HAVE_CUDA
  const int64_t heads = options.num_heads;
  SPARROW_CHECK(dim == cuda::kDsaIndexDim && (heads == 32 || heads == 64), "the GPU indexer takes index_head_dim ",
                cuda::kDsaIndexDim, " with 32 or 64 heads (DeepSeek-V3.2, Kimi K3); this model has ", heads, " x ",
                dim);
  const DeviceStep& step = device_step(batch);
  const PageFormat key_format = step.format(layer, PageKind::DsaIndexKey);
  SPARROW_CHECK(cuda::dsa_reads_key_format(key_format),
                "the GPU indexer reads fp8, mxfp4 or nvfp4 index keys (indexer_kv_dtype), not float32 or bfloat16");
  cudaStream_t stream = cuda::stream();

  // The projections, norm and rotation are in bf16 here; head_dim^-0.5 joins num_heads^-0.5 in
  // the head weights (relu(a * s) = a * relu(s) for a > 0), multiplied in by the queries' quantisation.
  const Tensor &queries = p.queries, &keys = p.keys;
  const Tensor& head_weights = p.head_weights;

  // Store this step's keys (quantised to the page's format in the same launch), quantise the queries to
  // FP8, score every visible key of every row, and keep the top-k of each row (its causal prefix when it
  // sees no more than k).
  uint8_t* pool = step.page_base(layer, PageKind::DsaIndexKey);
  cuda::dsa_write_keys(keys.raw(), cuda::DsaDType::BF16, rows, step.row_seq.as<int32_t>(), step.row_pos.as<int32_t>(),
                       step.page_table.as<int64_t>(), step.table_stride, step.block_size(), key_format, pool, stream);
  if (step.max_visible <= k) {  // every row keeps every key it sees (topk_rows' rule): nothing to score
    cuda::topk_rows(nullptr, step.max_visible, step.row_visible.as<int32_t>(), rows, step.max_visible, int(k),
                    selected.as<int32_t>(), nullptr, 0, stream);
    return selected;
  }
  Tensor q_fp8 = Tensor::empty({rows, heads, dim}, ScalarType::U8, x.device());
  Tensor w_folded = Tensor::empty({rows, heads}, ScalarType::F32, x.device());
  cuda::dsa_quantize_queries(queries.raw(), cuda::DsaDType::BF16, head_weights.as<float>(), rows, int(heads),
                             q_fp8.as<uint8_t>(), w_folded.as<float>(), stream, 1.0f / std::sqrt(float(dim)));
  const int64_t ld = (step.max_visible + 1) / 2 * 2;
  Tensor score_rows = Tensor::empty({rows, ld}, ScalarType::F32, x.device());
  // Requests of two tokens each (speculative verification) let the kernel score both against one key read;
  // so do prefill chunks with 4-bit keys, which the same (wgmma) kernel scores at every row count.
  const bool pairs =
      std::all_of(batch.seqs.begin(), batch.seqs.end(), [](const SeqSlice& s) { return s.count == 2; }) ||
      (key_format != PageFormat::Fp8IndexKey && rows >= 2 * int64_t(batch.seqs.size()));
  cuda::dsa_index_scores(q_fp8.as<uint8_t>(), w_folded.as<float>(), rows, int(heads), step.row_seq.as<int32_t>(),
                         step.row_visible.as<int32_t>(), pool, step.page_table.as<int64_t>(), step.table_stride,
                         step.block_size(), key_format, score_rows.as<float>(), ld, step.max_visible, stream,
                         cuda::DsaScoreKernel::Auto, pairs ? 2 : 1);
  const size_t workspace_bytes = cuda::topk_workspace_bytes(rows, step.max_visible, int(k));
  Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(workspace_bytes, 1))}, ScalarType::U8, x.device());
  cuda::topk_rows(score_rows.as<float>(), ld, step.row_visible.as<int32_t>(), rows, step.max_visible, int(k),
                  selected.as<int32_t>(), workspace.raw(), workspace_bytes, stream);
  return selected;
#else
  (void)layer;
  fail("the DSA indexer on a GPU in a build without the CUDA backend");
#endif
}

Tensor DsaIndexer::select_pieces(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer,
                                 const std::vector<RowPiece>& pieces) const {
  SPARROW_CHECK(x.on_cpu(), "token-sharded prefill runs on the CPU backend so far");
  const int64_t dim = options.head_dim, k = options.topk;
  Projection p = project(x, q_resid, batch);
  // This step's keys into the cache: every key (the index cache is replicated), or under DCP this rank's.
  store_step_rows(tp, batch, layer, PageKind::DsaIndexKey, p.keys);
  const std::vector<std::vector<float>> context = step_context(tp, batch, layer, PageKind::DsaIndexKey, dim);
  int64_t rows = 0;
  for (const RowPiece& piece : pieces) rows += piece.count;
  Tensor selected = Tensor::empty({rows, k}, ScalarType::I32);
  std::vector<float> cached;
  int64_t done = 0;
  for (const RowPiece& piece : pieces) {
    const SeqSlice& seq = batch.seqs[piece.seq];
    const int64_t start = seq.start() + piece.begin, end = start + piece.count, row = seq.offset + piece.begin;
    // A copy, as select() reads the keys afresh: dsa_select may round them in place (MXFP4).
    cached.assign(context[piece.seq].begin(), context[piece.seq].begin() + end * dim);
    const cpu::DsaKeyRounding rounding = key_rounding(seq.cache(), layer);
    cpu::dsa_select(shape(), p.queries.row(row), p.queries.row_size(), p.head_weights.row(row),
                    p.head_weights.row_size(), piece.count, start, cached.data(), rounding,
                    selected.as<int32_t>() + done * k);
    done += piece.count;
  }
  return selected;
}

// Each rank writes and scores only its own keys (token j on dcp rank j mod W, local row j / W); a query that
// sees no more than k keys takes all of them, as select() does, and the others go through the exact merge.
Tensor DsaIndexer::select_context_parallel(const Projection& p, const Batch& batch, int layer) const {
  const int64_t dim = options.head_dim, k = options.topk;
  const int W = tp.dcp_size, me = tp.dcp_rank;
  Tensor selected = Tensor::empty({batch.size(), k}, ScalarType::I32);
  std::vector<std::vector<float>> scores;  // the rows that need the merge, in batch order
  std::vector<int64_t> visible;
  std::vector<int32_t*> merged_rows;
  std::vector<float> cached;
  store_step_rows(tp, batch, layer, PageKind::DsaIndexKey, p.keys);
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t start = seq.start(), end = start + seq.count, last = dcp_local_rows(end, me, W);
    const cpu::DsaKeyRounding rounding = key_rounding(seq.cache(), layer);
    if (end > k) {
      cached.resize(last * dim);
      seq.cache().read(layer, PageKind::DsaIndexKey, 0, last, cached.data());
      cpu::round_dsa_keys_like_gpu(cached.data(), last, dim, rounding);
    }
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t seen = start + i + 1, local = dcp_local_rows(seen, me, W);
      int32_t* row = selected.as<int32_t>() + (seq.offset + i) * k;
      if (seen <= k) {  // every visible key: this rank's share of the causal prefix
        std::fill(row, row + k, -1);
        for (int64_t l = 0; l < local; ++l) row[l] = int32_t(l);
        continue;
      }
      scores.push_back(cpu::dsa_query_scores(shape(), p.queries.row(seq.offset + i), p.head_weights.row(seq.offset + i),
                                             cached.data(), local, rounding));
      visible.push_back(seen);
      merged_rows.push_back(row);
    }
  }
  // One merge for the step's rows (the same rows on every rank), then each into its place.
  std::vector<int32_t> merged(scores.size() * k);
  dcp_select_topk(tp, k, scores, visible, merged.data());
  for (size_t i = 0; i < merged_rows.size(); ++i) std::copy_n(merged.data() + i * k, k, merged_rows[i]);
  return selected;
}

}  // namespace sparrow
