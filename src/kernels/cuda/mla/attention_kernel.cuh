// The MLA attention kernel shared by the sparse (DSA top-k) and dense launchers (sparse_decode.cu,
// dense_decode.cu): FlashAttention-2 style online softmax (Dao 2023, "FlashAttention-2", Alg. 1) over
// key tiles gathered from the paged cache, with the key list optionally split across blocks and merged
// afterwards by log-sum-exp weights (flash-decoding).
//
// Block = one query row x a tile of 16*HG heads x one split of the key list. Warps: HG head groups of
// 16 heads (the m16 of mma.sync m16n8k16) x NSPLIT warps per group. For each tile of N = 16*NSPLIT keys:
//   1. the raw cache rows of the next tile are fetched with cp.async (16-byte copies, zero-filled for
//      unused slots) while this tile is computed (two stages);
//   2. rows of a quantised format (kFp8 656 B, kFp8Rows 576 B, kNvfp4 352 B) are dequantised in
//      registers into a padded bf16 tile (dequant_tile below: one mechanism, a body per format); bf16 rows
//      are copied straight into that layout;
//   3. warp (g, p) computes S = Q_g K^T for its 16 heads and the 16 keys p*16.. of the tile (576-deep);
//   4. the group's warps exchange row maxima and sums through shared memory, write P (bf16) to shared
//      memory, and each warp accumulates O[:, p*512/NSPLIT ..] += P V for its slice of the 512 latent
//      output columns (fp32 accumulators in registers).
// Hopper has no fp8 x bf16 (nor any FP4) MMA, so quantised latents are dequantised to bf16 in shared
// memory once per tile, shared by every head of the block (as FlashMLA does for its FP8 layout).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/ptx.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda::mla_detail {

constexpr int kQStride = kMlaRow + 8;     // bf16 elements per smem row: +16 B breaks ldmatrix bank conflicts
constexpr float kLog2e = 1.4426950408889634f;

struct AttnParams {
  const uint8_t* pool;
  const int64_t* page_offsets;
  int64_t pages_stride;
  int block_size;
  int block_shift;             // log2(block_size) when it is a power of two, else -1
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

template <int HG, int NSPLIT, PageFormat F>
struct Cfg {
  static constexpr int kWarps = HG * NSPLIT;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kHeads = 16 * HG;
  static constexpr int kN = 16 * NSPLIT;                     // keys per tile
  static constexpr int kCols = kMlaLatent / NSPLIT;          // output columns per warp
  static constexpr bool kQuantized = F != PageFormat::BFloat16;
  static constexpr int kRawRow = int(MlaRowBytes<F>::value);  // bytes of one cached row
  static_assert(kRawRow % 16 == 0, "rows are fetched with 16-byte copies");
  static constexpr int kChunks = kRawRow / 16;               // 16-byte copies per cached row
  static constexpr int kPStride = kN + 8;                    // bf16 elements per P row
  // Shared memory (bytes), in order: Q, KV tile(s), raw stages (quantised formats), P, reductions, row
  // offsets. Largest (hg = 1, kFp8): 18,688 + 74,752 + 83,968 + 2,304 + 512 + 1,536 = 181,760 of 232,448.
  static constexpr int kQBytes = kHeads * kQStride * 2;
  static constexpr int kKvTileBytes = kN * kQStride * 2;
  static constexpr int kKvBytes = kQuantized ? kKvTileBytes : 2 * kKvTileBytes;  // bf16: the two stages
  static constexpr int kRawBytes = kQuantized ? 2 * kN * kRawRow : 0;
  static constexpr int kPBytes = kHeads * kPStride * 2;
  static constexpr int kRedBytes = 2 * HG * NSPLIT * 16 * 4;
  static constexpr int kOffBytes = 3 * kN * 8;
  static constexpr int kSmem = kQBytes + kKvBytes + kRawBytes + kPBytes + kRedBytes + kOffBytes;
  static_assert(kSmem <= 227 * 1024, "over Hopper's 227 KB of shared memory per block");
};

using namespace ptx;  // smem_u32, cp_async16 / commit / wait, ldmatrix_x4(_trans), mma_bf16

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 bytes (low byte first) -> f16x2, exactly (cvt.rn.f16x2.e4m3x2: every e4m3 value is an f16).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// The same as two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t two) {
  const uint32_t h = e4m3x2_to_f16x2(two);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, __nv_bfloat162 b) {
  const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), b);
  return *reinterpret_cast<const uint32_t*>(&p);
}

// One 16-byte shared-memory store (a plain uint4 store of these values came out of nvcc 13.0 as four
// st.shared.u32). The "memory" clobber keeps it ordered with the tile's other accesses in the compiler.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(dst)), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Four e4m3 bytes (low byte first) -> two bf16x2 words, exactly: e4m3 -> f16 by the hardware conversion
// (cvt.rn.f16x2.e4m3x2), then f16 -> fp32 -> bf16 (every e4m3 value, subnormals included, is a bf16).
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const float2 a = e4m3x2_to_float2(uint16_t(w & 0xffff)), b = e4m3x2_to_float2(uint16_t(w >> 16));
  lo = pack_bf16(a.x, a.y);
  hi = pack_bf16(b.x, b.y);
}

// An e4m3 byte as a bf16 pair (s, s), exactly: an NVFP4 block scale, applied to two values at a time.
__device__ __forceinline__ __nv_bfloat162 e4m3_to_bf16x2(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __float2bfloat162_rn(__half2float(__half(h)));
}

// Eight E2M1 codes (one 32-bit word of the packed latent, element k in nibble k: byte i holds elements
// 2i | 2i+1 << 4) -> four bf16x2 words (elements 2k, 2k+1), unscaled and exact.
// Hopper has no FP4 conversion instruction (cvt ... e2m1x2 is sm_100+), and decoding value by value
// (quant::e2m1_decode: shifts, a select and an OR each) would cost more than the FP8 path NVFP4 must not
// be slower than. So the 3-bit magnitude code m (0, 0.5, 1, 1.5, 2, 3, 4, 6) indexes tables held in
// registers: the low and the high bytes of those 8 bf16 values are two 8-byte tables, and one PRMT looks
// up 4 values in one of them (its 4 selector nibbles are 4 magnitude codes; their msb, PRMT's
// sign-replicate flag, is masked off). One PRMT per 4 values moves the signs to the msb of each value's
// high byte (byte k of {w << 4, w} has element 2k's, resp. 2k+1's sign as its msb), and a last PRMT
// interleaves low and high bytes into bf16 pairs. Per 8 values: 1 AND, 2 shifts, 4 table PRMTs, 2 sign
// PRMTs, 2 LOP3 (sign | high byte), 4 interleave PRMTs = 15 integer ops, no conversions.
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t w, uint32_t (&out)[4]) {
  // bf16 bits of 0, 0.5, 1, 1.5 | 2, 3, 4, 6: 0000 3F00 3F80 3FC0 | 4000 4040 4080 40C0.
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;  // low bytes, code 0 in the lowest byte
  constexpr uint32_t kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;  // high bytes
  const uint32_t m = w & 0x77777777u;  // magnitude codes: selector msbs clear (copy, not sign-replicate)
  const uint32_t m_hi = m >> 16;       // prmt reads the low 4 nibbles: elements 4..7
  const uint32_t lo0 = prmt(kLo0, kLo1, m), hi0 = prmt(kHi0, kHi1, m);
  const uint32_t lo1 = prmt(kLo0, kLo1, m_hi), hi1 = prmt(kHi0, kHi1, m_hi);
  const uint32_t w4 = w << 4;  // byte i's msb: element 2i's sign (bit 8i+3 of w); w's byte i: element 2i+1's
  const uint32_t sign0 = prmt(w4, w, 0x5140u), sign1 = prmt(w4, w, 0x7362u);  // msb of byte k: element k's / 4+k's
  const uint32_t h0 = hi0 | (sign0 & 0x80808080u), h1 = hi1 | (sign1 & 0x80808080u);
  out[0] = prmt(lo0, h0, 0x5140u);  // [lo(e0), hi(e0), lo(e1), hi(e1)]
  out[1] = prmt(lo0, h0, 0x7362u);  // e2, e3
  out[2] = prmt(lo1, h1, 0x5140u);  // e4, e5
  out[3] = prmt(lo1, h1, 0x7362u);  // e6, e7
}

// Dequantises the N raw rows of a tile (raw, kRawRow bytes apart) into the bf16 tile kv (kQStride apart).
// The 512 latent values of a row are 32 units of 16, one a lane (T is a multiple of 32, so a warp covers
// one row); a unit's 16 bf16 outputs are two 16-byte stores, and lanes 4..7 of every 8 store their second
// half first, so that each quarter-warp's stores land on 8 distinct 16-byte bank groups (lane j's unit
// starts at 32j bytes: without the swap lanes j and j+4 would share banks). The rope part is 8 units of 8
// (kFp8Rows: all 576 values as 72 units of 8, one layout).
//
// Work per 16 latent values (instructions estimated from nvcc 13.0's PTX, addressing left out), all of it
// shared by every head of the block:
//   kFp8 (656 B)    16-B + 4-B load, 8 e4m3x2->f16x2 + 16 f16->f32 conversions, 16 FMUL, 8 bf16 packs,
//                   4 selects, 2 stores: ~55 instructions;
//   kNvfp4 (352 B)  8-B + 1-B load, 3 for the block scale (e4m3 -> bf16 pair), 30 integer ops
//                   (e2m1x8_to_bf16 twice), 8 bf16x2 multiplies (exact: 2-bit x 4-bit significands), 2
//                   selects, 2 stores: ~47 (the scale is applied once per 2 values, converted once per 16);
//   kFp8Rows (576 B) two 8-B loads, 8 + 16 conversions, 8 packs, 2 stores: ~36.
// So NVFP4 needs less dequantisation work than FP8's 656-byte layout and fetches 54% of its bytes
// (cp.async, HBM, raw shared-memory reads): it should not be slower than fp8 at any context; against
// fp8_per_tensor it trades ~30% more dequantisation for 39% fewer bytes (bench.cu measures both).
template <PageFormat F, int N, int T>
__device__ __forceinline__ void dequant_tile(const uint8_t* raw, __nv_bfloat16* kv, int tid) {
  static_assert(T % 32 == 0, "a warp must cover whole rows");
  constexpr int R = int(MlaRowBytes<F>::value);
  constexpr int kLatentUnits = N * 32 / T, kRopeUnits = N * 8 / T;  // per thread
  static_assert(N * 8 % T == 0, "whole units per thread");
  const int h = (tid >> 2) & 1;  // which half of its unit a lane stores first
  if constexpr (F == PageFormat::Fp8Latent) {
    // FlashMLA layout: [512 e4m3][4 fp32 scales][64 bf16 rope]; value = e4m3 * scale rounded once to bf16.
#pragma unroll 2
    for (int k = 0; k < kLatentUnits; ++k) {
      const int c = tid + k * T, r = c >> 5, j = c & 31;
      const uint8_t* src = raw + r * R;
      const uint4 v = *reinterpret_cast<const uint4*>(src + 16 * j);
      const float scale = *reinterpret_cast<const float*>(src + 512 + (j >> 3) * 4);
      __nv_bfloat16* dst = kv + r * kQStride + 16 * j;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool second = (half ^ h) != 0;
        const uint32_t w0 = second ? v.z : v.x, w1 = second ? v.w : v.y;
        uint4 o;
        {
          const float2 a = e4m3x2_to_float2(uint16_t(w0 & 0xffff)), b = e4m3x2_to_float2(uint16_t(w0 >> 16));
          const float2 c2 = e4m3x2_to_float2(uint16_t(w1 & 0xffff)), d = e4m3x2_to_float2(uint16_t(w1 >> 16));
          o.x = pack_bf16(a.x * scale, a.y * scale);
          o.y = pack_bf16(b.x * scale, b.y * scale);
          o.z = pack_bf16(c2.x * scale, c2.y * scale);
          o.w = pack_bf16(d.x * scale, d.y * scale);
        }
        store_bf16x8(dst + (second ? 8 : 0), o);
      }
    }
#pragma unroll
    for (int k = 0; k < kRopeUnits; ++k) {  // rope: bf16 already, 16-byte copies
      const int c = tid + k * T, r = c >> 3, j = c & 7;
      store_bf16x8(kv + r * kQStride + kMlaLatent + 8 * j, *reinterpret_cast<const uint4*>(raw + r * R + 528 + 16 * j));
    }
  } else if constexpr (F == PageFormat::Fp8Rows) {
    // 576 e4m3 (latent and rope alike, value = e4m3 * kMlaTensorScale = e4m3): 72 units of 8 a row. Raw
    // row r, unit j is at byte 8 * (72 r + j) = 8c; its bf16 at element r * kQStride + 8j = 8c + 8r.
    static_assert(kMlaTensorScale == 1.0f, "kFp8Rows reads e4m3 values unscaled");
    static_assert(N * 72 % T == 0, "whole units per thread");
#pragma unroll 4
    for (int k = 0; k < N * 72 / T; ++k) {
      const int c = tid + k * T, r = c / 72;
      const uint2 v = *reinterpret_cast<const uint2*>(raw + 8 * c);
      uint4 o;
      e4m3x4_to_bf16(v.x, o.x, o.y);
      e4m3x4_to_bf16(v.y, o.z, o.w);
      store_bf16x8(kv + 8 * c + 8 * r, o);
    }
  } else if constexpr (F == PageFormat::Nvfp4Latent) {
    // [256 B e2m1 codes | 64 B rope e4m3 | 32 B e4m3 block scales]; value = e2m1 * scale * kMlaTensorScale.
    static_assert(kMlaTensorScale == 1.0f, "kNvfp4 applies the block scales only");
#pragma unroll 2
    for (int k = 0; k < kLatentUnits; ++k) {
      const int c = tid + k * T, r = c >> 5, j = c & 31;  // unit j: values 16j .. 16j+15, one NVFP4 block
      const uint8_t* src = raw + r * R;
      const uint2 codes = *reinterpret_cast<const uint2*>(src + 8 * j);
      const __nv_bfloat162 scale = e4m3_to_bf16x2(src[256 + 64 + j]);
      __nv_bfloat16* dst = kv + r * kQStride + 16 * j;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool second = (half ^ h) != 0;
        uint32_t o[4];
        e2m1x8_to_bf16(second ? codes.y : codes.x, o);
        store_bf16x8(dst + (second ? 8 : 0), make_uint4(bf16x2_mul(o[0], scale), bf16x2_mul(o[1], scale),
                                                        bf16x2_mul(o[2], scale), bf16x2_mul(o[3], scale)));
      }
    }
#pragma unroll
    for (int k = 0; k < kRopeUnits; ++k) {  // rope: 64 e4m3, 8 a unit
      const int c = tid + k * T, r = c >> 3, j = c & 7;
      const uint2 v = *reinterpret_cast<const uint2*>(raw + r * R + 256 + 8 * j);
      uint4 o;
      e4m3x4_to_bf16(v.x, o.x, o.y);
      e4m3x4_to_bf16(v.y, o.z, o.w);
      store_bf16x8(kv + r * kQStride + kMlaLatent + 8 * j, o);
    }
  }
}

// The page of a token (>= 0): a shift where block_size is a power of two (the usual 64), since the
// producer loop issues this for every gathered row and a division is ~20 instructions.
__device__ __forceinline__ int page_of(const AttnParams& p, int token) {
  return p.block_shift >= 0 ? token >> p.block_shift : token / p.block_size;
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
  const int page = page_of(p, token);
  const int64_t base = __ldg(p.page_offsets + int64_t(seq) * p.pages_stride + page);
  return base + int64_t(token - page * p.block_size) * row_bytes;
}

template <int HG, int NSPLIT, PageFormat F, bool SPARSE>
__global__ void __launch_bounds__(Cfg<HG, NSPLIT, F>::kThreads, 1) mla_attention_kernel(const AttnParams p) {
  using C = Cfg<HG, NSPLIT, F>;
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
    uint8_t* dst = C::kQuantized ? raw_s + (tile & 1) * (N * C::kRawRow)
                                 : reinterpret_cast<uint8_t*>(kv_s) + (tile & 1) * C::kKvTileBytes;
    for (int c = tid; c < N * C::kChunks; c += C::kThreads) {
      const int r = c / C::kChunks, ch = c % C::kChunks;
      const int64_t off = o[r];
      const uint8_t* src = p.pool + (off >= 0 ? off : 0) + ch * 16;
      uint8_t* d = C::kQuantized ? dst + r * C::kRawRow + ch * 16 : dst + r * (kQStride * 2) + ch * 16;
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
    if constexpr (C::kQuantized) {
      dequant_tile<F, N, C::kThreads>(raw_s + (it & 1) * (N * C::kRawRow), kv_s, tid);
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
                          void* workspace, size_t workspace_bytes, cudaStream_t stream, bool wgmma);

// How launch_mla_attention tiles a problem.
struct AttnPlan {
  int hg = 1, nsplit = 4;     // head groups per block, warps per head group
  int head_tiles = 1;
  int tiles_per_split = 1, splits = 1;
  size_t workspace = 0;
};
AttnPlan plan_mla_attention(int64_t rows, int heads, int64_t max_keys);

template <int HG, int NSPLIT, PageFormat F, bool SPARSE>
void launch_variant(const AttnParams& p, cudaStream_t stream) {
  using C = Cfg<HG, NSPLIT, F>;
  auto kernel = mla_attention_kernel<HG, NSPLIT, F, SPARSE>;
  SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(unsigned(p.rows * p.head_tiles), unsigned(p.splits));
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
}

template <PageFormat F, bool SPARSE>
void dispatch_tiling(const AttnPlan& plan, const AttnParams& p, cudaStream_t stream) {
  if (plan.hg == 1) launch_variant<1, 4, F, SPARSE>(p, stream);
  else if (plan.hg == 2) launch_variant<2, 2, F, SPARSE>(p, stream);
  else launch_variant<4, 2, F, SPARSE>(p, stream);
}

// Instantiated in sparse_decode.cu (SPARSE = true) and dense_decode.cu (SPARSE = false).
template <bool SPARSE>
void dispatch_mla_attention(const AttnPlan& plan, PageFormat format, const AttnParams& p, cudaStream_t stream) {
  switch (format) {
    case PageFormat::Fp8Latent: return dispatch_tiling<PageFormat::Fp8Latent, SPARSE>(plan, p, stream);
    case PageFormat::BFloat16: return dispatch_tiling<PageFormat::BFloat16, SPARSE>(plan, p, stream);
    case PageFormat::Fp8Rows: return dispatch_tiling<PageFormat::Fp8Rows, SPARSE>(plan, p, stream);
    case PageFormat::Nvfp4Latent: return dispatch_tiling<PageFormat::Nvfp4Latent, SPARSE>(plan, p, stream);
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  fail("mla attention: unknown cache format ", int(format));
}
void dispatch_sparse(const AttnPlan& plan, PageFormat format, const AttnParams& p, cudaStream_t stream);
void dispatch_dense(const AttnPlan& plan, PageFormat format, const AttnParams& p, cudaStream_t stream);

}  // namespace sparrow::cuda::mla_detail
