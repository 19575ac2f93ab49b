// Host side of the MLA attention kernel (attention_kernel.cuh): tiling choice, key split, combine kernel.
#include <algorithm>

#include "kernels/cuda/mla/attention_kernel.cuh"
#include "kernels/cuda/mla/wgmma_kernel.cuh"
#include "kernels/cuda/paged.cuh"
#include "core/batch_invariance.h"
#include "core/device/sm_count.h"

namespace sparrow::cuda::mla_detail {

__global__ void __launch_bounds__(128) mla_combine_kernel(const float* ws_o, const float* ws_lse, int splits,
                                                          int64_t rows_heads, __nv_bfloat16* out, float* lse) {
  const int64_t rh = blockIdx.x;
  float m = -INFINITY;
  for (int i = 0; i < splits; ++i) m = fmaxf(m, ws_lse[int64_t(i) * rows_heads + rh]);
  const int col = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.f;
  if (m != -INFINITY) {
    for (int i = 0; i < splits; ++i) {
      const float l = ws_lse[int64_t(i) * rows_heads + rh];
      if (l == -INFINITY) continue;  // a split with no valid key wrote zeros
      const float w = __expf(l - m);
      total += w;
      const float4 v = *reinterpret_cast<const float4*>(ws_o + (int64_t(i) * rows_heads + rh) * kMlaLatent + col);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + rh * kMlaLatent + col);
  dst[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  dst[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (lse && threadIdx.x == 0) lse[rh] = total > 0.f ? m + logf(total) : -INFINITY;
}

namespace {
// Both kernels' key split (flash-decoding): each row's `key_tiles` tiles go to as many CTAs as bring the
// grid (rows x plan.head_tiles x splits) to about `target_ctas`, evenly, and the combine kernel's
// workspace is sized for them. Batch-invariant mode (core/batch_invariance.h) never splits: where a split
// falls would depend on the step's rows, and the combine would then sum a row's parts differently.
void split_keys(AttnPlan& plan, int64_t rows, int heads, int64_t key_tiles, int64_t target_ctas) {
  const int64_t total_tiles = std::max<int64_t>(1, key_tiles);
  const int64_t base = rows * plan.head_tiles;
  int64_t splits = base >= target_ctas || batch_invariant() ? 1 : (target_ctas + base - 1) / base;
  splits = std::min(splits, total_tiles);
  const int64_t tps = (total_tiles + splits - 1) / splits;
  splits = (total_tiles + tps - 1) / tps;
  plan.tiles_per_split = int(tps);
  plan.splits = int(splits);
  plan.workspace = splits > 1 ? size_t(splits) * size_t(rows) * size_t(heads) * (kMlaLatent + 1) * sizeof(float) : 0;
}
}  // namespace

AttnPlan plan_mla_attention(int64_t rows, int heads, int64_t max_keys) {
  AttnPlan plan;
  // 16 heads per mma row tile; a 64-head block shares each gathered key tile among 4 head groups.
  if (heads <= 16) plan.hg = 1;
  else if (heads % 64 == 0) plan.hg = 4;
  else if (heads <= 32 || heads % 32 == 0) plan.hg = 2;
  else plan.hg = 4;
  plan.nsplit = plan.hg == 1 ? 4 : 2;
  plan.head_tiles = (heads + 16 * plan.hg - 1) / (16 * plan.hg);
  const int n = 16 * plan.nsplit;
  // One block per SM is resident (the tiles take most of shared memory): aim for about two waves, so
  // that decode with few rows still spreads its keys over every SM (flash-decoding).
  split_keys(plan, rows, heads, (max_keys + n - 1) / n, 2 * int64_t(sm_count()));
  return plan;
}

namespace wg {
AttnPlan plan_mla_wgmma(int64_t rows, int heads, int64_t max_keys) {
  AttnPlan plan;
  plan.head_tiles = (heads + kHeads - 1) / kHeads;
  // One CTA per SM (shared memory): split the keys until about one wave of CTAs runs, so that decode with
  // few rows still spreads its keys over every SM.
  split_keys(plan, rows, heads, (max_keys + kKeys - 1) / kKeys, int64_t(sm_count()));
  return plan;
}
}  // namespace wg

void launch_mla_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                          const int32_t* indices, const int32_t* row_lens, int64_t rows, int heads,
                          int64_t max_keys, int topk, float softmax_scale, uint16_t* out, float* lse,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream, bool wgmma) {
  SPARROW_CHECK(rows >= 0 && heads > 0 && max_keys >= 0, "mla attention: bad sizes rows=", rows,
                " heads=", heads, " keys=", max_keys);
  SPARROW_CHECK(max_keys < (int64_t(1) << 31), "mla attention: too many keys per row: ", max_keys);
  SPARROW_CHECK(cache.block_size > 0 && cache.pool && cache.page_offsets, "mla attention: cache not set");
  if (rows == 0) return;
  SPARROW_CHECK(q && row_seq && out, "mla attention: null q, row_seq or out");
  wgmma = wgmma && indices != nullptr;  // the warpgroup kernel is instantiated for sparse attention only
  const AttnPlan plan = wgmma ? wg::plan_mla_wgmma(rows, heads, max_keys) : plan_mla_attention(rows, heads, max_keys);
  SPARROW_CHECK(plan.workspace <= workspace_bytes && (plan.workspace == 0 || workspace),
                "mla attention: workspace of ", workspace_bytes, " bytes, needs ", plan.workspace,
                " (mla_attention_workspace_bytes)");
  SPARROW_CHECK(rows * plan.head_tiles < (int64_t(1) << 31) && plan.splits < 65536,
                "mla attention: grid too large");
  AttnParams p{};
  p.pool = cache.pool;
  p.page_offsets = cache.page_offsets;
  p.pages_stride = cache.pages_stride;
  p.block_size = cache.block_size;
  p.block_shift = block_shift_of(cache.block_size);
  p.q = reinterpret_cast<const __nv_bfloat16*>(q);
  p.row_seq = row_seq;
  p.indices = indices;
  p.row_lens = row_lens;
  p.topk = topk;
  p.rows = rows;
  p.heads = heads;
  p.head_tiles = plan.head_tiles;
  p.scale_log2 = softmax_scale * kLog2e;
  p.tiles_per_split = plan.tiles_per_split;
  p.splits = plan.splits;
  p.out = reinterpret_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  if (plan.splits > 1) {
    p.ws_o = static_cast<float*>(workspace);
    p.ws_lse = p.ws_o + size_t(plan.splits) * size_t(rows) * size_t(heads) * kMlaLatent;
  }
  if (wgmma) wg::dispatch_sparse_wgmma(cache.format, p, stream);
  else if (indices) dispatch_sparse(plan, cache.format, p, stream);
  else dispatch_dense(plan, cache.format, p, stream);
  if (plan.splits > 1) {
    mla_combine_kernel<<<unsigned(rows * heads), 128, 0, stream>>>(p.ws_o, p.ws_lse, plan.splits, rows * heads,
                                                                   p.out, lse);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparrow::cuda::mla_detail

namespace sparrow::cuda {

size_t mla_attention_workspace_bytes(int64_t rows, int heads, int64_t max_keys) {
  return std::max(mla_detail::plan_mla_attention(rows, heads, max_keys).workspace,
                  mla_detail::wg::plan_mla_wgmma(rows, heads, max_keys).workspace);
}

}  // namespace sparrow::cuda
