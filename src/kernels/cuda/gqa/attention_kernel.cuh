// The GQA attention kernel (gqa_attention.h): FlashAttention-2 style online softmax (Dao 2023,
// "FlashAttention-2", Alg. 1) over key tiles gathered from the paged cache, the key range optionally split
// across blocks and merged afterwards by log-sum-exp weights (flash-decoding), as the MLA kernels do.
//
// Block = one query row x one "unit" of up to 16 query heads that share a kv head (and, when sparse, an
// MSA index head, hence the same keys) x one split of the row's keys. The unit's heads are the m16 rows of
// mma.sync m16n8k16 (bf16 in, fp32 accumulate), so each K/V tile read from memory serves all of them:
// with MiniMax-M3's 16 query heads per kv head the tile is used 16 times for one read.
//
// The 4 warps of a block work independently (no block barrier in the main loop): warp w takes the key
// tiles w, w+4, w+8, ... of the block's range, each tile = 16 keys, and keeps its own running max / sum /
// output (fp32 registers). Per tile:
//   1. the warp's lanes look up the 16 keys' cached rows (the page table, and for MSA the row's kept
//      blocks staged in shared memory) one tile ahead, so that lookup latency overlaps the compute;
//   2. the K and V rows of the warp's kv head are copied with cp.async (16-byte copies, zero-filled for
//      keys the row may not see) into a 3-stage per-warp ring: two tiles in flight while one is computed;
//   3. narrow formats only (FP8, NVFP4): the ring holds the rows' raw bytes (1, or 1/2 + 1/16, byte a
//      value: a tile is 2x / 3.6x fewer bytes to read than bf16's), and once a tile has landed each lane
//      widens one row (a key's K or V) to bf16 in registers (kv_widen.cuh: integer ops and one bf16x2
//      multiply per pair, exact) into one bf16 tile of the bf16 path's layout, while the next two tiles'
//      raw bytes are still in flight. Steps 4-5 are then the same code for every format. (The widened
//      tile makes a round trip through shared memory, which costs about as much shared-memory bandwidth
//      per tile as the NVFP4 tile's HBM time at full rate; widening K straight into the mma B fragments
//      would halve that.)
//   4. S = Q K^T (16 heads x 16 keys, head_dim deep), masked, scaled into the log2 domain;
//   5. P = exp2(S - m) is rounded to bf16 and used directly as the A operand of O += P V (the C fragment
//      of two n8 tiles is the A fragment of one k16 step), no shared-memory round trip.
// At the end the 4 warps' states are merged in shared memory (log-sum-exp weights) and the block writes
// either the bf16 output or, when the keys are split, an fp32 partial and its log2-sum-exp to the
// workspace for gqa_combine_kernel.
//
// head_dim is bucketed at compile time (DMAX = 16, 32, 64, 128, 256): a head_dim below its bucket runs with
// zero padding columns in Q, K and V (they add nothing to q.k, and the padded output columns are dropped).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gqa/gqa_attention.h"
#include "kernels/cuda/gqa/kv_widen.cuh"
#include "kernels/cuda/ptx.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda::gqa_detail {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 3;        // per-warp K/V ring depth: two tiles in flight while one is computed
constexpr int kTileKeys = 16;     // keys per warp tile (the n of two m16n8k16 steps, the k of one)
constexpr float kLog2e = 1.4426950408889634f;

struct GqaParams {
  const __nv_bfloat16* q;      // [rows, heads, head_dim]
  __nv_bfloat16* out;          // [rows, heads, head_dim]
  const int32_t* row_seq;      // [rows]
  const int32_t* row_pos;      // [rows]: the last key a row sees
  const int32_t* row_first;    // dense: [rows], the first key a row sees (a sliding window), or null (0)
  const int32_t* blocks;       // sparse: [rows, index_heads, max_blocks]; dense: null
  const int64_t* page_table;   // [seqs, stride] byte offsets into pool
  const uint8_t* pool;         // the layer's K/V pages (gqa_attention.h)
  float* ws_o;                 // [splits, rows, heads, head_dim] (splits > 1)
  float* ws_lse;               // [splits, rows, heads], log2 domain
  int64_t rows;
  int64_t stride;
  int64_t row_bytes;           // a token's row of values in its page: 2 kv_heads head_dim x 2 (bf16), x 1
                               // (fp8), x 1/2 (nvfp4 codes)
  int64_t scale_base;          // nvfp4: bytes from a page's start to its block scales (block_size x row_bytes)
  int scale_row;               // nvfp4: bytes of a token's block scales (2 kv_heads head_dim / 16)
  int chunk;                   // bytes per cp.async of K/V values: 16, or 8 (nvfp4 with head_dim % 32 == 16)
  int heads, kv_heads, head_dim;
  int group;                   // query heads per kv head
  int unit;                    // query heads per unit (same kv head and index head)
  int unit_tiles;              // blocks per unit (16 heads each)
  int ctas_per_row;            // (heads / unit) * unit_tiles
  int index_heads, max_blocks, index_block, index_group;
  int block_size;
  int tiles_per_split;         // 16-key tiles per split
  int splits;
  float scale_log2;            // scale * log2(e)
};

// Bytes of one head's K (or V) values in a row of each format: bf16 2 a value, E4M3 1, E2M1 codes 1/2.
template <PageFormat F>
__host__ __device__ constexpr int value_bytes(int values) {
  return F == PageFormat::BFloat16 ? 2 * values : F == PageFormat::Fp8Rows ? values : values / 2;
}

template <int DMAX, PageFormat F>
struct Layout {
  static constexpr bool kNarrow = F != PageFormat::BFloat16;
  static constexpr int kStride = DMAX + 8;                     // bf16 per smem row (+16 B: no ldmatrix conflicts)
  static constexpr int kTile = kTileKeys * kStride;            // bf16 elements of one K (or V) tile
  static constexpr int kQBytes = 16 * kStride * 2;
  // Narrow formats: a stage of the ring holds 32 raw rows (row r = key r % 16, K for r < 16 else V), each
  // the head's codes padded by 16 bytes so that the 8 rows a quarter-warp reads with 16-byte loads fall on
  // 8 distinct bank groups; NVFP4 adds per row the 4-byte words around its head_dim / 16 block scales (an
  // odd count of words, so that 32 lanes reading word j of their rows hit 32 distinct banks).
  static constexpr int kRawRow = kNarrow ? (value_bytes<F>(DMAX) + 15) / 16 * 16 + 16 : 0;
  static constexpr int kScaleWords = F == PageFormat::Nvfp4Rows ? ((DMAX / 64 + 2) | 1) : 0;
  static constexpr int kScaleRow = 4 * kScaleWords;
  static constexpr int kRawStage = 2 * kTileKeys * (kRawRow + kScaleRow);
  // One warp's region: bf16: a ring of kStages (K, V) bf16 tiles; narrow: a ring of kStages raw stages and
  // one (K, V) bf16 tile the raw rows are widened into.
  static constexpr int kWarpKvBytes = kNarrow ? kStages * kRawStage + 2 * kTile * 2 : kStages * 2 * kTile * 2;
  static constexpr int kKvBytes = kWarps * kWarpKvBytes;
  static constexpr int kRedBytes = 2 * kWarps * 16 * 4;         // per-warp row max and sum
  static constexpr int kFixedBytes = kQBytes + kKvBytes + kRedBytes;
  static constexpr int kOStride = DMAX + 8;                    // fp32 per row of a warp's staged output
  static_assert(16 * kOStride * 4 <= kWarpKvBytes, "a warp's output must fit in its own K/V region");
  static_assert(kRawStage % 16 == 0 && kWarpKvBytes % 16 == 0, "regions must stay 16-byte aligned");
};

using namespace ptx;  // smem_u32, cp_async16 / cp_async8 (NVFP4 codes of heads whose 8-value groups are not
                      // 16-byte aligned) / commit / wait, ldmatrix_x4(_trans), mma_bf16

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Where a key's row lives: its values (bf16, E4M3 or E2M1 codes) and, for NVFP4, the first of this lane's
// head-row block scales (K scales for lanes 0-15, V scales for 16-31); row < 0: a key the row may not see.
struct KeyAddr {
  int64_t row;
  int64_t scale;
};

// Widens raw row `lane` of a stage (row = key lane % 16, K for lanes < 16 else V; `mis`: where its block
// scales start in their first word) into its bf16 tile row, columns 0 .. D-1 (the padding columns stay
// zero). 16-byte loads and stores; the raw and bf16 row strides put a quarter-warp's 8 rows on 8
// distinct bank groups. Every value is exact (kv_widen.cuh).
template <int DMAX, PageFormat F>
__device__ __forceinline__ void widen_row(const uint8_t* stage, __nv_bfloat16* tile, int lane, int D, uint32_t mis) {
  using L = Layout<DMAX, F>;
  const uint8_t* raw = stage + lane * L::kRawRow;
  __nv_bfloat16* dst = tile + (lane >> 4) * L::kTile + (lane & 15) * L::kStride;
  if constexpr (F == PageFormat::Fp8Rows) {
    // value = e4m3 * kKvTensorScale (1.0): 16 values per 16-byte load.
#pragma unroll
    for (int c = 0; c < DMAX / 16; ++c) {
      if (c < D / 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(raw + 16 * c);
        uint4 o0, o1;
        widen::e4m3x4_to_bf16(v.x, o0.x, o0.y);
        widen::e4m3x4_to_bf16(v.y, o0.z, o0.w);
        widen::e4m3x4_to_bf16(v.z, o1.x, o1.y);
        widen::e4m3x4_to_bf16(v.w, o1.z, o1.w);
        *reinterpret_cast<uint4*>(dst + 16 * c) = o0;
        *reinterpret_cast<uint4*>(dst + 16 * c + 8) = o1;
      }
    }
  } else if constexpr (F == PageFormat::Nvfp4Rows) {
    // value = e2m1 * e4m3 block scale * kKvTensorScale (1.0). Block b's scale is byte mis + b of the row's
    // scale window (byte loads: 32 lanes read 32 rows an odd number of words apart, 32 distinct banks).
    const uint8_t* sc = stage + 2 * kTileKeys * L::kRawRow + lane * L::kScaleRow + mis;
    // One block of 16 values (8 code bytes) -> two 16-byte bf16 stores.
    auto block = [&](uint32_t lo, uint32_t hi, int b) {
      const uint32_t s2 = widen::nvfp4_scale_bf16x2(sc[b]);
      uint32_t x[4], y[4];
      widen::e2m1x8_to_bf16(lo, x);
      widen::e2m1x8_to_bf16(hi, y);
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = widen::mul_bf16x2(x[k], s2), y[k] = widen::mul_bf16x2(y[k], s2);
      *reinterpret_cast<uint4*>(dst + 16 * b) = make_uint4(x[0], x[1], x[2], x[3]);
      *reinterpret_cast<uint4*>(dst + 16 * b + 8) = make_uint4(y[0], y[1], y[2], y[3]);
    };
    // Two blocks per 16-byte load; an odd last block (head_dim % 32 == 16) with an 8-byte load.
#pragma unroll
    for (int c = 0; c < DMAX / 32; ++c) {
      if (c < D / 32) {
        const uint4 v = *reinterpret_cast<const uint4*>(raw + 16 * c);
        block(v.x, v.y, 2 * c);
        block(v.z, v.w, 2 * c + 1);
      }
    }
    if ((D / 16) & 1) {
      const int b = D / 16 - 1;
      const uint2 v = *reinterpret_cast<const uint2*>(raw + 8 * b);
      block(v.x, v.y, b);
    }
  }
}

template <int DMAX, bool SPARSE, PageFormat F>
__global__ void __launch_bounds__(kThreads) gqa_attention_kernel(const GqaParams p) {
  using L = Layout<DMAX, F>;
  constexpr int kS = kStages;
  constexpr bool kNarrow = L::kNarrow;
  extern __shared__ __align__(128) uint8_t smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
  uint8_t* kv_s = smem + L::kQBytes;  // the 4 warps' K/V regions, kWarpKvBytes each
  float* red_m = reinterpret_cast<float*>(smem + L::kQBytes + L::kKvBytes);
  float* red_l = red_m + kWarps * 16;
  int32_t* blk_s = reinterpret_cast<int32_t*>(smem + L::kFixedBytes);  // sparse: the row's kept blocks
  __shared__ int blk_count;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;  // mma fragment row group / column pair
  const int64_t row = blockIdx.x / p.ctas_per_row;
  const int rem = int(blockIdx.x % p.ctas_per_row);
  const int unit = rem / p.unit_tiles, utile = rem % p.unit_tiles;
  const int h0 = unit * p.unit + utile * 16;
  const int nh = min(16, p.unit - utile * 16);
  const int kvh = h0 / p.group;
  const int split = blockIdx.y;
  const int seq = __ldg(p.row_seq + row);
  const int pos = __ldg(p.row_pos + row);
  const int first = SPARSE || !p.row_first ? 0 : __ldg(p.row_first + row);
  const int D = p.head_dim;
  const int cpr = D / 8;  // 16-byte chunks of a bf16 head row (Q, and the bf16 tiles)

  // Q tile: heads h0 .. h0+nh-1 of this row; padding rows and columns are zero-filled.
  for (int c = tid; c < 16 * (DMAX / 8); c += kThreads) {
    const int h = c / (DMAX / 8), ch = c % (DMAX / 8);
    const bool valid = h < nh && ch < cpr;
    const __nv_bfloat16* src = valid ? p.q + ((row * p.heads + h0 + h) * D + ch * 8) : p.q;
    cp_async16(q_s + h * L::kStride + ch * 8, src, valid);
  }
  cp_async_commit();
  // cp.async (bf16) and the widening (narrow formats) write K/V columns < D only: the padding columns up to
  // DMAX of every bf16 tile (bf16: the whole ring; narrow: the one tile pair) are zeroed once here.
  if (D < DMAX) {
    constexpr int kTileRows = (kNarrow ? 1 : kS) * 2 * kTileKeys;  // bf16 tile rows per warp
    const int pad = DMAX / 8 - cpr;
    for (int c = tid; c < kWarps * kTileRows * pad; c += kThreads) {
      const int w = c / (kTileRows * pad), r = c / pad % kTileRows, ch = cpr + c % pad;
      __nv_bfloat16* tiles =
          reinterpret_cast<__nv_bfloat16*>(kv_s + w * L::kWarpKvBytes + (kNarrow ? kS * L::kRawStage : 0));
      *reinterpret_cast<uint4*>(tiles + r * L::kStride + ch * 8) = make_uint4(0, 0, 0, 0);
    }
  }
  int nslots;
  if constexpr (SPARSE) {
    // Compact the row's kept block ids (dropping -1 padding and blocks wholly after the row) into smem.
    if (warp == 0) {
      const int gi = h0 / p.index_group;
      const int32_t* src = p.blocks + (row * p.index_heads + gi) * p.max_blocks;
      int count = 0;
      for (int base = 0; base < p.max_blocks; base += 32) {
        const int i = base + lane;
        const int32_t b = i < p.max_blocks ? __ldg(src + i) : -1;
        const bool keep = b >= 0 && int64_t(b) * p.index_block <= pos;
        const unsigned m = __ballot_sync(0xffffffffu, keep);
        if (keep) blk_s[count + __popc(m & ((1u << lane) - 1u))] = b;
        count += __popc(m);
      }
      if (lane == 0) blk_count = count;
    }
    __syncthreads();
    nslots = blk_count * p.index_block;  // slot i -> key blk_s[i / index_block] * index_block + i % index_block
  } else {
    nslots = pos + 1 - first;  // slot = key - first
  }
  // This block's slots; the last split takes everything left, so a too-small max_visible stays correct.
  const int per_split = p.tiles_per_split * kTileKeys;
  const int sb = split * per_split;
  const int se = split == p.splits - 1 ? nslots : min(nslots, sb + per_split);
  const int ntiles = se > sb ? (se - sb + kTileKeys - 1) / kTileKeys : 0;
  const int nt = ntiles > warp ? (ntiles - warp + kWarps - 1) / kWarps : 0;  // this warp's tiles

  // Where the row of key (lane & 15) of this warp's tile i lives (row -1 when invisible); for NVFP4 also
  // the first block scale of this lane's head row (K for lanes 0-15, V for 16-31).
  const int hb = value_bytes<F>(D);  // bytes of one head's K (or V) values in a row
  const int64_t head_scale = int64_t((lane >> 4) * p.kv_heads + kvh) * (D / 16);
  auto key_offset = [&](int i) -> KeyAddr {
    if (i >= nt) return {-1, 0};
    const int slot = sb + (warp + i * kWarps) * kTileKeys + (lane & 15);
    if (slot >= se) return {-1, 0};
    int key;
    if constexpr (SPARSE) {
      key = blk_s[slot / p.index_block] * p.index_block + slot % p.index_block;
    } else {
      key = first + slot;
    }
    if (key > pos) return {-1, 0};
    const int64_t page = __ldg(p.page_table + int64_t(seq) * p.stride + key / p.block_size);
    const int s = key % p.block_size;
    if constexpr (F == PageFormat::Nvfp4Rows)
      return {page + int64_t(s) * p.row_bytes, page + p.scale_base + int64_t(s) * p.scale_row + head_scale};
    else
      return {page + int64_t(s) * p.row_bytes, 0};
  };
  const uint8_t* k_base = p.pool + int64_t(kvh) * hb;
  const int64_t v_shift = int64_t(p.kv_heads) * hb;
  uint8_t* region = kv_s + warp * L::kWarpKvBytes;
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(region);                      // bf16: the tile ring
  __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(region + kS * L::kRawStage);  // narrow: the bf16 tile
  // Copies the K and V rows of tile i (addresses `a`, one per key in lanes 0..15 and again in 16..31); for
  // NVFP4 returns where this lane's block scales start in their first copied word.
  auto issue = [&](int i, const KeyAddr& a) -> uint32_t {
    if constexpr (!kNarrow) {
      __nv_bfloat16* kd = ring + (i % kS) * 2 * L::kTile;
      __nv_bfloat16* vd = kd + L::kTile;
      for (int c = lane; c < 32 * cpr; c += 32) {  // 16 keys x (K, V) x cpr chunks, chunks fastest
        const int key = c / (2 * cpr), r = c - key * 2 * cpr;
        const bool is_v = r >= cpr;
        const int ch = is_v ? r - cpr : r;
        const int64_t o = __shfl_sync(0xffffffffu, a.row, key);
        const uint8_t* src = k_base + (o >= 0 ? o : 0) + (is_v ? v_shift : 0) + ch * 16;
        cp_async16((is_v ? vd : kd) + key * L::kStride + ch * 8, src, o >= 0);
      }
      return 0u;
    } else {
      // Raw rows: row key (K) and 16 + key (V) of the stage, `chunk`-byte copies, chunks fastest.
      uint8_t* st = region + (i % kS) * L::kRawStage;
      const int cb = hb / p.chunk;
      for (int c = lane; c < 32 * cb; c += 32) {
        const int key = c / (2 * cb), r = c - key * 2 * cb;
        const bool is_v = r >= cb;
        const int ch = is_v ? r - cb : r;
        const int64_t o = __shfl_sync(0xffffffffu, a.row, key);
        const uint8_t* src = k_base + (o >= 0 ? o : 0) + (is_v ? v_shift : 0) + ch * p.chunk;
        uint8_t* dst = st + (key + (is_v ? kTileKeys : 0)) * L::kRawRow + ch * p.chunk;
        if (p.chunk == 16)
          cp_async16(dst, src, o >= 0);
        else
          cp_async8(dst, src, o >= 0);
      }
      if constexpr (F == PageFormat::Nvfp4Rows) {
        // This lane's head row's D / 16 scale bytes, as the aligned 4-byte words that hold them (at most
        // kScaleWords; never past the page's end, which is 4-byte aligned). An invisible key's window is
        // zero-filled: scale 0, so its zero codes widen to zeros, never NaN.
        const bool valid = a.row >= 0;
        const uint32_t mis = valid ? uint32_t(a.scale & 3) : 0u;
        const uint8_t* src = p.pool + (valid ? a.scale - mis : 0);
        uint8_t* dst = st + 2 * kTileKeys * L::kRawRow + lane * L::kScaleRow;
        const int words = (int(mis) + D / 16 + 3) / 4;
        for (int w = 0; w < words; ++w) cp_async4(dst + 4 * w, src + 4 * w, valid);
        return mis;
      } else {
        return 0u;
      }
    }
  };

  // Prologue: tiles 0 .. kS-2 in flight; validity masks queued 16 bits per tile (NVFP4: this lane's scale
  // misalignment, 2 bits per tile).
  uint64_t mask_q = 0;
  uint32_t mis_q = 0;
#pragma unroll
  for (int i = 0; i < kS - 1; ++i) {
    const KeyAddr a = key_offset(i);
    const uint32_t m = __ballot_sync(0xffffffffu, a.row >= 0) & 0xffffu;
    uint32_t mis = 0;
    if (i < nt) mis = issue(i, a);
    cp_async_commit();
    mask_q |= uint64_t(m) << (16 * i);
    mis_q |= mis << (2 * i);
  }
  KeyAddr pending = key_offset(kS - 1);
  cp_async_wait<kS - 1>();  // this thread's Q copies (the oldest group) have landed
  __syncthreads();          // everyone's Q copies and the zeroed padding are visible

  constexpr bool kQInRegs = DMAX <= 128;  // Q's A fragments stay in registers (DMAX/4 registers)
  uint32_t qf[kQInRegs ? DMAX / 16 : 1][4];
  const __nv_bfloat16* qa = q_s + (lane & 15) * L::kStride + (lane >> 4) * 8;
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < DMAX / 16; ++kk) ldmatrix_x4(qf[kk], qa + kk * 16);
  }

  float o[DMAX / 8][4];
#pragma unroll
  for (int i = 0; i < DMAX / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows g and g+8; l per lane (partial)

  for (int i = 0; i < nt; ++i) {
    // Refill the stage tile i-1 used (every lane finished reading it: __syncwarp at the loop end).
    {
      const uint32_t m = __ballot_sync(0xffffffffu, pending.row >= 0) & 0xffffu;
      uint32_t mis = 0;
      if (i + kS - 1 < nt) mis = issue(i + kS - 1, pending);
      cp_async_commit();
      mask_q |= uint64_t(m) << (16 * (kS - 1));
      mis_q |= mis << (2 * (kS - 1));
    }
    pending = key_offset(i + kS);  // in flight while tile i is computed
    cp_async_wait<kS - 1>();
    __syncwarp();
    const uint32_t mask = uint32_t(mask_q & 0xffffu);
    mask_q >>= 16;
    const uint32_t mis = mis_q & 3u;
    mis_q >>= 2;
    if (mask != 0) {
      const __nv_bfloat16* kt;
      if constexpr (kNarrow) {
        // Every lane widens one raw row of stage i % kS (a key's K or V) into the bf16 tile; the tile's
        // previous readers are done (__syncwarp at the end of the last iteration).
        widen_row<DMAX, F>(region + (i % kS) * L::kRawStage, tile, lane, D, mis);
        __syncwarp();
        kt = tile;
      } else {
        kt = ring + (i % kS) * 2 * L::kTile;
      }
      const __nv_bfloat16* vt = kt + L::kTile;
      // S = Q K^T: 16 heads x 16 keys.
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const __nv_bfloat16* kb = kt + ((lane & 7) + (lane >> 4) * 8) * L::kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < DMAX / 16; ++kk) {
        uint32_t b[4];
        ldmatrix_x4(b, kb + kk * 16);
        if constexpr (kQInRegs) {
          mma_bf16(s[0], qf[kk], b[0], b[1]);
          mma_bf16(s[1], qf[kk], b[2], b[3]);
        } else {
          uint32_t a[4];
          ldmatrix_x4(a, qa + kk * 16);
          mma_bf16(s[0], a, b[0], b[1]);
          mma_bf16(s[1], a, b[2], b[3]);
        }
      }
      // Mask the keys this row may not see, scale into the log2 domain, row maxima (rows g, g+8).
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n * 8 + cq * 2 + (e & 1);
          const float v = (mask >> key) & 1u ? s[n][e] * p.scale_log2 : -INFINITY;
          s[n][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: avoid (-inf) - (-inf)
        alpha[h] = exp2f(m_run[h] - m_use[h]);
        m_run[h] = m_new;
      }
      // P = exp2(S - m) in bf16, laid out as the A fragment of O += P V; l sums the rounded values.
      uint32_t pa[4];
      float psum[2] = {0.f, 0.f};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(exp2f(s[n][0] - m_use[0]), exp2f(s[n][1] - m_use[0]));
        const __nv_bfloat162 hi = __floats2bfloat162_rn(exp2f(s[n][2] - m_use[1]), exp2f(s[n][3] - m_use[1]));
        psum[0] += __low2float(lo) + __high2float(lo);
        psum[1] += __low2float(hi) + __high2float(hi);
        pa[2 * n] = bf162_bits(lo);      // row g,   keys n*8 + 2cq, +1
        pa[2 * n + 1] = bf162_bits(hi);  // row g+8, keys n*8 + 2cq, +1
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + psum[h];
#pragma unroll
      for (int j = 0; j < DMAX / 8; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
      // O += P V over all DMAX columns (V tile read transposed: keys are the k dimension).
      const __nv_bfloat16* vb = vt + ((lane & 7) + ((lane >> 3) & 1) * 8) * L::kStride + (lane >> 4) * 8;
#pragma unroll
      for (int dp = 0; dp < DMAX / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vb + dp * 16);
        mma_bf16(o[2 * dp], pa, b[0], b[1]);
        mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with stage i % kS before iteration i+1 refills it
  }
  cp_async_wait<0>();  // only empty groups can remain, but nothing may land after the ring is reused

  // Merge the 4 warps: each stages its unnormalised O (fp32) in its own ring, with its row max and sum.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if (cq == 0) {
    red_m[warp * 16 + g] = m_run[0];
    red_m[warp * 16 + g + 8] = m_run[1];
    red_l[warp * 16 + g] = l_run[0];
    red_l[warp * 16 + g + 8] = l_run[1];
  }
  __syncwarp();
  {
    float* os = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int j = 0; j < DMAX / 8; ++j) {
      const int col = j * 8 + cq * 2;
      *reinterpret_cast<float2*>(os + g * L::kOStride + col) = make_float2(o[j][0], o[j][1]);
      *reinterpret_cast<float2*>(os + (g + 8) * L::kOStride + col) = make_float2(o[j][2], o[j][3]);
    }
  }
  __syncthreads();
  for (int c = tid; c < 16 * cpr; c += kThreads) {
    const int r = c / cpr, ch = c % cpr;
    if (r >= nh) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red_m[w * 16 + r]);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = red_m[w * 16 + r];
      if (mw == -INFINITY) continue;  // that warp saw no key: it holds zeros
      const float wt = exp2f(mw - m);
      total += wt * red_l[w * 16 + r];
      const float* src = reinterpret_cast<const float*>(kv_s + w * L::kWarpKvBytes) + r * L::kOStride + ch * 8;
      const float4 a = *reinterpret_cast<const float4*>(src);
      const float4 b = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += wt * a.x;
      acc[1] += wt * a.y;
      acc[2] += wt * a.z;
      acc[3] += wt * a.w;
      acc[4] += wt * b.x;
      acc[5] += wt * b.y;
      acc[6] += wt * b.z;
      acc[7] += wt * b.w;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const int64_t rh = row * p.heads + h0 + r;
    if (p.splits == 1) {
      uint4 v;
      v.x = bf162_bits(__floats2bfloat162_rn(acc[0] * inv, acc[1] * inv));
      v.y = bf162_bits(__floats2bfloat162_rn(acc[2] * inv, acc[3] * inv));
      v.z = bf162_bits(__floats2bfloat162_rn(acc[4] * inv, acc[5] * inv));
      v.w = bf162_bits(__floats2bfloat162_rn(acc[6] * inv, acc[7] * inv));
      *reinterpret_cast<uint4*>(p.out + rh * D + ch * 8) = v;
    } else {
      const int64_t wrh = int64_t(split) * p.rows * p.heads + rh;
      float* dst = p.ws_o + wrh * D + ch * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (ch == 0) p.ws_lse[wrh] = total > 0.f ? m + log2f(total) : -INFINITY;
    }
  }
}

template <int DMAX, bool SPARSE, PageFormat F>
void launch_gqa_variant(const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y, cudaStream_t stream) {
  auto kernel = gqa_attention_kernel<DMAX, SPARSE, F>;
  SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<dim3(grid_x, grid_y), kThreads, smem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
}

template <bool SPARSE, PageFormat F>
void dispatch_head_dim(int dmax, const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y,
                       cudaStream_t stream) {
  switch (dmax) {
    case 16: return launch_gqa_variant<16, SPARSE, F>(p, smem, grid_x, grid_y, stream);
    case 32: return launch_gqa_variant<32, SPARSE, F>(p, smem, grid_x, grid_y, stream);
    case 64: return launch_gqa_variant<64, SPARSE, F>(p, smem, grid_x, grid_y, stream);
    case 128: return launch_gqa_variant<128, SPARSE, F>(p, smem, grid_x, grid_y, stream);
    default: return launch_gqa_variant<256, SPARSE, F>(p, smem, grid_x, grid_y, stream);
  }
}

// The kernel for a head_dim bucket (dmax) and K/V page format. dense.cu instantiates SPARSE = false and
// sparse.cu SPARSE = true, so that the two halves of the variants compile in parallel.
template <bool SPARSE>
void dispatch_gqa(int dmax, PageFormat format, const GqaParams& p, size_t smem, unsigned grid_x, unsigned grid_y,
                  cudaStream_t stream) {
  switch (format) {
    case PageFormat::BFloat16:
      return dispatch_head_dim<SPARSE, PageFormat::BFloat16>(dmax, p, smem, grid_x, grid_y, stream);
    case PageFormat::Fp8Rows: return dispatch_head_dim<SPARSE, PageFormat::Fp8Rows>(dmax, p, smem, grid_x, grid_y, stream);
    case PageFormat::Nvfp4Rows: return dispatch_head_dim<SPARSE, PageFormat::Nvfp4Rows>(dmax, p, smem, grid_x, grid_y, stream);
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
}
extern template void dispatch_gqa<false>(int, PageFormat, const GqaParams&, size_t, unsigned, unsigned,
                                         cudaStream_t);
extern template void dispatch_gqa<true>(int, PageFormat, const GqaParams&, size_t, unsigned, unsigned, cudaStream_t);

}  // namespace sparrow::cuda::gqa_detail
