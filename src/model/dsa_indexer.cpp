#include "model/dsa_indexer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/selection_probe.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/dsa_indexer/index_scores.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "kernels/cuda/topk/topk.h"
#endif

namespace sparrow {

namespace {

// x -> e4m3(x / s) * s with s = amax / 448: one FP8 vector with its scale, as the GPU quantises each
// (token, head) index query (kernels/cuda/dsa_indexer).
void round_like_fp8(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / cpu::kE4m3Max;
  for (int64_t i = 0; i < n; ++i) x[i] = scale > 0.0f ? cpu::e4m3_to_float(cpu::float_to_e4m3(x[i] / scale)) * scale : 0.0f;
}

// The GPU scores MXFP4 keys on the FP8 tensor cores (kernels/cuda/dsa_indexer/fp4_keys.cuh): a key's values
// are stored as e4m3(v / 2^(eref - 127)), eref = max(emax, 7) - 6 with emax the largest of its E8M0 block
// exponents, and 2^(eref - 127) multiplies the key's score. That is exact for every block within 14
// binades of the key's largest (all keys the codec writes from LayerNorm'd rows); a block further below
// rounds to nearest even in e4m3, and this does the same to one decoded key of n values.
// emax comes from the decoded values: the encoder's block exponent is floor(log2(amax)) - 2 (OCP MX v1.0
// section 6.3), whose largest code is then 4 or 6, so the decoded block amax has the exponent e_b - 127 + 2;
// all-zero and clamped blocks (amax < 2^-125) have e_b = 0, below every other, and a key whose largest
// block is one of them gets eref = 1 either way.
void round_mxfp4_key_like_gpu(float* key, int64_t n) {
  constexpr int kMaxBlocks = 64;
  const int64_t blocks = cpu::fp4_num_blocks(n, cpu::kMxfp4Block);
  if (blocks > kMaxBlocks) return;  // wider than any model's index key
  int exponent[kMaxBlocks];  // E8M0 code of each block, -1 for an all-zero one
  int emax = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (int64_t i = b * cpu::kMxfp4Block; i < std::min<int64_t>(n, (b + 1) * cpu::kMxfp4Block); ++i) {
      if (std::isnan(key[i])) return;  // a NaN block: the key (and its score) is NaN on both devices
      amax = std::max(amax, std::fabs(key[i]));
    }
    exponent[b] = amax > 0.0f ? std::clamp(std::ilogb(amax) - 2 + 127, 0, 254) : -1;
    emax = std::max(emax, exponent[b]);
  }
  const int eref = std::max(emax, 7) - 6;
  for (int64_t b = 0; b < blocks; ++b) {
    if (exponent[b] < 0 || exponent[b] - eref >= -8) continue;  // zeros, or exact in e4m3: unchanged
    for (int64_t i = b * cpu::kMxfp4Block; i < std::min<int64_t>(n, (b + 1) * cpu::kMxfp4Block); ++i)
      key[i] = std::ldexp(cpu::e4m3_to_float(cpu::float_to_e4m3(std::ldexp(key[i], 127 - eref))), eref - 127);
  }
}

}  // namespace

std::unique_ptr<DsaIndexer> DsaIndexer::load(Checkpoint& ckpt, const std::string& prefix,
                                             const DsaIndexerOptions& options) {
  SPARROW_CHECK(options.rope.rot_dim() <= options.head_dim, "DSA indexer: rotary dimension ", options.rope.rot_dim(),
                " exceeds index_head_dim ", options.head_dim);
  SPARROW_CHECK(options.topk > 0, "DSA indexer: index_topk must be positive, got ", options.topk);
  auto indexer = std::make_unique<DsaIndexer>();
  indexer->options = options;
  const int64_t heads = options.num_heads, dim = options.head_dim;
  indexer->wq_b = ckpt.take_linear(prefix + "wq_b.weight", {heads * dim, options.query_input});
  indexer->wk = ckpt.take_linear(prefix + "wk.weight", {dim, options.hidden});
  indexer->k_norm_weight = ckpt.take(prefix + "k_norm.weight", {dim});
  indexer->k_norm_bias = ckpt.take(prefix + "k_norm.bias", {dim});
  indexer->weights_proj = ckpt.take_linear(prefix + "weights_proj.weight", {heads, options.hidden});
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

DsaIndexer::Projection DsaIndexer::project(const Tensor& x, const Tensor& q_resid, const Batch& batch) const {
  const int64_t heads = options.num_heads, dim = options.head_dim;
  Projection p;
  p.queries = ops::linear(q_resid, wq_b);                                                          // [T, H * dim]
  p.keys = ops::layer_norm(ops::linear(x, wk), k_norm_weight, k_norm_bias, options.k_norm_eps);  // [T, dim]
  p.head_weights = ops::linear(x, weights_proj, ScalarType::F32);                                 // [T, H]
  ops::scale_(p.head_weights, 1.0f / std::sqrt(float(heads)));
  // NeoX (half-split) RoPE on the leading rot dims of every query head and of the key; the main MLA
  // attention uses the interleaved pairing instead.
  const Tensor& positions = batch.positions_on(x.device());
  const Tensor& inv_freq = options.rope.inv_freq_on(x.device());
  ops::rope_(p.queries, positions, inv_freq, options.rope.attention_scaling, 0, heads, dim, /*interleaved=*/false);
  ops::rope_(p.keys, positions, inv_freq, options.rope.attention_scaling, 0, 1, dim, false);
  return p;
}

KeySelection DsaIndexer::select(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer) const {
  const int64_t heads = options.num_heads, dim = options.head_dim;
  const int64_t tokens = batch.size();
  const Projection p = project(x, q_resid, batch);
  const Tensor &queries = p.queries, &keys = p.keys, &head_weights = p.head_weights;

  KeySelection selection;
  selection.keys.resize(tokens);
  std::vector<float> cached;  // one sequence's index keys, [end, dim]
  std::vector<float> query(heads * dim);
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t end = seq.start() + seq.count;
    seq.cache().write(layer, PageKind::DsaIndexKey, seq.start(), seq.count, keys.row(seq.offset));
    if (end <= options.topk) continue;  // every query sees at most topk keys: all causal prefixes
    cached.resize(end * dim);
    // Keys come back as the cache stores them: exact in fp32, rounded in an FP8, MXFP4 or NVFP4 cache. With
    // those keys the GPU's scoring kernels quantise the queries to FP8 (e4m3 and a scale per (token, head),
    // for every key format: kernels/cuda/dsa_indexer/fp4_keys.cuh says why), and widen the keys exactly,
    // except MXFP4 blocks far below their key's largest; the queries (and such keys) are rounded here the
    // same way, so both devices select alike, up to ties and the order of the sums.
    seq.cache().read(layer, PageKind::DsaIndexKey, 0, end, cached.data());
    const PagedStorage* paged = seq.cache().paged();
    const PageFormat format = paged ? paged->page(layer, PageKind::DsaIndexKey).format : PageFormat::Float32;
    const bool fp8 = format == PageFormat::Fp8IndexKey || format == PageFormat::Mxfp4Rows ||
                     format == PageFormat::Nvfp4Rows;
    if (format == PageFormat::Mxfp4Rows)
      for (int64_t j = 0; j < end; ++j) round_mxfp4_key_like_gpu(cached.data() + j * dim, dim);
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t row = seq.offset + i;
      const int64_t visible = seq.start() + i + 1;
      if (visible <= options.topk) continue;  // every visible key is selected: the causal prefix
      std::copy(queries.row(row), queries.row(row) + heads * dim, query.begin());
      if (fp8)
        for (int64_t h = 0; h < heads; ++h) round_like_fp8(query.data() + h * dim, dim);
      std::vector<float> score = scores(query.data(), head_weights.row(row), cached.data(), visible);
      std::vector<int32_t> top = cpu::top_k(score.data(), visible, options.topk);
      std::sort(top.begin(), top.end());
      if (SelectionProbe* probe = selection_probe(); probe && seq.start() == 0) {
        // The same query, unrounded, against this prefill's exact fp32 keys (kv-quality's recall).
        std::vector<float> exact_score =
            scores(queries.row(row), head_weights.row(row), keys.row(seq.offset), visible);
        std::vector<int32_t> exact = cpu::top_k(exact_score.data(), visible, options.topk);
        std::sort(exact.begin(), exact.end());
        probe->add(top, exact);
      }
      selection.keys[row] = std::move(top);
    }
  }
  return selection;
}

Tensor DsaIndexer::select_gpu(const Tensor& x, const Tensor& q_resid, const Batch& batch, int layer) const {
#if SPARROW_HAVE_CUDA
  const int64_t heads = options.num_heads, dim = options.head_dim, rows = batch.size();
  SPARROW_CHECK(dim == cuda::kDsaIndexDim && (heads == 32 || heads == 64), "the GPU indexer takes index_head_dim ",
                cuda::kDsaIndexDim, " with 32 or 64 heads (DeepSeek-V3.2, Kimi K3); this model has ", heads, " x ",
                dim);
  const DeviceStep& step = device_step(batch);
  const PageFormat key_format = step.format(layer, PageKind::DsaIndexKey);
  SPARROW_CHECK(cuda::dsa_reads_key_format(key_format),
                "the GPU indexer reads fp8, mxfp4 or nvfp4 index keys (indexer_kv_dtype), not float32 or bfloat16");
  cudaStream_t stream = cuda::stream();

  // The same projections, norm and rotation as select(), in bf16; head_dim^-0.5 joins num_heads^-0.5 in
  // the head weights (relu(a * s) = a * relu(s) for a > 0).
  Projection p = project(x, q_resid, batch);
  const Tensor &queries = p.queries, &keys = p.keys;
  Tensor& head_weights = p.head_weights;
  ops::scale_(head_weights, 1.0f / std::sqrt(float(dim)));

  // Store this step's keys (quantised to the page's format in the same launch), quantise the queries to
  // FP8, score every visible key of every row, and keep the top-k of each row (its causal prefix when it
  // sees no more than k).
  uint8_t* pool = step.page_base(layer, PageKind::DsaIndexKey);
  cuda::dsa_write_keys(keys.raw(), cuda::DsaDType::BF16, rows, step.row_seq.as<int32_t>(), step.row_pos.as<int32_t>(),
                       step.page_table.as<int64_t>(), step.table_stride, step.block_size(), key_format, pool, stream);
  Tensor q_fp8 = Tensor::empty({rows, heads, dim}, ScalarType::U8, x.device());
  Tensor w_folded = Tensor::empty({rows, heads}, ScalarType::F32, x.device());
  cuda::dsa_quantize_queries(queries.raw(), cuda::DsaDType::BF16, head_weights.as<float>(), rows, int(heads),
                             q_fp8.as<uint8_t>(), w_folded.as<float>(), stream);
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
  const int k = int(options.topk);
  Tensor selected = Tensor::empty({rows, options.topk}, ScalarType::I32, x.device());
  const size_t workspace_bytes = cuda::topk_workspace_bytes(rows, step.max_visible, k);
  Tensor workspace = Tensor::empty({int64_t(std::max<size_t>(workspace_bytes, 1))}, ScalarType::U8, x.device());
  cuda::topk_rows(score_rows.as<float>(), ld, step.row_visible.as<int32_t>(), rows, step.max_visible, k,
                  selected.as<int32_t>(), workspace.raw(), workspace_bytes, stream);
  return selected;
#else
  fail("the DSA indexer on a GPU in a build without the CUDA backend");
#endif
}

}  // namespace sparrow
