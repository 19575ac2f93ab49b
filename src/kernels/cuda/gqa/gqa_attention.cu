// Host side of GQA attention (gqa_attention.h): argument checks, the split of the keys across blocks, the
// log-sum-exp combine kernel, and the K/V cache write (bf16 copies, or FP8 / NVFP4 quantisation fused into
// the write). The attention kernel is attention_kernel.cuh.
#include <algorithm>
#include <cstdint>
#include <numeric>

#include "core/batch_invariance.h"
#include "kernels/cuda/gqa/attention_kernel.cuh"
#include "kernels/cuda/paged.cuh"
#include "kernels/cuda/quant/fp4.cuh"

namespace sparrow::cuda::gqa_detail {
namespace {

// Dividing by the per-layer scale (1.0) changes no value; the writer still does, as the CPU codec does.
constexpr float kTensorScale = kGqaKvTensorScale;
static_assert(kTensorScale == 1.0f, "the attention kernel reads narrow pages with a per-layer scale of 1.0");

// Merges the splits of one (row, head) for 16 of its columns (blockIdx.y picks which):
//   out = sum_i 2^(lse_i - M) O_i / sum_i 2^(lse_i - M),  lse in the log2 domain, M = max_i lse_i
// (a split that saw no key has lse -inf and holds zeros). Decode with few rows splits each row into
// hundreds of parts, so the 128 threads share the splits: thread = (split group of 32, 4-column chunk).
__global__ void __launch_bounds__(128) gqa_combine_kernel(const float* ws_o, const float* ws_lse, int splits,
                                                          int64_t rows_heads, int head_dim, __nv_bfloat16* out) {
  __shared__ float red[4][16];
  __shared__ float red_m[4], red_t[4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rh = blockIdx.x;
  const float* lse = ws_lse + rh;
  float m = -INFINITY;
  for (int i = tid; i < splits; i += 128) m = fmaxf(m, lse[int64_t(i) * rows_heads]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if (lane == 0) red_m[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red_m[0], red_m[1]), fmaxf(red_m[2], red_m[3]));
  float total = 0.f;
  if (m != -INFINITY)
    for (int i = tid; i < splits; i += 128) {
      const float l = lse[int64_t(i) * rows_heads];
      total += l == -INFINITY ? 0.f : exp2f(l - m);
    }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) total += __shfl_xor_sync(0xffffffffu, total, d);
  if (lane == 0) red_t[warp] = total;
  const int grp = tid >> 2, chunk = tid & 3;
  const int col = blockIdx.y * 16 + chunk * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (m != -INFINITY) {
#pragma unroll 4
    for (int i = grp; i < splits; i += 32) {
      const float l = lse[int64_t(i) * rows_heads];
      const float4 v = *reinterpret_cast<const float4*>(ws_o + (int64_t(i) * rows_heads + rh) * head_dim + col);
      const float w = l == -INFINITY ? 0.f : exp2f(l - m);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  // Sum over the 8 split groups of each warp (lane bits 2..4), then over the 4 warps.
#pragma unroll
  for (int d = 4; d < 32; d <<= 1) {
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, d);
    acc.y += __shfl_xor_sync(0xffffffffu, acc.y, d);
    acc.z += __shfl_xor_sync(0xffffffffu, acc.z, d);
    acc.w += __shfl_xor_sync(0xffffffffu, acc.w, d);
  }
  if (lane < 4) {
    red[warp][lane * 4 + 0] = acc.x;
    red[warp][lane * 4 + 1] = acc.y;
    red[warp][lane * 4 + 2] = acc.z;
    red[warp][lane * 4 + 3] = acc.w;
  }
  __syncthreads();
  if (tid < 4) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      v[j] = (red[0][tid * 4 + j] + red[1][tid * 4 + j]) + (red[2][tid * 4 + j] + red[3][tid * 4 + j]);
    total = (red_t[0] + red_t[1]) + (red_t[2] + red_t[3]);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + rh * head_dim + blockIdx.y * 16 + tid * 4);
    dst[0] = __floats2bfloat162_rn(v[0] * inv, v[1] * inv);
    dst[1] = __floats2bfloat162_rn(v[2] * inv, v[3] * inv);
  }
}

// One block per new token, writing its cached row [K heads | V heads] (gqa_attention.h):
//   BFloat16: 16-byte chunks copied;
//   Fp8:      one thread per 8 values: e4m3(x / kTensorScale), the CPU Fp8RowsCodec's rule (kernels/cpu/fp8_codec.h
//             through its device twin quant::e4m3_encode);
//   Nvfp4:    one thread per block of 16 values (a block never spans two heads nor K and V: head_dim % 16 ==
//             0): the CPU Fp4RowsCodec's nvfp4_quantize (kernels/cpu/fp4_codec.h) with global = kTensorScale, i.e.
//             amax over the block (NaNs ignored), E4M3 scale of amax / 6, codes e2m1(|x| / step) with the
//             sign, two a byte (value 2i in the low nibble), through the device twins in quant/fp4.cuh;
//             8 code bytes at the token's code row, 1 scale byte at its scale row (values then scales).
// `chunks`: 8-value groups of one token's K (or V); the row's values are [k row | v row].
template <PageFormat F>
__global__ void __launch_bounds__(128) gqa_write_kv_kernel(const uint4* k, const uint4* v, int chunks,
                                                           const int32_t* row_seq, const int32_t* row_pos,
                                                           const int64_t* page_table, int64_t stride,
                                                           int block_size, int64_t row_bytes, uint8_t* pool) {
  const int64_t i = blockIdx.x;
  const int seq = __ldg(row_seq + i), pos = __ldg(row_pos + i);
  const PagedSlot at = paged_slot(pool, page_table, stride, seq, pos, block_size);
  uint8_t* row = at.page + at.slot * row_bytes;
  auto chunk = [&](int c) { return c < chunks ? __ldg(k + i * chunks + c) : __ldg(v + i * chunks + (c - chunks)); };
  if constexpr (F == PageFormat::BFloat16) {
    for (int c = threadIdx.x; c < 2 * chunks; c += blockDim.x) reinterpret_cast<uint4*>(row)[c] = chunk(c);
  } else if constexpr (F == PageFormat::Fp8Rows) {
    for (int c = threadIdx.x; c < 2 * chunks; c += blockDim.x) {
      const uint4 x = chunk(c);
      const uint32_t in[4] = {x.x, x.y, x.z, x.w};
      uint32_t out[2] = {0u, 0u};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float f = __uint_as_float(((in[e / 2] >> (16 * (e % 2))) & 0xFFFFu) << 16);  // value e: low half first
        out[e / 4] |= uint32_t(quant::e4m3_encode(__fdiv_rn(f, kTensorScale))) << (8 * (e % 4));
      }
      reinterpret_cast<uint2*>(row)[c] = make_uint2(out[0], out[1]);
    }
  } else {
    // Scales of the page's tokens follow all their codes: block_size x row_bytes bytes in.
    uint8_t* scales = at.page + int64_t(block_size) * row_bytes + at.slot * (row_bytes / 8);
    for (int b = threadIdx.x; b < chunks; b += blockDim.x) {  // chunks = 16-value blocks of K + V here
      const uint4 x0 = chunk(2 * b), x1 = chunk(2 * b + 1);
      const uint32_t in[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      float f[16];
      float amax = 0.0f;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        f[e] = __uint_as_float(((in[e / 2] >> (16 * (e % 2))) & 0xFFFFu) << 16);
        amax = fmaxf(amax, fabsf(f[e]));  // fmaxf ignores NaN, as the CPU's std::fmax
      }
      const uint8_t scale = quant::nvfp4_scale(amax, kTensorScale);
      const float step = quant::nvfp4_step(scale, kTensorScale);
      uint32_t codes[2] = {0u, 0u};
#pragma unroll
      for (int e = 0; e < 16; ++e) codes[e / 8] |= quant::nvfp4_encode(f[e], step) << (4 * (e % 8));
      reinterpret_cast<uint2*>(row)[b] = make_uint2(codes[0], codes[1]);
      scales[b] = scale;
    }
  }
}

int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  SPARROW_CUDA_CHECK(cudaGetDevice(&device));
  SPARROW_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

int dmax_for(int head_dim) {
  for (int d : {16, 32, 64, 128}) if (head_dim <= d) return d;
  return 256;
}

template <PageFormat F>
size_t fixed_smem_of(int dmax) {
  switch (dmax) {
    case 16: return Layout<16, F>::kFixedBytes;
    case 32: return Layout<32, F>::kFixedBytes;
    case 64: return Layout<64, F>::kFixedBytes;
    case 128: return Layout<128, F>::kFixedBytes;
    default: return Layout<256, F>::kFixedBytes;
  }
}

size_t fixed_smem(int dmax, PageFormat format) {
  switch (format) {
    case PageFormat::BFloat16: return fixed_smem_of<PageFormat::BFloat16>(dmax);
    case PageFormat::Fp8Rows: return fixed_smem_of<PageFormat::Fp8Rows>(dmax);
    case PageFormat::Nvfp4Rows: return fixed_smem_of<PageFormat::Nvfp4Rows>(dmax);
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  fail("gqa attention: unknown K/V format ", int(format));
}

void check_format(PageFormat format, const char* what) {
  SPARROW_CHECK(gqa_reads_kv_format(format), what, ": K/V pages in a format it does not read (", int(format), ")");
}

// How gqa_attention tiles a problem.
struct Plan {
  int dmax = 16;
  int unit = 1, unit_tiles = 1, ctas_per_row = 1;
  int tiles_per_split = 1, splits = 1;
  size_t smem = 0;
  size_t workspace = 0;
};

Plan make_plan(int64_t rows, int heads, int kv_heads, int head_dim, int64_t max_visible, bool sparse, int index_heads,
               int max_blocks, int index_block_size, PageFormat format) {
  check_format(format, "gqa attention");
  SPARROW_CHECK(rows >= 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "gqa attention: bad heads ", heads,
                " / kv heads ", kv_heads, " (rows ", rows, ")");
  SPARROW_CHECK(gqa_takes_head_dim(head_dim),
                "gqa attention: head_dim must be a multiple of 16 in [16, 256], got ", head_dim);
  SPARROW_CHECK(max_visible >= 0 && max_visible < (int64_t(1) << 31), "gqa attention: bad max_visible ", max_visible);
  Plan plan;
  const int group = heads / kv_heads;
  plan.unit = group;
  if (sparse) {
    SPARROW_CHECK(index_heads > 0 && heads % index_heads == 0, "gqa attention: bad index heads ", index_heads,
                  " for ", heads, " heads");
    SPARROW_CHECK(max_blocks > 0 && index_block_size > 0 && int64_t(max_blocks) * index_block_size < (int64_t(1) << 31),
                  "gqa attention: bad block selection shape ", max_blocks, " x ", index_block_size);
    // Heads in one block must share the kv head (same K/V) and the index head (same kept blocks): runs of
    // gcd(group, index group) consecutive heads do, whatever the two groupings are.
    plan.unit = std::gcd(group, heads / index_heads);
  }
  plan.unit_tiles = (plan.unit + 15) / 16;
  plan.ctas_per_row = (heads / plan.unit) * plan.unit_tiles;
  plan.dmax = dmax_for(head_dim);
  plan.smem = fixed_smem(plan.dmax, format) + (sparse ? (size_t(max_blocks) * 4 + 15) / 16 * 16 : 0);
  // Dynamic shared memory, leaving room for the kernel's few static bytes.
  const size_t smem_limit = size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)) - 1024;
  SPARROW_CHECK(plan.smem <= smem_limit, "gqa attention: ", plan.smem, " bytes of shared memory needed, ", smem_limit,
                " available (max_blocks ", max_blocks, ")");

  // Keys (slots) per row, at most: the dense prefix, or the kept blocks (no more than the row can see).
  int64_t slots = max_visible;
  if (sparse)
    slots = std::min<int64_t>(max_blocks, (max_visible + index_block_size - 1) / index_block_size) * index_block_size;
  const int64_t total_tiles = std::max<int64_t>(1, (slots + kTileKeys - 1) / kTileKeys);
  // Enough blocks for about two waves (flash-decoding: a few long rows still use every SM), but at least
  // two tiles per warp in each split so the ring and the combine pay off. Batch-invariant mode
  // (core/batch_invariance.h) never splits: where a split falls would depend on the step's rows.
  const int64_t per_sm = std::clamp<int64_t>(
      int64_t(device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor)) / int64_t(plan.smem + 1024), 1, 8);
  const int64_t target = 2 * per_sm * device_attribute(cudaDevAttrMultiProcessorCount);
  const int64_t base = std::max<int64_t>(1, rows * plan.ctas_per_row);
  int64_t splits = base >= target || batch_invariant() ? 1 : (target + base - 1) / base;
  splits = std::clamp<int64_t>(std::min(splits, total_tiles / (2 * kWarps)), 1, 65535);
  const int64_t tps = (total_tiles + splits - 1) / splits;
  splits = (total_tiles + tps - 1) / tps;
  plan.tiles_per_split = int(tps);
  plan.splits = int(splits);
  plan.workspace =
      splits > 1 ? size_t(splits) * size_t(rows) * size_t(heads) * size_t(head_dim + 1) * sizeof(float) : 0;
  return plan;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace
}  // namespace sparrow::cuda::gqa_detail

namespace sparrow::cuda {

void gqa_write_kv(const void* k_bf16, const void* v_bf16, int64_t rows, int kv_heads, int head_dim,
                  const int32_t* row_seq, const int32_t* row_pos, const int64_t* page_table, int64_t stride,
                  int block_size, uint8_t* pool, PageFormat format, cudaStream_t stream) {
  gqa_detail::check_format(format, "gqa_write_kv");
  SPARROW_CHECK(rows >= 0 && kv_heads > 0 && head_dim > 0 && head_dim % 8 == 0, "gqa_write_kv: bad sizes rows=", rows,
                " kv_heads=", kv_heads, " head_dim=", head_dim);
  SPARROW_CHECK(format != PageFormat::Nvfp4Rows || head_dim % 16 == 0,
                "gqa_write_kv: NVFP4 K/V need head_dim a multiple of 16 (a block scale per 16 values of a head), got ",
                head_dim);
  SPARROW_CHECK(rows < (int64_t(1) << 31), "gqa_write_kv: too many rows ", rows);
  SPARROW_CHECK(block_size > 0 && pool && page_table, "gqa_write_kv: cache not set");
  if (rows == 0) return;
  SPARROW_CHECK(k_bf16 && v_bf16 && row_seq && row_pos, "gqa_write_kv: null k, v, row_seq or row_pos");
  SPARROW_CHECK(gqa_detail::aligned16(k_bf16) && gqa_detail::aligned16(v_bf16) && gqa_detail::aligned16(pool),
                "gqa_write_kv: k, v and pool must be 16-byte aligned");
  const int chunks = kv_heads * head_dim / 8;  // 16-byte chunks of one token's K (or V)
  const int64_t values = int64_t(2) * kv_heads * head_dim;  // of a token's row
  const auto* k = static_cast<const uint4*>(k_bf16);
  const auto* v = static_cast<const uint4*>(v_bf16);
  using gqa_detail::gqa_write_kv_kernel;
  switch (format) {
    case PageFormat::BFloat16:
      gqa_write_kv_kernel<PageFormat::BFloat16><<<unsigned(rows), 128, 0, stream>>>(
          k, v, chunks, row_seq, row_pos, page_table, stride, block_size, 2 * values, pool);
      break;
    case PageFormat::Fp8Rows:
      gqa_write_kv_kernel<PageFormat::Fp8Rows><<<unsigned(rows), 128, 0, stream>>>(
          k, v, chunks, row_seq, row_pos, page_table, stride, block_size, values, pool);
      break;
    case PageFormat::Nvfp4Rows:  // the kernel's `chunks` counts 16-value blocks of the whole row
      gqa_write_kv_kernel<PageFormat::Nvfp4Rows><<<unsigned(rows), 128, 0, stream>>>(
          k, v, chunks, row_seq, row_pos, page_table, stride, block_size, values / 2, pool);
      break;
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

size_t gqa_attention_workspace_bytes(int64_t rows, int heads, int kv_heads, int head_dim, int64_t max_visible,
                                     int index_heads, int max_blocks, int index_block_size, PageFormat format) {
  return gqa_detail::make_plan(rows, heads, kv_heads, head_dim, max_visible, max_blocks > 0, index_heads, max_blocks,
                               index_block_size, format)
      .workspace;
}

void gqa_attention(const void* q_bf16, void* out_bf16, int64_t rows, int heads, int kv_heads, int head_dim,
                   float scale, const int32_t* row_seq, const int32_t* row_pos, int64_t max_visible,
                   const int32_t* blocks, int index_heads, int max_blocks, int index_block_size,
                   const int64_t* page_table, int64_t stride, int block_size, const uint8_t* pool,
                   PageFormat format, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   const int32_t* row_first) {
  using namespace gqa_detail;
  const bool sparse = blocks != nullptr;
  SPARROW_CHECK(!sparse || !row_first, "gqa attention: a first key per row (sliding window) with MSA blocks");
  const Plan plan = make_plan(rows, heads, kv_heads, head_dim, max_visible, sparse, index_heads, max_blocks,
                              index_block_size, format);
  if (rows == 0) return;
  SPARROW_CHECK(block_size > 0 && pool && page_table, "gqa attention: cache not set");
  SPARROW_CHECK(q_bf16 && out_bf16 && row_seq && row_pos, "gqa attention: null q, out, row_seq or row_pos");
  SPARROW_CHECK(aligned16(q_bf16) && aligned16(out_bf16) && aligned16(pool),
                "gqa attention: q, out and pool must be 16-byte aligned");
  SPARROW_CHECK(plan.workspace <= workspace_bytes && (plan.workspace == 0 || (workspace && aligned16(workspace))),
                "gqa attention: workspace of ", workspace_bytes, " bytes, needs ", plan.workspace,
                " (gqa_attention_workspace_bytes), 16-byte aligned");
  const int64_t grid_x = rows * plan.ctas_per_row;
  SPARROW_CHECK(grid_x < (int64_t(1) << 31) && rows * heads < (int64_t(1) << 31), "gqa attention: grid too large (",
                rows, " rows)");

  GqaParams p{};
  p.q = static_cast<const __nv_bfloat16*>(q_bf16);
  p.out = static_cast<__nv_bfloat16*>(out_bf16);
  p.row_seq = row_seq;
  p.row_pos = row_pos;
  p.row_first = row_first;
  p.blocks = blocks;
  p.page_table = page_table;
  p.pool = pool;
  p.rows = rows;
  p.stride = stride;
  const int64_t values = int64_t(2) * kv_heads * head_dim;  // of a token's row
  p.row_bytes = format == PageFormat::BFloat16 ? 2 * values : format == PageFormat::Fp8Rows ? values : values / 2;
  p.scale_base = int64_t(block_size) * p.row_bytes;  // NVFP4: the page's scales follow all its codes
  p.scale_row = int(values / 16);
  // NVFP4 codes of one head are head_dim / 2 bytes at a multiple of head_dim / 2: 16-byte copies need
  // head_dim % 32 == 0, else 8-byte ones (head_dim % 16 == 0 always holds here).
  p.chunk = format == PageFormat::Nvfp4Rows && head_dim % 32 != 0 ? 8 : 16;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.group = heads / kv_heads;
  p.unit = plan.unit;
  p.unit_tiles = plan.unit_tiles;
  p.ctas_per_row = plan.ctas_per_row;
  p.index_heads = sparse ? index_heads : 0;
  p.max_blocks = sparse ? max_blocks : 0;
  p.index_block = sparse ? index_block_size : 1;
  p.index_group = sparse ? heads / index_heads : heads;
  p.block_size = block_size;
  p.tiles_per_split = plan.tiles_per_split;
  p.splits = plan.splits;
  p.scale_log2 = scale * kLog2e;
  if (plan.splits > 1) {
    p.ws_o = static_cast<float*>(workspace);
    p.ws_lse = p.ws_o + size_t(plan.splits) * size_t(rows) * size_t(heads) * size_t(head_dim);
  }
  (sparse ? dispatch_gqa<true> : dispatch_gqa<false>)(plan.dmax, format, p, plan.smem, unsigned(grid_x),
                                                       unsigned(plan.splits), stream);
  if (plan.splits > 1) {
    const int64_t rows_heads = rows * heads;
    gqa_combine_kernel<<<dim3(unsigned(rows_heads), unsigned(head_dim / 16)), 128, 0, stream>>>(
        p.ws_o, p.ws_lse, plan.splits, rows_heads, head_dim, p.out);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparrow::cuda
