// The MLA attention kernel shared by the sparse (DSA top-k) and dense launchers (sparse_decode.cu,
// dense_decode.cu): FlashAttention-2 style online softmax (Dao 2023, "FlashAttention-2", Alg. 1) over
// key tiles gathered from the paged cache, with the key list optionally split across blocks and merged
// afterwards by log-sum-exp weights (flash-decoding).
//
// Block = one query row x a tile of 16*HG heads x one split of the key list. Warps: HG head groups of
// 16 heads (the m16 of mma.sync m16n8k16) x NSPLIT warps per group. For each tile of N = 16*NSPLIT keys:
//   1. the raw cache rows of the next tile are fetched with cp.async (16-byte copies, zero-filled for
//      unused slots) while this tile is computed (two stages);
//   2. FP8 rows are dequantised (e4m3 * scale -> bf16) into a padded bf16 tile; bf16 rows are copied
//      straight into that layout;
//   3. warp (g, p) computes S = Q_g K^T for its 16 heads and the 16 keys p*16.. of the tile (576-deep);
//   4. the group's warps exchange row maxima and sums through shared memory, write P (bf16) to shared
//      memory, and each warp accumulates O[:, p*512/NSPLIT ..] += P V for its slice of the 512 latent
//      output columns (fp32 accumulators in registers).
// Hopper has no fp8 x bf16 MMA, so FP8 latents are dequantised to bf16 in shared memory (as FlashMLA does).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda::mla_detail {

constexpr int kQStride = kMlaRow + 8;     // bf16 elements per smem row: +16 B breaks ldmatrix bank conflicts
constexpr int kFp8RowBytes = 656;
constexpr int kBf16RowBytes = 1152;
constexpr float kLog2e = 1.4426950408889634f;

struct AttnParams {
  const uint8_t* pool;
  const int64_t* page_offsets;
  int64_t pages_stride;
  int block_size;
  const __nv_bfloat16* q;      // [rows, heads, 576]
  const int32_t* row_seq;      // [rows]
  const int32_t* indices;      // sparse: [rows, topk]; dense: null
  const int32_t* row_lens;     // dense: [rows]; sparse: null
  int topk;                    // sparse: slots per row
  int64_t rows;
  int heads;
  int head_tiles;
  float scale_log2;            // softmax_scale * log2(e)
  int tiles_per_split;
  int splits;
  __nv_bfloat16* out;          // [rows, heads, 512]
  float* lse;                  // [rows, heads] or null
  float* ws_o;                 // [splits, rows, heads, 512] (splits > 1)
  float* ws_lse;               // [splits, rows, heads]
};

template <int HG, int NSPLIT, bool FP8>
struct Cfg {
  static constexpr int kWarps = HG * NSPLIT;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kHeads = 16 * HG;
  static constexpr int kN = 16 * NSPLIT;                     // keys per tile
  static constexpr int kCols = kMlaLatent / NSPLIT;          // output columns per warp
  static constexpr int kRawRow = FP8 ? kFp8RowBytes : kBf16RowBytes;
  static constexpr int kChunks = kRawRow / 16;               // 16-byte copies per cached row
  static constexpr int kPStride = kN + 8;                    // bf16 elements per P row
  // Shared memory (bytes), in order: Q, KV tile(s), raw stages (fp8 only), P, reductions, row offsets.
  static constexpr int kQBytes = kHeads * kQStride * 2;
  static constexpr int kKvTileBytes = kN * kQStride * 2;
  static constexpr int kKvBytes = FP8 ? kKvTileBytes : 2 * kKvTileBytes;  // bf16: the two stages
  static constexpr int kRawBytes = FP8 ? 2 * kN * kFp8RowBytes : 0;
  static constexpr int kPBytes = kHeads * kPStride * 2;
  static constexpr int kRedBytes = 2 * HG * NSPLIT * 16 * 4;
  static constexpr int kOffBytes = 3 * kN * 8;
  static constexpr int kSmem = kQBytes + kKvBytes + kRawBytes + kPBytes + kRedBytes + kOffBytes;
};

using namespace ptx;  // smem_u32, cp_async16 / commit / wait, ldmatrix_x4(_trans), mma_bf16

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 bytes (low byte first) -> two floats, exactly (e4m3 values are all representable in fp16).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t two) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(*reinterpret_cast<__half2*>(&h));
}

// Token slot -> byte offset of its cached row in the pool, or -1 for an unused slot.
template <bool SPARSE>
__device__ __forceinline__ int64_t key_offset(const AttnParams& p, int64_t row, int seq, int slot, int len,
                                              int row_bytes) {
  int token;
  if constexpr (SPARSE) {
    token = slot < p.topk ? __ldg(p.indices + row * p.topk + slot) : -1;
  } else {
    token = slot < len ? slot : -1;
  }
  if (token < 0) return -1;
  const int64_t page = __ldg(p.page_offsets + int64_t(seq) * p.pages_stride + token / p.block_size);
  return page + int64_t(token % p.block_size) * row_bytes;
}

template <int HG, int NSPLIT, bool FP8, bool SPARSE>
__global__ void __launch_bounds__(Cfg<HG, NSPLIT, FP8>::kThreads, 1) mla_attention_kernel(const AttnParams p) {
  using C = Cfg<HG, NSPLIT, FP8>;
  constexpr int N = C::kN;
  extern __shared__ __align__(128) uint8_t smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(smem + C::kQBytes);
  uint8_t* raw_s = smem + C::kQBytes + C::kKvBytes;
  __nv_bfloat16* p_s = reinterpret_cast<__nv_bfloat16*>(smem + C::kQBytes + C::kKvBytes + C::kRawBytes);
  float* red_max = reinterpret_cast<float*>(smem + C::kQBytes + C::kKvBytes + C::kRawBytes + C::kPBytes);
  float* red_sum = red_max + HG * NSPLIT * 16;
  int64_t* offs = reinterpret_cast<int64_t*>(smem + C::kQBytes + C::kKvBytes + C::kRawBytes + C::kPBytes +
                                             C::kRedBytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = warp % HG, part = warp / HG;  // head group, key/column part
  const int64_t row = blockIdx.x / p.head_tiles;
  const int head0 = (blockIdx.x % p.head_tiles) * C::kHeads;
  const int split = blockIdx.y;
  const int seq = __ldg(p.row_seq + row);
  const int nslots = SPARSE ? p.topk : __ldg(p.row_lens + row);
  const int slot_begin = split * p.tiles_per_split * N;
  const int slot_end = min(nslots, slot_begin + p.tiles_per_split * N);
  const int ntiles = slot_end > slot_begin ? (slot_end - slot_begin + N - 1) / N : 0;

  // Q tile (heads beyond `heads` are zero and never written out).
  for (int c = tid; c < C::kHeads * (kMlaRow / 8); c += C::kThreads) {
    const int h = c / (kMlaRow / 8), ch = c % (kMlaRow / 8);
    const bool valid = head0 + h < p.heads;
    const __nv_bfloat16* src = p.q + (row * p.heads + (valid ? head0 + h : 0)) * kMlaRow + ch * 8;
    cp_async16(q_s + h * kQStride + ch * 8, src, valid);
  }
  auto compute_offsets = [&](int tile, int ring) {
    if (tid < N) {
      const int slot = slot_begin + tile * N + tid;
      offs[ring * N + tid] =
          slot < slot_end ? key_offset<SPARSE>(p, row, seq, slot, nslots, C::kRawRow) : int64_t(-1);
    }
  };
  auto issue_tile = [&](int tile) {
    const int64_t* o = offs + (tile % 3) * N;
    uint8_t* dst = FP8 ? raw_s + (tile & 1) * (N * kFp8RowBytes)
                       : reinterpret_cast<uint8_t*>(kv_s) + (tile & 1) * C::kKvTileBytes;
    for (int c = tid; c < N * C::kChunks; c += C::kThreads) {
      const int r = c / C::kChunks, ch = c % C::kChunks;
      const int64_t off = o[r];
      const uint8_t* src = p.pool + (off >= 0 ? off : 0) + ch * 16;
      uint8_t* d = FP8 ? dst + r * kFp8RowBytes + ch * 16 : dst + r * (kQStride * 2) + ch * 16;
      cp_async16(d, src, off >= 0);
    }
  };

  if (ntiles > 0) compute_offsets(0, 0);
  if (ntiles > 1) compute_offsets(1, 1);
  __syncthreads();
  if (ntiles > 0) issue_tile(0);
  cp_async_commit();

  constexpr int kOT = C::kCols / 8;  // n8 output tiles per warp
  float o[kOT][4];
#pragma unroll
  for (int i = 0; i < kOT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int g = lane >> 2, cq = lane & 3;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // tile `it` is in shared memory; every warp is done with tile it-1
    if (it + 1 < ntiles) issue_tile(it + 1);
    cp_async_commit();
    if (it + 2 < ntiles) compute_offsets(it + 2, (it + 2) % 3);
    const __nv_bfloat16* kv = kv_s;
    if constexpr (FP8) {
      const uint8_t* raw = raw_s + (it & 1) * (N * kFp8RowBytes);
      // 40 units per row: 32 x 16 latent bytes (-> 16 bf16), 8 x 16 rope bytes (copied).
      for (int u = tid; u < N * 40; u += C::kThreads) {
        const int r = u / 40, j = u % 40;
        const uint8_t* src = raw + r * kFp8RowBytes;
        __nv_bfloat16* dst = kv_s + r * kQStride;
        if (j < 32) {
          const uint4 v = *reinterpret_cast<const uint4*>(src + j * 16);
          const float scale = *reinterpret_cast<const float*>(src + 512 + (j >> 3) * 4);
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
          uint32_t outw[8];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float2 a = e4m3x2_to_float2(uint16_t(w[k] & 0xffff));
            const float2 b = e4m3x2_to_float2(uint16_t(w[k] >> 16));
            outw[2 * k] = pack_bf16(a.x * scale, a.y * scale);
            outw[2 * k + 1] = pack_bf16(b.x * scale, b.y * scale);
          }
          uint4* d = reinterpret_cast<uint4*>(dst + j * 16);
          d[0] = make_uint4(outw[0], outw[1], outw[2], outw[3]);
          d[1] = make_uint4(outw[4], outw[5], outw[6], outw[7]);
        } else {
          *reinterpret_cast<uint4*>(dst + kMlaLatent + (j - 32) * 8) =
              *reinterpret_cast<const uint4*>(src + 528 + (j - 32) * 16);
        }
      }
      __syncthreads();
    } else {
      kv = kv_s + (it & 1) * (N * kQStride);
    }
    const int64_t* toff = offs + (it % 3) * N;

    // S = Q_g K^T for 16 heads x keys [part*16, part*16+16).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const __nv_bfloat16* qa = q_s + (grp * 16 + (lane & 15)) * kQStride + (lane >> 4) * 8;
      const __nv_bfloat16* kb = kv + (part * 16 + (lane & 7) + (lane >> 4) * 8) * kQStride + ((lane >> 3) & 1) * 8;
#pragma unroll 4
      for (int kk = 0; kk < kMlaRow / 16; ++kk) {
        uint32_t a[4], b[4];
        ldmatrix_x4(a, qa + kk * 16);
        ldmatrix_x4(b, kb + kk * 16);
        mma_bf16(s[0], a, b[0], b[1]);
        mma_bf16(s[1], a, b[2], b[3]);
      }
    }
    // Scale into the log2 domain, mask unused slots, row maxima over this warp's 16 keys.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = part * 16 + nt * 8 + cq * 2 + (e & 1);
        const float v = toff[key] >= 0 ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    if (cq == 0) {
      red_max[(grp * NSPLIT + part) * 16 + g] = mx[0];
      red_max[(grp * NSPLIT + part) * 16 + g + 8] = mx[1];
    }
    __syncthreads();
    float m_use[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_new = m_run[h];
#pragma unroll
      for (int q2 = 0; q2 < NSPLIT; ++q2) m_new = fmaxf(m_new, red_max[(grp * NSPLIT + q2) * 16 + g + 8 * h]);
      m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with no valid key yet: avoid (-inf) - (-inf)
      alpha[h] = exp2f(m_run[h] - m_use[h]);
      m_run[h] = m_new;
    }
    float sum[2] = {0.f, 0.f};
    __nv_bfloat16* prow = p_s + (grp * 16 + g) * C::kPStride + part * 16 + cq * 2;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float p0 = exp2f(s[nt][0] - m_use[0]), p1 = exp2f(s[nt][1] - m_use[0]);
      const float p2 = exp2f(s[nt][2] - m_use[1]), p3 = exp2f(s[nt][3] - m_use[1]);
      const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1), hi = __floats2bfloat162_rn(p2, p3);
      // Sum the rounded probabilities, the ones P V actually uses.
      sum[0] += __low2float(lo) + __high2float(lo);
      sum[1] += __low2float(hi) + __high2float(hi);
      *reinterpret_cast<__nv_bfloat162*>(prow + nt * 8) = lo;
      *reinterpret_cast<__nv_bfloat162*>(prow + 8 * C::kPStride + nt * 8) = hi;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
    }
    if (cq == 0) {
      red_sum[(grp * NSPLIT + part) * 16 + g] = sum[0];
      red_sum[(grp * NSPLIT + part) * 16 + g + 8] = sum[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tot = 0.f;
#pragma unroll
      for (int q2 = 0; q2 < NSPLIT; ++q2) tot += red_sum[(grp * NSPLIT + q2) * 16 + g + 8 * h];
      l_run[h] = l_run[h] * alpha[h] + tot;
    }
#pragma unroll
    for (int i = 0; i < kOT; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }
    // O[:, cols] += P V[:, cols], cols = part * kCols ...
    {
      const __nv_bfloat16* pa = p_s + (grp * 16 + (lane & 15)) * C::kPStride + (lane >> 4) * 8;
      const __nv_bfloat16* vb = kv + ((lane & 7) + ((lane >> 3) & 1) * 8) * kQStride + part * C::kCols + (lane >> 4) * 8;
#pragma unroll
      for (int ks = 0; ks < N / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, pa + ks * 16);
#pragma unroll
        for (int dp = 0; dp < kOT / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vb + ks * 16 * kQStride + dp * 16);
          mma_bf16(o[2 * dp], a, b[0], b[1]);
          mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing may still be landing in shared memory when the block exits

  // Epilogue: normalise and write (bf16 directly, or fp32 partials for the combine kernel).
  float inv[2], lse_v[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    inv[h] = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;
    lse_v[h] = l_run[h] > 0.f ? (m_run[h] + log2f(l_run[h])) * 0.6931471805599453f : -INFINITY;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = head0 + grp * 16 + g + 8 * h;
    if (head >= p.heads) continue;
    const int64_t rh = row * p.heads + head;
    if (p.splits == 1) {
      __nv_bfloat16* dst = p.out + rh * kMlaLatent + part * C::kCols + cq * 2;
#pragma unroll
      for (int i = 0; i < kOT; ++i)
        *reinterpret_cast<__nv_bfloat162*>(dst + i * 8) =
            __floats2bfloat162_rn(o[i][2 * h] * inv[h], o[i][2 * h + 1] * inv[h]);
      if (p.lse && part == 0 && cq == 0) p.lse[rh] = lse_v[h];
    } else {
      const int64_t wrh = int64_t(split) * p.rows * p.heads + rh;
      float* dst = p.ws_o + wrh * kMlaLatent + part * C::kCols + cq * 2;
#pragma unroll
      for (int i = 0; i < kOT; ++i)
        *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * h] * inv[h], o[i][2 * h + 1] * inv[h]);
      if (part == 0 && cq == 0) p.ws_lse[wrh] = lse_v[h];
    }
  }
}

// Merges the splits of one (row, head): out = sum_i exp(lse_i - L) O_i, L = log sum_i exp(lse_i).
__global__ void __launch_bounds__(128) mla_combine_kernel(const float* ws_o, const float* ws_lse, int splits,
                                                          int64_t rows_heads, __nv_bfloat16* out, float* lse);

// Host side: picks the tile shape and the split, launches, combines. Defined in attention_launch.cu.
void launch_mla_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                          const int32_t* indices, const int32_t* row_lens, int64_t rows, int heads,
                          int64_t max_keys, int topk, float softmax_scale, uint16_t* out, float* lse,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream);

// How launch_mla_attention tiles a problem.
struct AttnPlan {
  int hg = 1, nsplit = 4;     // head groups per block, warps per head group
  int head_tiles = 1;
  int tiles_per_split = 1, splits = 1;
  size_t workspace = 0;
};
AttnPlan plan_mla_attention(int64_t rows, int heads, int64_t max_keys);

template <int HG, int NSPLIT, bool FP8, bool SPARSE>
void launch_variant(const AttnParams& p, cudaStream_t stream) {
  using C = Cfg<HG, NSPLIT, FP8>;
  auto kernel = mla_attention_kernel<HG, NSPLIT, FP8, SPARSE>;
  SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(unsigned(p.rows * p.head_tiles), unsigned(p.splits));
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// Instantiated in sparse_decode.cu (SPARSE = true) and dense_decode.cu (SPARSE = false).
template <bool SPARSE>
void dispatch_mla_attention(const AttnPlan& plan, bool fp8, const AttnParams& p, cudaStream_t stream) {
  if (plan.hg == 1) {
    fp8 ? launch_variant<1, 4, true, SPARSE>(p, stream) : launch_variant<1, 4, false, SPARSE>(p, stream);
  } else if (plan.hg == 2) {
    fp8 ? launch_variant<2, 2, true, SPARSE>(p, stream) : launch_variant<2, 2, false, SPARSE>(p, stream);
  } else {
    fp8 ? launch_variant<4, 2, true, SPARSE>(p, stream) : launch_variant<4, 2, false, SPARSE>(p, stream);
  }
}
void dispatch_sparse(const AttnPlan& plan, bool fp8, const AttnParams& p, cudaStream_t stream);
void dispatch_dense(const AttnPlan& plan, bool fp8, const AttnParams& p, cudaStream_t stream);

}  // namespace sparrow::cuda::mla_detail
