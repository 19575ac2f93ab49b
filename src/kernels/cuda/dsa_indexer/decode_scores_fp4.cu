// Index scores over 4-bit keys (MXFP4, NVFP4) for every row count, on Hopper's wgmma tensor cores with the
// key operand in registers (PTX ISA, "wgmma.mma_async" with A from registers): the scores of
// decode_scores.cu's FP8 kernel,
//   score[t, s] = kfactor[s] * sum_h w[t, h] * relu(q8[t, h] · k[s]),
// as one m64 x n(heads x rows) x k128 product per tile of 64 keys: A = 64 keys x 128 (widened in registers,
// fp4_keys.cuh), B = the rows' queries (K-major in shared memory), D[key, head] in fp32 registers.
//   MXFP4: A in e4m3 (exact, relative to a power of two per key, kfactor = that power), B the e4m3 queries,
//          wgmma m64nNk32 e4m3, 4 steps;
//   NVFP4: A in f16 (exact e2m1 x e4m3 scale, kfactor = 1), B the e4m3 queries as f16 (exact), wgmma
//          m64nNk16 f16, 8 steps.
// fp4_keys.cuh says why each type (Hopper has no FP4 product).
//
// One CTA (one warpgroup) scores one query row, or two of one request (rows_per_sequence 2: speculative
// verification, and prefill, where consecutive rows share their sequence), over a range of its keys.
// Key tiles (64 keys: 4 KB of codes + 256 or 512 B of scales) are copied into shared memory by a cp.async
// pipeline kStages deep, in the page's own layout; each thread then reads its two keys' 16 code bytes and
// scales of the tile that has landed, widens them in registers (~100 integer instructions) while the
// next kStages - 1 tiles' copies are in flight, and issues the product. The widening never waits on a load.
//
// Which dims a thread holds (the K permutation). In the A fragment of m64nNk32 (8-bit) thread (warp w,
// lane 4g + q) holds keys 16w + g and 16w + g + 8, k = 4q .. 4q+3 (register a0/a1) and 16 + 4q .. (a2/a3)
// of each step; of m64nNk16 (16-bit) k = 2q, 2q+1 and 8 + 2q, 8 + 2q + 1 (CUTLASS cute ALayout_64x32,
// ALayout_64x16). A dot product is the same under any permutation of K applied to both operands, so a
// thread takes the 32 consecutive dims 32q .. 32q+31 of each of its keys (one 16-byte load: MXFP4 block q,
// NVFP4 blocks 2q and 2q+1, so a thread needs one or two scales of a key), and the queries are stored in
// shared memory permuted to match:
//   MXFP4: logical k = 32s + 16h + 4q + i   <-> dim 32q + 8s + 4h + i   (step s < 4, h, i < 4)
//   NVFP4: logical k = 16s + 8h + 2q + i    <-> dim 32q + 8(s/2) + 4(s%2) + 2h + i   (step s < 8, i < 2)
#include <cuda_fp16.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/dsa_indexer/decode_scores.cuh"
#include "kernels/cuda/dsa_indexer/fp4_keys.cuh"
#include "kernels/cuda/dsa_indexer/decode_rows.cuh"
#include "kernels/cuda/paged.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {

namespace {

using namespace ptx;  // smem_u32, cp_async16 / cp_async8 / cp_async4, commit, wait
using dsa::kFp4CodeBytes;

constexpr int kDim = kDsaIndexDim;
constexpr int kTileKeys = 64;  // wgmma M
constexpr int kThreads = 128;  // one warpgroup
constexpr int kStages = 6;     // 5 tiles (~22 KB) in flight per CTA while one is widened
static_assert(kThreads == 2 * kTileKeys, "two threads copy each key of a tile");

template <PageFormat F>
struct Layout {
  static constexpr bool kMx = F == PageFormat::Mxfp4Rows;
  static constexpr int kScaleBytes = dsa::fp4_scale_bytes(F);
  static constexpr int kCodeTileBytes = kTileKeys * kFp4CodeBytes;                // 4 KB
  static constexpr int kStageBytes = kCodeTileBytes + kTileKeys * kScaleBytes;  // 4352 / 4608
  // A query vector in shared memory: 128 e4m3 (one 128-byte swizzle row) or 128 f16 (two 64-dim slabs of
  // N rows each, slab j holding logical k 64j .. 64j+63).
  static constexpr int kQueryBytes = kMx ? kDim : 2 * kDim;
};

// [N query vectors][kStages x (64 x 64 code bytes, 64 x scale bytes)], plus 1 KB to align.
template <PageFormat F>
constexpr int smem_bytes(int n) {
  return n * Layout<F>::kQueryBytes + kStages * Layout<F>::kStageBytes + 1024;
}

// Byte offset of byte `b` of row n in a 128-byte swizzled K-major tile (16-byte chunk c of row n at
// n * 128 + ((c ^ (n % 8)) * 16)).
__device__ __forceinline__ int swizzled(int n, int b) { return n * 128 + (((b >> 4) ^ (n & 7)) << 4) + (b & 15); }

struct Fp4Params : IndexScoreArgs {
  int block_shift;       // log2(block_size) when it is a power of two, else -1
  int64_t keys_per_cta;  // a multiple of kTileKeys
};

// The page of key `key` and its slot (keys fit in 31 bits: row_visible is int32).
__device__ __forceinline__ void locate(const Fp4Params& p, uint32_t key, uint32_t& page, uint32_t& slot) {
  locate_key(key, p.block_size, p.block_shift, page, slot);
}

template <PageFormat F, int HEADS, int ROWS>
__global__ void __launch_bounds__(kThreads, HEADS * ROWS <= 64 ? 4 : 3) decode_scores_fp4_kernel(Fp4Params p) {
  using L = Layout<F>;
  constexpr int N = HEADS * ROWS;  // wgmma N: every head of every row
  constexpr int J = N / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* query = smem;
  uint8_t* stages = smem + N * L::kQueryBytes;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, q4 = lane % 4;
  const int64_t row0 = int64_t(blockIdx.y) * ROWS;
  const int64_t k_begin = int64_t(blockIdx.x) * p.keys_per_cta;
  const int64_t k_end = min(k_begin + p.keys_per_cta, p.max_visible);
  bool valid[ROWS];
  int seq[ROWS];
  int64_t visible[ROWS];
  dsa::load_rows(row0, p.rows, p.row_seq, p.row_visible, valid, seq, visible);

  // The queries of every valid row (zeros for an invalid one), permuted along K as the widened keys are
  // (top of this file) and swizzled. Each thread reads whole 16-byte chunks (dims 16c .. 16c+15 of a query
  // vector), all its loads before the first use, and stores each 4-byte group where its logical k lies.
  {
    constexpr int kChunks = N * 8 / kThreads;
    uint4 chunk[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = tid + i * kThreads, n = c / 8, r = n / HEADS;
      const uint8_t* src = p.q + ((row0 + r) * HEADS + n % HEADS) * kDim + (c % 8) * 16;
      chunk[i] = valid[r] ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = tid + i * kThreads, n = c / 8;
      const uint32_t words[4] = {chunk[i].x, chunk[i].y, chunk[i].z, chunk[i].w};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        if constexpr (L::kMx) {
          // Dims 4P .. 4P+3, P = 8q + 2s + h, are logical group G = 8s + 4h + q (k = 4G .. 4G+3).
          const int P = 4 * (c % 8) + wi;
          const int G = 8 * ((P % 8) / 2) + 4 * (P % 2) + P / 8;
          *reinterpret_cast<uint32_t*>(query + swizzled(n, 4 * G)) = words[wi];
        } else {
          // Dims 2P, 2P + 1, P = 16q + 4(s/2) + 2(s%2) + h, are logical pair Lp = 8s + 4h + q (k = 2Lp, 2Lp + 1),
          // in slab Lp / 32, widened to f16 (exact).
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int P = 8 * (c % 8) + 2 * wi + e, rem = P % 16;
            const int Lp = 8 * (2 * (rem / 4) + (rem / 2) % 2) + 4 * (rem % 2) + P / 16;
            *reinterpret_cast<uint32_t*>(query + (Lp / 32) * (N * 128) + swizzled(n, 4 * (Lp % 32))) =
                dsa::e4m3x2_to_f16x2(words[wi] >> (16 * e));
          }
        }
      }
    }
  }

  // This thread's head weights (D's columns 8j + 2(lane % 4) + {0, 1}).
  float w0[J], w1[J];
  dsa::head_weights<HEADS>(valid, p.w, row0, q4, w0, w1);

  // The two keys of the tile this thread widens (and whose scores it finishes): rows r_a, r_a + 8.
  const int r_a = 16 * warp + g;

#pragma unroll 1
  for (int pass = 0; pass < ROWS; ++pass) {
    bool active[ROWS];
    int64_t k_scored;  // keys at or past every active row's bound are -inf without reading them
    if (!dsa::begin_pass(pass, valid, seq, visible, k_begin, k_end, row0, p.scores, p.ld, tid, kThreads, active,
                         k_scored))
      continue;
    const int tiles_total = int((k_scored - k_begin + kTileKeys - 1) / kTileKeys);
    const int64_t* pages = p.page_table + int64_t(seq[pass]) * p.stride;

    // Tile `t` into stage t % kStages, in the page's layout: thread pair (2r, 2r + 1) copies key r's 64 code
    // bytes (32 each), the even thread also its scales, one page lookup per thread. Keys past k_scored are
    // zero-filled (never stored).
    auto load_tile = [&](int t) {
      if (t < tiles_total) {
        uint8_t* dst = stages + (t % kStages) * L::kStageBytes;
        const int r = tid / 2, half = tid % 2;
        const int64_t key = k_begin + int64_t(t) * kTileKeys + r;
        const bool ok = key < k_scored;
        uint32_t page, slot;
        locate(p, ok ? uint32_t(key) : 0u, page, slot);
        const uint8_t* base = p.pool + pages[page];
        const uint8_t* src = base + slot * kFp4CodeBytes + half * 32;
        cp_async16(dst + r * kFp4CodeBytes + half * 32, src, ok);
        cp_async16(dst + r * kFp4CodeBytes + half * 32 + 16, src + 16, ok);
        if (half == 0) {
          const uint8_t* ssrc = base + int64_t(p.block_size) * kFp4CodeBytes + slot * uint32_t(L::kScaleBytes);
          uint8_t* sdst = dst + L::kCodeTileBytes + r * L::kScaleBytes;
          if constexpr (L::kMx) cp_async4(sdst, ssrc, ok);
          else cp_async8(sdst, ssrc, ok);
        }
      }
      cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) load_tile(t);

#pragma unroll 1
    for (int t = 0; t < tiles_total; ++t) {
      cp_async_wait<kStages - 2>();  // tile t has landed for this thread's copies
      // The queries were written by plain stores (generic proxy); wgmma reads them through the async proxy.
      // The barrier also means every thread has finished reading tile t - 1's stage, which the next line
      // refills.
      wgmma::fence_proxy_async();
      __syncthreads();
      load_tile(t + kStages - 1);

      // Widen this thread's part of its two keys (dims 32 q4 .. 32 q4 + 31 of keys r_a, r_a + 8).
      const uint8_t* stage = stages + (t % kStages) * L::kStageBytes;
      const uint4 codes0 = *reinterpret_cast<const uint4*>(stage + r_a * kFp4CodeBytes + q4 * 16);
      const uint4 codes1 = *reinterpret_cast<const uint4*>(stage + (r_a + 8) * kFp4CodeBytes + q4 * 16);
      float acc[N / 2];
      float factor0 = 1.0f, factor1 = 1.0f;
      if constexpr (L::kMx) {
        const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(stage + L::kCodeTileBytes + r_a * 4);
        const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(stage + L::kCodeTileBytes + (r_a + 8) * 4);
        uint32_t k0[8], k1[8];  // word i: dims 32 q4 + 4i .. + 3 of each key
        dsa::mxfp4_widen_block(codes0, sc0, q4, k0, factor0);
        dsa::mxfp4_widen_block(codes1, sc1, q4, k1, factor1);
        ptx::wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          // Step s: logical k 32s + 4q4 + i <- dims 32 q4 + 8s + i (word 2s), 32s + 16 + 4q4 + i <- word 2s + 1.
          const uint32_t a[4] = {k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1]};
          wgmma::rs_e4m3<N>(acc, a, wgmma::sw128_descriptor(query + s * 32), s > 0);
        }
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 8; ++i) wgmma::keep(k0[i]), wgmma::keep(k1[i]);
      } else {
        const uint32_t sc0 = *reinterpret_cast<const uint16_t*>(stage + L::kCodeTileBytes + r_a * 8 + 2 * q4);
        const uint32_t sc1 = *reinterpret_cast<const uint16_t*>(stage + L::kCodeTileBytes + (r_a + 8) * 8 + 2 * q4);
        uint32_t k0[16], k1[16];  // word i: dims 32 q4 + 2i, + 1 of each key
        dsa::nvfp4_widen_block(codes0, sc0, k0);
        dsa::nvfp4_widen_block(codes1, sc1, k1);
        ptx::wgmma_fence();
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          // Step s: logical k 16s + 2q4 + i <- word 4(s/2) + 2(s%2), 16s + 8 + 2q4 + i <- the next word.
          const int i0 = 4 * (s / 2) + 2 * (s % 2);
          const uint32_t a[4] = {k0[i0], k1[i0], k0[i0 + 1], k1[i0 + 1]};
          wgmma::rs_f16<N>(acc, a, wgmma::sw128_descriptor(query + (s / 4) * (N * 128) + (s % 4) * 32), s > 0);
        }
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 16; ++i) wgmma::keep(k0[i]), wgmma::keep(k1[i]);
      }
      wgmma::keep(acc);

      // D layout (m64nN, fp32): acc[4j + 0/1] = key r_a, columns 8j + 2q4 + 0/1; acc[4j + 2/3] = key
      // r_a + 8, the same columns. Columns of row r are j in [r * HEADS / 8, (r + 1) * HEADS / 8).
      float s0[ROWS], s1[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) s0[r] = s1[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int r = (8 * j) / HEADS;
        s0[r] += w0[j] * fmaxf(acc[4 * j], 0.0f) + w1[j] * fmaxf(acc[4 * j + 1], 0.0f);
        s1[r] += w0[j] * fmaxf(acc[4 * j + 2], 0.0f) + w1[j] * fmaxf(acc[4 * j + 3], 0.0f);
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        s0[r] += __shfl_xor_sync(0xffffffffu, s0[r], 1);
        s0[r] += __shfl_xor_sync(0xffffffffu, s0[r], 2);
        s1[r] += __shfl_xor_sync(0xffffffffu, s1[r], 1);
        s1[r] += __shfl_xor_sync(0xffffffffu, s1[r], 2);
      }
      if (q4 < 2) {
        // Lane q4 = 0 stores key r_a, lane 1 key r_a + 8; the key's factor (MXFP4: its power of two; NaN
        // for a NaN block) multiplies after the relu, as an FP8 key's scale does.
        const int local = r_a + 8 * q4;
        const int64_t key = k_begin + int64_t(t) * kTileKeys + local;
        const float factor = q4 == 0 ? factor0 : factor1;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (!active[r] || key >= min(k_end, visible[r])) continue;
          const float v = q4 == 0 ? s0[r] : s1[r];
          p.scores[(row0 + r) * p.ld + key] = L::kMx ? v * factor : v;
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next pass refills every stage
  }
  cp_async_wait<0>();
}

template <PageFormat F>
void launch(const Fp4Params& params, int heads, int group, int64_t ctas_y, int sms, cudaStream_t stream) {
  using Kernel = void (*)(Fp4Params);
  static const Kernel kernels[4] = {decode_scores_fp4_kernel<F, 32, 1>, decode_scores_fp4_kernel<F, 64, 1>,
                                    decode_scores_fp4_kernel<F, 32, 2>, decode_scores_fp4_kernel<F, 64, 2>};
  const int variant = (heads == 64 ? 1 : 0) + 2 * (group - 1);
  const Kernel kernel = kernels[variant];
  const int smem = smem_bytes<F>(heads * group);
  static int resident[4] = {0, 0, 0, 0};  // CTAs per SM, per instantiation
  int& per_sm = resident[variant];
  if (per_sm == 0) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    per_sm = std::max(per_sm, 1);
  }
  // One wave (as decode_scores.cu): as many CTAs as fit at once, the keys of each row split evenly over
  // its CTAs, each reading at least 8 tiles so that its query load and pipeline fill are amortised.
  Fp4Params p = params;
  const int64_t slots = int64_t(sms) * per_sm;
  const int64_t splits_wanted = std::max<int64_t>(1, slots / ctas_y);
  int64_t per = (p.max_visible + splits_wanted - 1) / splits_wanted;
  per = std::max<int64_t>(per, 8 * kTileKeys);
  per = (per + kTileKeys - 1) / kTileKeys * kTileKeys;
  p.keys_per_cta = per;
  const int64_t splits = (p.max_visible + per - 1) / per;
  const dim3 grid{unsigned(splits), unsigned(ctas_y), 1u};
  kernel<<<grid, kThreads, smem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace

void dsa_decode_scores_fp4(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads,
                           const int32_t* row_seq, const int32_t* row_visible, const uint8_t* pool,
                           const int64_t* page_table, int64_t page_table_stride, int block_size,
                           PageFormat format, float* scores, int64_t ld, int64_t max_visible,
                           int rows_per_sequence, int sms, cudaStream_t stream) {
  SPARROW_CHECK(heads == 32 || heads == 64, "dsa_decode_scores: heads must be 32 or 64, got ", heads);
  SPARROW_CHECK(format == PageFormat::Mxfp4Rows || format == PageFormat::Nvfp4Rows,
                "dsa_decode_scores_fp4: keys must be mxfp4 or nvfp4");
  SPARROW_CHECK(rows_per_sequence >= 1, "dsa_decode_scores: rows_per_sequence must be >= 1");
  SPARROW_CHECK(max_visible < (int64_t(1) << 31), "dsa_decode_scores: max_visible ", max_visible, " too large");
  if (rows <= 0 || max_visible <= 0) return;
  const int group = rows_per_sequence == 2 ? 2 : 1;
  const int64_t ctas_y = (rows + group - 1) / group;
  SPARROW_CHECK(ctas_y < 65536, "dsa_decode_scores: too many rows (", rows, ")");
  const int shift = block_shift_of(block_size);
  const Fp4Params params{{q_fp8, w_folded, rows, row_seq, row_visible, pool, page_table, page_table_stride,
                          block_size, scores, ld, max_visible},
                         shift,
                         0};
  if (format == PageFormat::Mxfp4Rows) launch<PageFormat::Mxfp4Rows>(params, heads, group, ctas_y, sms, stream);
  else launch<PageFormat::Nvfp4Rows>(params, heads, group, ctas_y, sms, stream);
}

}  // namespace sparrow::cuda
