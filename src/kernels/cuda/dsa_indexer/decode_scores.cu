// Index scores for decode-sized batches on Hopper's FP8 tensor cores (wgmma, PTX ISA "Asynchronous
// warpgroup level matrix multiply-accumulate"): the same scores as index_scores.cu's tiled kernel,
//   score[t, s] = kscale[s] * sum_h w[t, h] * relu(q8[t, h] · k8[s]),
// computed as one m64 x n(heads) x k128 product per tile of 64 keys:
//   A = 64 keys x 128 e4m3 (K-major, from the paged cache), B = heads x 128 e4m3 (the row's query, K-major),
//   D[key, head] in fp32 registers; each thread then owns two keys' partial head sums.
// Hopper has no FP8 mma.sync (the tiled kernel's e4m3 mma.sync is emulated through f16), so only wgmma
// reads FP8 at full rate.
//
// One CTA (one warpgroup of 128 threads) scores one query row over a range of its keys. Tiles are copied
// into shared memory with cp.async in the 128-byte swizzled layout wgmma reads (16-byte chunk c of row r
// at r * 128 + ((c ^ (r % 8)) * 16), 1024-byte aligned), two tiles in flight while one is multiplied and
// five CTAs an SM, so the kernel is bound by the 132 bytes per key it reads from HBM (91-98% of it at
// 128K-1M keys, batch 64-128: bench/results/kernels.md). What got it there is few instructions a tile: the
// kernel was issue-bound at 58-66% while each thread found each key's page with a 64-bit division; now a
// tile's 64 keys come from one page (block sizes that are multiples of 64) whose offset is read a tile ahead,
// keys are 32-bit, and one barrier a tile suffices.
//
// This file holds the FP8-key kernel; MXFP4 and NVFP4 keys (68 and 72 bytes a key) have their own kernel in
// decode_scores_fp4.cu (keys widened in registers, A from registers), which dsa_decode_scores dispatches to.
#include "kernels/cuda/dsa_indexer/decode_scores.cuh"

#include <algorithm>

#include "kernels/cuda/dsa_indexer/decode_rows.cuh"
#include "kernels/cuda/paged.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {

namespace {

constexpr int kDim = kDsaIndexDim;     // 128 e4m3 values = one 128-byte swizzle row
constexpr int kTileKeys = 64;          // wgmma M
constexpr int kThreads = 128;          // one warpgroup
constexpr int kStages = 4;             // 2 tiles in flight while one is multiplied (5 and 6 measured alike)
constexpr int kTileBytes = kTileKeys * kDim;  // 8 KB
// A CTA reads at least this many tiles: more, smaller CTAs cut short contexts' latency (8K-32K keys at batch 1:
// 0.72-0.83x the time of 8 tiles) and change nothing from 128K keys or batch 8 up.
constexpr int kMinTilesPerCta = 2;

// Shared memory: [N query vectors of 128 B][kStages x key tile 8 KB][kStages x 64 key scales], plus 1 KB
// to align.
constexpr int smem_bytes(int n) { return n * kDim + kStages * (kTileBytes + kTileKeys * 4) + 1024; }

using namespace ptx;  // smem_u32, cp_async16 / cp_async4 (zero-filled when !valid), commit, wait

struct DecodeParams : IndexScoreArgs {
  int64_t keys_per_cta;  // a multiple of kTileKeys
  int block_shift;       // log2(block_size) when it is a power of two, else -1
};

// Where tile t's keys lie. With TILE_IN_PAGE (block_size a multiple of 64; k_begin and the tile size are
// multiples of 64), a tile is 64 consecutive rows of one page: one page-table read a tile, read a tile
// ahead of its copies so the copies never wait on it. Otherwise each key finds its own page.
__device__ __forceinline__ void locate(const DecodeParams& p, uint32_t key, uint32_t& page, uint32_t& slot) {
  locate_key(key, p.block_size, p.block_shift, page, slot);
}

// ROWS consecutive query rows share a CTA when they are one request's tokens (speculative verification
// scores 2): B then holds ROWS x HEADS query vectors and each key tile is read once for all of them. Rows
// of different sequences in one CTA are scored one sequence after the other (a pass per sequence).
template <int HEADS, int ROWS, bool TILE_IN_PAGE>
__global__ void __launch_bounds__(kThreads) decode_scores_kernel(DecodeParams p) {
  constexpr int N = HEADS * ROWS;  // wgmma N: every head of every row
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* query = smem;
  uint8_t* tiles = smem + N * kDim;
  float* scales = reinterpret_cast<float*>(tiles + kStages * kTileBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t row0 = int64_t(blockIdx.y) * ROWS;
  const int64_t k_begin = int64_t(blockIdx.x) * p.keys_per_cta;
  const int64_t k_end = min(k_begin + p.keys_per_cta, p.max_visible);
  bool valid[ROWS];
  int seq[ROWS];
  int64_t visible[ROWS];
  dsa::load_rows(row0, p.rows, p.row_seq, p.row_visible, valid, seq, visible);

  // The queries of every valid row, swizzled: N rows of 8 chunks (an invalid row's are zero).
  for (int c = tid; c < N * 8; c += kThreads) {
    const int n = c / 8, chunk = c % 8, r = n / HEADS;
    const uint8_t* src = p.q + ((row0 + r) * HEADS + n % HEADS) * kDim + chunk * 16;
    cp_async16(query + n * kDim + ((chunk ^ (n % 8)) * 16), valid[r] ? src : p.q, valid[r]);
  }
  cp_async_commit();

  // This thread's head weights (D's columns 8j + 2(lane % 4) + {0, 1}).
  constexpr int J = N / 8;
  float w0[J], w1[J];
  dsa::head_weights<HEADS>(valid, p.w, row0, lane % 4, w0, w1);

  const int g = lane / 4;
#pragma unroll 1
  for (int pass = 0; pass < ROWS; ++pass) {
    bool active[ROWS];
    int64_t k_scored;  // keys at or past every active row's bound are -inf without reading them
    if (!dsa::begin_pass(pass, valid, seq, visible, k_begin, k_end, row0, p.scores, p.ld, tid, kThreads, active,
                         k_scored))
      continue;
    const int tiles_total = int((k_scored - k_begin + kTileKeys - 1) / kTileKeys);
    const int64_t* pages = p.page_table + int64_t(seq[pass]) * p.stride;
    const uint32_t first_key = uint32_t(k_begin);  // keys fit in 31 bits (the launcher checks)

    // TILE_IN_PAGE: the pool offset of tile t's page (read a tile ahead of the tile's copies).
    auto page_of_tile = [&](int t) -> int64_t {
      if (!TILE_IN_PAGE || t >= tiles_total) return 0;
      uint32_t page, slot;
      locate(p, first_key + uint32_t(t) * kTileKeys, page, slot);
      return __ldg(pages + page);
    };
    // Tile `t` into stage t % kStages: chunk i of the 512 (key i / 8, 16-byte chunk i % 8), and the 64 key
    // scales. Keys past k_scored are zero-filled; with TILE_IN_PAGE their scales are copied anyway (they
    // lie in the same page, after its block_size key rows, and are never used).
    auto load_tile = [&](int t, int64_t page_offset) {
      if (t < tiles_total) {
        uint8_t* dst = tiles + (t % kStages) * kTileBytes;
        float* dst_scales = scales + (t % kStages) * kTileKeys;
        const uint32_t first = first_key + uint32_t(t) * kTileKeys;
        if constexpr (TILE_IN_PAGE) {
          uint32_t page, slot0;
          locate(p, first, page, slot0);
          const uint8_t* keys = p.pool + page_offset + slot0 * kDim;
#pragma unroll
          for (int i = 0; i < kTileKeys * 8 / kThreads; ++i) {
            const int c = tid + i * kThreads, r = c / 8, chunk = c % 8;
            cp_async16(dst + r * kDim + ((chunk ^ (r % 8)) * 16), keys + r * kDim + chunk * 16, first + r < k_scored);
          }
          if (tid < kTileKeys / 4)
            cp_async16(dst_scales + 4 * tid, p.pool + page_offset + int64_t(p.block_size) * kDim + (slot0 + 4 * tid) * 4,
                       true);
        } else {
#pragma unroll
          for (int i = 0; i < kTileKeys * 8 / kThreads; ++i) {
            const int c = tid + i * kThreads, r = c / 8, chunk = c % 8;
            const bool ok = first + r < k_scored;
            uint32_t page, slot;
            locate(p, ok ? first + r : 0u, page, slot);
            cp_async16(dst + r * kDim + ((chunk ^ (r % 8)) * 16), p.pool + pages[page] + slot * kDim + chunk * 16,
                       ok);
          }
          if (tid < kTileKeys) {
            const bool ok = first + tid < k_scored;
            uint32_t page, slot;
            locate(p, ok ? first + tid : 0u, page, slot);
            cp_async4(dst_scales + tid, p.pool + pages[page] + int64_t(p.block_size) * kDim + slot * 4, ok);
          }
        }
      }
      cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

    // The pass's weights: an inactive row's columns count for nothing.
    float pw0[J], pw1[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const bool on = active[(8 * j) / HEADS];
      pw0[j] = on ? w0[j] : 0.0f;
      pw1[j] = on ? w1[j] : 0.0f;
    }

    int64_t next_page = page_of_tile(kStages - 2);
#pragma unroll
    for (int t = 0; t < kStages - 2; ++t) load_tile(t, page_of_tile(t));

#pragma unroll 1
    for (int t = 0; t < tiles_total; ++t) {
      // Tile t + kStages - 2 goes out before the wait, so kStages - 2 tiles are in flight while this one is
      // multiplied; its stage was tile t - 2's, which every thread finished before the last barrier.
      load_tile(t + kStages - 2, next_page);
      next_page = page_of_tile(t + kStages - 1);
      cp_async_wait<kStages - 2>();  // tile t (and the queries) have landed for this thread's copies
      // cp.async writes are generic-proxy writes; wgmma reads through the async proxy. The barrier also
      // means every thread is done with tile t - 1, whose stage the next iteration's load refills.
      wgmma::fence_proxy_async();
      __syncthreads();

      const uint8_t* keys = tiles + (t % kStages) * kTileBytes;
      float acc[N / 2];
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDim / 32; ++kk)
        wgmma::ss_e4m3<N>(acc, wgmma::sw128_descriptor(keys + kk * 32), wgmma::sw128_descriptor(query + kk * 32),
                          kk > 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();

      // D layout (m64nNk32, fp32): acc[4j + 0/1] = key 16 * warp + g, columns 8j + 2(lane % 4) + 0/1;
      // acc[4j + 2/3] = key 16 * warp + g + 8, the same columns. Columns of row r are j in
      // [r * HEADS / 8, (r + 1) * HEADS / 8).
      float s0[ROWS], s1[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) s0[r] = s1[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int r = (8 * j) / HEADS;
        s0[r] += pw0[j] * fmaxf(acc[4 * j], 0.0f) + pw1[j] * fmaxf(acc[4 * j + 1], 0.0f);
        s1[r] += pw0[j] * fmaxf(acc[4 * j + 2], 0.0f) + pw1[j] * fmaxf(acc[4 * j + 3], 0.0f);
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        s0[r] += __shfl_xor_sync(0xffffffffu, s0[r], 1);
        s0[r] += __shfl_xor_sync(0xffffffffu, s0[r], 2);
        s1[r] += __shfl_xor_sync(0xffffffffu, s1[r], 1);
        s1[r] += __shfl_xor_sync(0xffffffffu, s1[r], 2);
      }
      if (lane % 4 < 2) {
        const int local = 16 * warp + g + 8 * (lane % 4);
        const int64_t key = k_begin + int64_t(t) * kTileKeys + local;
        const float scale = scales[(t % kStages) * kTileKeys + local];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (!active[r] || key >= min(k_end, visible[r])) continue;
          p.scores[(row0 + r) * p.ld + key] = (lane % 4 == 0 ? s0[r] : s1[r]) * scale;
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next pass refills every stage
  }
  cp_async_wait<0>();
}

}  // namespace

bool dsa_decode_scores_supported(int heads) { return heads == 32 || heads == 64; }

void dsa_decode_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads, const int32_t* row_seq,
                       const int32_t* row_visible, const uint8_t* pool, const int64_t* page_table,
                       int64_t page_table_stride, int block_size, PageFormat format, float* scores, int64_t ld,
                       int64_t max_visible, int rows_per_sequence, int sms, cudaStream_t stream) {
  if (format != PageFormat::Fp8IndexKey) {
    dsa_decode_scores_fp4(q_fp8, w_folded, rows, heads, row_seq, row_visible, pool, page_table, page_table_stride,
                          block_size, format, scores, ld, max_visible, rows_per_sequence, sms, stream);
    return;
  }
  SPARROW_CHECK(dsa_decode_scores_supported(heads), "dsa_decode_scores: heads must be 32 or 64, got ", heads);
  SPARROW_CHECK(rows_per_sequence >= 1, "dsa_decode_scores: rows_per_sequence must be >= 1");
  SPARROW_CHECK(max_visible < (int64_t(1) << 31), "dsa_decode_scores: max_visible ", max_visible, " too large");
  if (rows <= 0 || max_visible <= 0) return;
  // Two rows per CTA when requests bring two tokens each (speculative verification): they share every
  // key tile. The kernel checks the pairing itself (a pair of two sequences runs as two passes).
  const int group = rows_per_sequence == 2 ? 2 : 1;
  const int64_t ctas_y = (rows + group - 1) / group;
  SPARROW_CHECK(ctas_y < 65536, "dsa_decode_scores: too many rows (", rows, ")");
  // A tile lies in one page when block_size is a multiple of the tile (the split points are multiples of it).
  const bool tile_in_page = block_size % kTileKeys == 0;
  const int variant = (heads == 64 ? 1 : 0) + 2 * (group - 1) + (tile_in_page ? 4 : 0);
  using Kernel = void (*)(DecodeParams);
  static const Kernel kernels[8] = {
      decode_scores_kernel<32, 1, false>, decode_scores_kernel<64, 1, false>, decode_scores_kernel<32, 2, false>,
      decode_scores_kernel<64, 2, false>, decode_scores_kernel<32, 1, true>,  decode_scores_kernel<64, 1, true>,
      decode_scores_kernel<32, 2, true>,  decode_scores_kernel<64, 2, true>};
  const Kernel kernel = kernels[variant];
  const int smem = smem_bytes(heads * group);
  static int resident[8] = {};  // CTAs per SM, per instantiation
  int& per_sm = resident[variant];
  if (per_sm == 0) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    per_sm = std::max(per_sm, 1);
  }
  // One wave: as many CTAs as fit on the chip at once (a second, partly filled wave would leave SMs
  // idle at the end: 2 waves of 1024 CTAs over 660 slots run at ~78%), the keys of each row split
  // evenly over its CTAs, each reading at least kMinTilesPerCta tiles.
  const int64_t slots = int64_t(sms) * per_sm;
  const int64_t splits_wanted = std::max<int64_t>(1, slots / ctas_y);
  int64_t per = (max_visible + splits_wanted - 1) / splits_wanted;
  per = std::max<int64_t>(per, kMinTilesPerCta * kTileKeys);
  per = (per + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int64_t splits = (max_visible + per - 1) / per;
  const int shift = block_shift_of(block_size);
  DecodeParams params{{q_fp8, w_folded, rows, row_seq, row_visible, pool, page_table, page_table_stride, block_size,
                       scores, ld, max_visible},
                      per, shift};
  const dim3 grid{unsigned(splits), unsigned(ctas_y), 1u};
  kernel<<<grid, kThreads, smem, stream>>>(params);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
