// MLA attention on Hopper's warpgroup MMA (wgmma, PTX ISA "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate"), the kernel mla_sparse_attention runs from 33 heads up (mla_sparse_kernel_for): the
// same online softmax and split-KV merge as attention_kernel.cuh (FlashAttention-2, Dao 2023, Alg. 1;
// flash-decoding), with
//   - one CTA per (query row, 64 heads, split of the key list), tiles of 64 keys;
//   - a producer warpgroup (2) that gathers the selected cache rows, dequantises them in registers (the
//     format bodies below: FP8 656 B, FP8 576 B, NVFP4 352 B; bf16 rows are copied with cp.async) and
//     writes them into a double-buffered tile in the 128-byte swizzled layout wgmma reads (the latent
//     columns as f16 for the FP8 formats, bf16 otherwise: latent_f16); so gathering and dequantisation
//     overlap the products instead of running on the warps that do them;
//   - warpgroup 0: S = Q K^T over the tile (m64n64k16, both operands from shared memory, 36 k steps over
//     the 576 values), the softmax, P (the latents' type) into shared memory with the rescale factors beside
//     it, and O[:, 0..255] += P V; warpgroup 1: O[:, 256..511] += P V (m64n256k16, V read N-major from the
//     same tile). One warpgroup cannot hold 64 x 512 fp32 accumulators; two can (128 registers a thread).
//     Both stage Q (converting its latent columns like the keys') while the producer gathers tile 0.
// Shared memory (1024-aligned): Q 72 KB (9 column blocks of 64 rows x 128 B), two key tiles 72 KB each,
// P 8 KB, the factors and the tiles' valid-key masks: 230,416 B of the 232,448 a CTA may have.
// Named barriers order the pipeline (PTX ISA "bar.sync / bar.arrive"): FULL[b] (the producer arrives,
// both consumers wait), EMPTY[b] (the reverse), P (warpgroup 0 -> 1: P and the factors written), P_FREE
// (1 -> 0: read), SUMS (0 -> 1: the row sums, at the end), Q (1 -> 0: its half of Q staged).
// Measured against FlashMLA in bench/results/kernels.md ("Sparse MLA decode on wgmma"): the producer is
// the bottleneck there (one warpgroup gathering and widening every row).
#pragma once
#include "kernels/cuda/mla/attention_kernel.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace sparrow::cuda::mla_detail::wg {

constexpr int kHeads = 64;                      // wgmma M: the heads of one CTA
constexpr int kKeys = 64;                       // keys per tile
constexpr int kColBlocks = kMlaRow / 64;        // 9 column blocks of 64 bf16 (one 128-byte row each)
constexpr int kBlockBytes = 64 * 128;           // a column block of 64 rows (heads or keys)
constexpr int kTileBytes = kColBlocks * kBlockBytes;  // 73,728: Q, or one key tile
constexpr int kQOff = 0;
constexpr int kKOff = kTileBytes;               // two key tiles
constexpr int kPOff = 3 * kTileBytes;           // P: 64 heads x 64 keys bf16, one column block
constexpr int kRedOff = kPOff + kBlockBytes;    // [64 rows] fp32 rescale factors, then row sums (+ spare)
constexpr int kMaskOff = kRedOff + 2 * 64 * 4;  // [2 buffers][4 producer warps] uint16 valid-key masks
constexpr int kSmem = kMaskOff + 16 + 1024;     // + the alignment slack
static_assert(kSmem <= 232448, "over Hopper's 227 KB of shared memory per CTA");
constexpr int kThreads = 384;                   // warpgroups 0 and 1 compute, warpgroup 2 produces
// setmaxnreg: the producer's 128 hold a warp's 16 rows in flight at once (below); warpgroup 1 gives 8 of its
// 168 back, warpgroup 0 then takes 208. setmaxnreg only moves registers within the CTA's launch allocation,
// 384 x 168: setmaxnreg.inc waits for registers to come free, so a larger sum would never return (a hang, as
// a 144-register producer showed).
constexpr int kScoreRegs = 208, kProductRegs = 160, kProducerRegs = 128;
static_assert(128 * (kScoreRegs + kProductRegs + kProducerRegs) <= kThreads * 168, "setmaxnreg would wait forever");
enum : int { kBarFull = 1, kBarEmpty = 3, kBarP = 5, kBarPFree = 6, kBarSums = 7, kBarQ = 8 };  // FULL / EMPTY: + buffer

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
__device__ __forceinline__ void st_shared16(uint32_t addr, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, __half2 b) {
  const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&a), b);
  return *reinterpret_cast<const uint32_t*>(&p);
}
// bf16x2 -> f16x2, saturated to f16's finite range (cvt.rn.satfinite.f16x2.f32): an absorbed query beyond
// 65504 would be a broken model, but it must not turn the scores into NaN.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w) {
  uint32_t d;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(__uint_as_float(w & 0xffff0000u)), "f"(__uint_as_float(w << 16)));
  return d;
}

// Byte offset of 16-byte chunk c (values 8c .. 8c+7 of 576) of row r in a swizzled tile.
__device__ __forceinline__ uint32_t chunk_offset(int r, int c) {
  return uint32_t((c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// The format bodies: a row's 512 latent values are 32 units of 16 (unit j: chunks 2j, 2j+1), its rope
// kRopeUnits 16-byte loads of kRopeChunks chunks each (chunks 64 ..). The dequantisation is the one of
// attention_kernel.cuh's dequant_tile (same conversions, same rounding), written per unit.
template <PageFormat F>
struct Codec;

template <>
struct Codec<PageFormat::Fp8Latent> {  // [512 e4m3][4 fp32 scales][64 bf16 rope]
  static constexpr bool kF16 = true;
  static constexpr int kRopeUnits = 8, kRopeChunks = 1;
  struct Unit {
    uint4 v;
    float scale;
    __device__ void swap_halves(bool swap) { v = swap ? make_uint4(v.z, v.w, v.x, v.y) : v; }
  };
  __device__ static Unit load(const uint8_t* row, int j) {
    return {__ldg(reinterpret_cast<const uint4*>(row + 16 * j)), __ldg(reinterpret_cast<const float*>(row + 512 + 4 * (j >> 3)))};
  }
  // f16(e4m3 * f16(scale)): one conversion and one f16x2 product a pair of values.
  __device__ static void widen(const Unit& u, uint4& lo, uint4& hi) {
    const __half2 s = __float2half2_rn(u.scale);
    auto four = [&](uint32_t w, uint32_t& a, uint32_t& b) {
      a = f16x2_mul(e4m3x2_to_f16x2(w & 0xffffu), s);
      b = f16x2_mul(e4m3x2_to_f16x2(w >> 16), s);
    };
    four(u.v.x, lo.x, lo.y);
    four(u.v.y, lo.z, lo.w);
    four(u.v.z, hi.x, hi.y);
    four(u.v.w, hi.z, hi.w);
  }
  __device__ static uint4 load_rope(const uint8_t* row, int u) { return __ldg(reinterpret_cast<const uint4*>(row + 528 + 16 * u)); }
  __device__ static void widen_rope(const uint4& v, uint4 (&out)[kRopeChunks]) { out[0] = v; }
};

template <>
struct Codec<PageFormat::Fp8Rows> {  // 576 e4m3, unscaled (kMlaTensorScale = 1)
  static_assert(kMlaTensorScale == 1.0f, "Fp8Rows reads e4m3 values unscaled");
  static constexpr bool kF16 = true;
  static constexpr int kRopeUnits = 4, kRopeChunks = 2;
  struct Unit {
    uint4 v;
    __device__ void swap_halves(bool swap) { v = swap ? make_uint4(v.z, v.w, v.x, v.y) : v; }
  };
  __device__ static Unit load(const uint8_t* row, int j) { return {__ldg(reinterpret_cast<const uint4*>(row + 16 * j))}; }
  __device__ static void widen16(const uint4& v, uint4& lo, uint4& hi) {
    e4m3x4_to_bf16(v.x, lo.x, lo.y);
    e4m3x4_to_bf16(v.y, lo.z, lo.w);
    e4m3x4_to_bf16(v.z, hi.x, hi.y);
    e4m3x4_to_bf16(v.w, hi.z, hi.w);
  }
  __device__ static void widen(const Unit& u, uint4& lo, uint4& hi) {  // latents: f16, one conversion a pair
    lo = make_uint4(e4m3x2_to_f16x2(u.v.x & 0xffffu), e4m3x2_to_f16x2(u.v.x >> 16), e4m3x2_to_f16x2(u.v.y & 0xffffu),
                    e4m3x2_to_f16x2(u.v.y >> 16));
    hi = make_uint4(e4m3x2_to_f16x2(u.v.z & 0xffffu), e4m3x2_to_f16x2(u.v.z >> 16), e4m3x2_to_f16x2(u.v.w & 0xffffu),
                    e4m3x2_to_f16x2(u.v.w >> 16));
  }
  __device__ static uint4 load_rope(const uint8_t* row, int u) { return __ldg(reinterpret_cast<const uint4*>(row + 512 + 16 * u)); }
  __device__ static void widen_rope(const uint4& v, uint4 (&out)[kRopeChunks]) { widen16(v, out[0], out[1]); }
};

template <>
struct Codec<PageFormat::Nvfp4Latent> {  // [256 B e2m1][64 B rope e4m3][32 B e4m3 block scales]
  static_assert(kMlaTensorScale == 1.0f, "Nvfp4Latent applies the block scales only");
  static constexpr bool kF16 = false;
  static constexpr int kRopeUnits = 4, kRopeChunks = 2;
  struct Unit {
    uint2 codes;
    uint32_t scale;  // the e4m3 byte
    __device__ void swap_halves(bool swap) { codes = swap ? make_uint2(codes.y, codes.x) : codes; }
  };
  __device__ static Unit load(const uint8_t* row, int j) {
    return {__ldg(reinterpret_cast<const uint2*>(row + 8 * j)), uint32_t(__ldg(row + 256 + 64 + j))};
  }
  __device__ static void widen(const Unit& u, uint4& lo, uint4& hi) {
    const __nv_bfloat162 s = e4m3_to_bf16x2(u.scale);
    uint32_t a[4], b[4];
    e2m1x8_to_bf16(u.codes.x, a);
    e2m1x8_to_bf16(u.codes.y, b);
    lo = make_uint4(bf16x2_mul(a[0], s), bf16x2_mul(a[1], s), bf16x2_mul(a[2], s), bf16x2_mul(a[3], s));
    hi = make_uint4(bf16x2_mul(b[0], s), bf16x2_mul(b[1], s), bf16x2_mul(b[2], s), bf16x2_mul(b[3], s));
  }
  __device__ static uint4 load_rope(const uint8_t* row, int u) { return __ldg(reinterpret_cast<const uint4*>(row + 256 + 16 * u)); }
  __device__ static void widen_rope(const uint4& v, uint4 (&out)[kRopeChunks]) {
    Codec<PageFormat::Fp8Rows>::widen16(v, out[0], out[1]);
  }
};

// Whether the tile's 512 latent columns (and Q's, and P) are f16 rather than bf16: the FP8 formats widen
// e4m3 to f16 in one instruction a pair where bf16 takes four (e4m3 -> f16 -> 2 x fp32 -> bf16), and the
// producer, which is the kernel's bottleneck, is bound by its instruction count (kernels.md, "The
// producer's stalls, profiled"). f16 keeps more of each value than bf16 (11 significant bits against 8);
// the rope columns stay bf16 (their range is not the latents'), so S is 32 f16 k steps plus 4 bf16 ones.
template <PageFormat F>
struct LatentF16 {
  static constexpr bool value = Codec<F>::kF16;
};
template <>
struct LatentF16<PageFormat::BFloat16> {
  static constexpr bool value = false;
};
template <PageFormat F>
constexpr bool latent_f16 = LatentF16<F>::value;

// The producer's share of a tile: warp pw (0..3) fills rows 16pw .. 16pw+15, whose pool offsets lanes
// 0..15 hold in `off_lane` (-1: an unused slot, written as zeros so P V never meets garbage).
// Quantised formats: lane j loads latent unit j of all 16 rows (512 contiguous bytes a warp and row) and
// their rope parts before widening any, so a tile costs one round trip to memory (two passes of 8 rows took
// two: 0.93x the FP8 time with one, bench/results/kernels.md); then widens and stores them; lanes 4..7 of
// every 8 store their second chunk first, so each quarter-warp's stores hit 8 distinct bank groups. bf16:
// every chunk by cp.async (zero-filled for unused slots).
template <PageFormat F>
__device__ __forceinline__ void produce_tile(const uint8_t* pool, uint32_t tile, int pw, int lane, int64_t off_lane) {
  if constexpr (F == PageFormat::BFloat16) {
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
      const int64_t off = __shfl_sync(0xffffffffu, off_lane, i);
      const int r = pw * 16 + i;
      const uint8_t* src = pool + (off >= 0 ? off : 0);
      for (int c = lane; c < kMlaRow / 8; c += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + chunk_offset(r, c)),
                     "l"(src + 16 * c), "r"(off >= 0 ? 16 : 0));
    }
  } else {
    using C = Codec<F>;
    const int first = (lane >> 2) & 1;
    typename C::Unit unit[16];
    constexpr int kRope = 16 * C::kRopeUnits / 32;  // rope loads per lane
    uint4 rope[kRope];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t off = __shfl_sync(0xffffffffu, off_lane, i);
      if (off >= 0) unit[i] = C::load(pool + off, lane);
      else unit[i] = {};
    }
#pragma unroll
    for (int k = 0; k < kRope; ++k) {
      const int idx = lane + 32 * k, i = idx / C::kRopeUnits, u = idx % C::kRopeUnits;
      const int64_t off = __shfl_sync(0xffffffffu, off_lane, i);
      rope[k] = off >= 0 ? C::load_rope(pool + off, u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = pw * 16 + i;
      // Swapping the unit's two halves before widening (2-4 selects) instead of the widened chunks after
      // (8): the Nsight profile in kernels.md counts the producer's instructions.
      typename C::Unit u = unit[i];
      u.swap_halves(first);
      uint4 chunk_first, chunk_second;
      C::widen(u, chunk_first, chunk_second);
      st_shared16(tile + chunk_offset(r, 2 * lane + first), chunk_first);
      st_shared16(tile + chunk_offset(r, 2 * lane + 1 - first), chunk_second);
    }
#pragma unroll
    for (int k = 0; k < kRope; ++k) {
      const int idx = lane + 32 * k, i = idx / C::kRopeUnits, u = idx % C::kRopeUnits;
      const int r = pw * 16 + i;
      uint4 out[C::kRopeChunks];
      C::widen_rope(rope[k], out);
#pragma unroll
      for (int c = 0; c < C::kRopeChunks; ++c) st_shared16(tile + chunk_offset(r, 64 + u * C::kRopeChunks + c), out[c]);
    }
  }
}

// Loads issued now and used later (asm volatile keeps them ahead of the tile work that follows).
__device__ __forceinline__ int ld_early_s32(const int32_t* p) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int64_t ld_early_s64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.global.nc.b64 %0, [%1];\n" : "=l"(v) : "l"(p));
  return v;
}
// Starts moving `bytes` (a multiple of 16) at p into L2 (PTX ISA cp.async.bulk.prefetch), so that the row
// loads of the next tile hit L2 instead of waiting on HBM.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

template <PageFormat F, bool SPARSE>
__global__ void __launch_bounds__(kThreads, 1) mla_wgmma_kernel(const AttnParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* red = reinterpret_cast<float*>(smem + kRedOff);
  uint16_t* masks = reinterpret_cast<uint16_t*>(smem + kMaskOff);
  const uint32_t smem_base = ptx::smem_u32(smem);

  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7;
  const int64_t row = blockIdx.x / p.head_tiles;
  const int head0 = int(blockIdx.x % p.head_tiles) * kHeads;
  const int seq = __ldg(p.row_seq + row);
  const int nslots = SPARSE ? p.topk : __ldg(p.row_lens + row);
  const int slot_begin = int(blockIdx.y) * p.tiles_per_split * kKeys;
  const int slot_end = min(nslots, slot_begin + p.tiles_per_split * kKeys);
  const int ntiles = slot_end > slot_begin ? (slot_end - slot_begin + kKeys - 1) / kKeys : 0;

  if (wg == 2) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256, pw = pt >> 5;
    // The key list runs four tiles deep: tile t's rows are gathered while tile t+2's page offsets are read
    // (and its rows prefetched into L2) and tile t+3's token indices; lanes 0..15 carry one row each.
    constexpr int R = int(MlaRowBytes<F>::value);
    auto token_at = [&](int t) {  // this lane's token in tile t, -1 for an unused slot
      const int slot = slot_begin + t * kKeys + pw * 16 + lane;
      if (lane >= 16 || t >= ntiles || slot >= slot_end) return -1;
      return SPARSE ? ld_early_s32(p.indices + row * p.topk + slot) : slot;
    };
    const int64_t* pages = p.page_offsets + int64_t(seq) * p.pages_stride;
    auto offset_of = [&](int token) {
      if (token < 0) return int64_t(-1);
      const int page = page_of(p, token);
      return __ldg(pages + page) + int64_t(token - page * p.block_size) * R;
    };
    int64_t off = offset_of(token_at(0)), off_n1 = offset_of(token_at(1));
    if (off_n1 >= 0) prefetch_l2(p.pool + off_n1, R);
    int token_n2 = token_at(2);
    for (int t = 0; t < ntiles; ++t) {
      const int b = t & 1;
      const uint32_t tile = smem_base + kKOff + b * kTileBytes;
      // Reads for later tiles go out first, so they are in flight during the wait and this tile's work.
      const int token_n3 = token_at(t + 3);
      const int pg_n2 = token_n2 >= 0 ? page_of(p, token_n2) : 0;
      const int64_t page_n2 = token_n2 >= 0 ? ld_early_s64(pages + pg_n2) : 0;
      if (t >= 2) bar_sync(kBarEmpty + b, kThreads);  // the consumers are done with tile t-2
      const uint32_t valid = __ballot_sync(0xffffffffu, off >= 0) & 0xffffu;
      if (lane == 0) masks[b * 4 + pw] = uint16_t(valid);
      produce_tile<F>(p.pool, tile, pw, lane, off);
      const int64_t off_n2 = token_n2 >= 0 ? page_n2 + int64_t(token_n2 - pg_n2 * p.block_size) * R : -1;
      if (off_n2 >= 0) prefetch_l2(p.pool + off_n2, R);
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      wgmma::fence_proxy_async();  // generic-proxy writes -> wgmma's async-proxy reads
      bar_arrive(kBarFull + b, kThreads);
      off = off_n1;
      off_n1 = off_n2;
      token_n2 = token_n3;
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  // Warpgroup 0 computes S = Q K^T over the whole tile (m64n64k16: 36 k steps, so each step's Q operand
  // is read from shared memory once for 64 keys), the softmax and P, and O[:, 0..255] += P V; warpgroup 1
  // only O[:, 256..511] += P V, rescaled by the factors warpgroup 0 leaves beside P. Warpgroup 0 issues
  // tile t+1's S right behind tile t's P V, so the tensor cores see one product after another while it
  // works out the next softmax.
  const int w = wg;                              // output columns 256w ..
  const int wr = (tid >> 5) & 3;                 // warp within the warpgroup: rows 16wr ..
  const int g = lane >> 2, cq = lane & 3;
  const int r0 = wr * 16 + g;                    // this thread's rows r0 and r0 + 8
  float* alpha_s = red;                          // [64] the tile's rescale factors, then the row sums
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const uint32_t q_s = smem_base + kQOff, p_s = smem_base + kPOff;
  auto pv = [&](uint32_t k_s) {  // O[:, 256w ..] += P V, V = the tile's latent columns 256w .., N-major
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) {
      const uint64_t a = wgmma::sw128_descriptor_u32(p_s + ks * 32),
                     b = wgmma::sw128_descriptor_mn_u32(k_s + 4 * w * kBlockBytes + ks * 2048, kBlockBytes);
      if (latent_f16<F>) wgmma::ss_f16_bn<256>(o, a, b, 1);
      else wgmma::ss_bf16_bn<256>(o, a, b, 1);
    }
    ptx::wgmma_commit();
  };
  auto tile_at = [&](int t) { return smem_base + kKOff + (t & 1) * kTileBytes; };

  // Q: 64 heads x 72 chunks (heads past p.heads zero), staged by both consumer warpgroups while the producer
  // gathers tile 0; the latent chunks converted to f16 where the tile is (latent_f16).
  auto stage_q = [&] {
    constexpr int kPerThread = kHeads * (kMlaRow / 8) / 256;  // 18
    uint4 v[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = (tid & 255) + 256 * i, h = c / (kMlaRow / 8), ch = c % (kMlaRow / 8);
      v[i] = head0 + h < p.heads
                 ? __ldg(reinterpret_cast<const uint4*>(p.q + (row * p.heads + head0 + h) * kMlaRow + ch * 8))
                 : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = (tid & 255) + 256 * i, h = c / (kMlaRow / 8), ch = c % (kMlaRow / 8);
      if (latent_f16<F> && ch < kMlaLatent / 8)
        v[i] = make_uint4(bf16x2_to_f16x2(v[i].x), bf16x2_to_f16x2(v[i].y), bf16x2_to_f16x2(v[i].z), bf16x2_to_f16x2(v[i].w));
      st_shared16(smem_base + kQOff + chunk_offset(h, ch), v[i]);
    }
    wgmma::fence_proxy_async();
  };

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  if (w == 0) {
    setmaxnreg_inc<kScoreRegs>();  // after warpgroup 1 and the producer gave theirs back
    stage_q();
    bar_sync(kBarQ, 256);
    float s[32];
    auto qk = [&](uint32_t k_s) {
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kMlaRow / 16; ++kk) {
        const uint32_t step = (kk >> 2) * kBlockBytes + (kk & 3) * 32;
        const uint64_t a = wgmma::sw128_descriptor_u32(q_s + step), b = wgmma::sw128_descriptor_u32(k_s + step);
        if (latent_f16<F> && kk < kMlaLatent / 16) wgmma::ss_f16<64>(s, a, b, kk > 0);
        else wgmma::ss_bf16<64>(s, a, b, kk > 0);
      }
      ptx::wgmma_commit();
    };
    if (ntiles > 0) {
      bar_sync(kBarFull, kThreads);
      qk(tile_at(0));
      ptx::wgmma_wait<0>();
    }
    for (int t = 0; t < ntiles; ++t) {
      const int b = t & 1;
      wgmma::keep(s);
      const uint64_t valid = uint64_t(masks[b * 4]) | (uint64_t(masks[b * 4 + 1]) << 16) |
                             (uint64_t(masks[b * 4 + 2]) << 32) | (uint64_t(masks[b * 4 + 3]) << 48);
      // s[j]: row r0 + 8 * ((j >> 1) & 1), key 8 (j >> 2) + 2 cq + (j & 1). Log2 domain, unused slots masked.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int key = (j >> 2) * 8 + cq * 2 + (j & 1);
        const float v = (valid >> key) & 1 ? s[j] * p.scale_log2 : -INFINITY;
        s[j] = v;
        mx[(j >> 1) & 1] = fmaxf(mx[(j >> 1) & 1], v);
      }
      float m_use[2], alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // no valid key yet: avoid (-inf) - (-inf)
        alpha[h] = exp2f(m_run[h] - m_use[h]);
        m_run[h] = m_new;
      }
      if (t > 0) bar_sync(kBarPFree, 256);  // warpgroup 1 is done reading P and the factors of tile t-1
      // P (the tile's latent type) into its swizzled tile: chunk n of row r holds keys 8n ..; sum the rounded
      // values.
      float sum[2] = {0.f, 0.f};
      auto round_pair = [&](float a, float b, uint32_t& bits) {
        if constexpr (latent_f16<F>) {
          const __half2 v = __floats2half2_rn(a, b);
          bits = *reinterpret_cast<const uint32_t*>(&v);
          return __low2float(v) + __high2float(v);
        } else {
          const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
          bits = *reinterpret_cast<const uint32_t*>(&v);
          return __low2float(v) + __high2float(v);
        }
      };
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        uint32_t lo, hi;
        sum[0] += round_pair(exp2f(s[4 * n] - m_use[0]), exp2f(s[4 * n + 1] - m_use[0]), lo);
        sum[1] += round_pair(exp2f(s[4 * n + 2] - m_use[1]), exp2f(s[4 * n + 3] - m_use[1]), hi);
        const uint32_t at = p_s + ((n ^ (r0 & 7)) << 4) + cq * 4;  // rows r0 and r0 + 8 share r & 7
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + r0 * 128), "r"(lo) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + (r0 + 8) * 128), "r"(hi) : "memory");
      }
      if (cq == 0) {
        alpha_s[r0] = alpha[0];
        alpha_s[r0 + 8] = alpha[1];
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        l_run[h] = l_run[h] * alpha[h] + sum[h];
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
      wgmma::fence_proxy_async();
      bar_arrive(kBarP, 256);  // P and the factors of tile t are written
      pv(tile_at(t));
      if (t + 1 < ntiles) {
        bar_sync(kBarFull + (b ^ 1), kThreads);
        qk(tile_at(t + 1));
      }
      ptx::wgmma_wait<0>();
      wgmma::keep(o);
      if (t + 2 < ntiles) bar_arrive(kBarEmpty + b, kThreads);  // the producer waits only for tiles it refills
    }
    // The row sums for warpgroup 1, once its last P V no longer reads the factors.
    if (ntiles > 0) bar_sync(kBarPFree, 256);
    if (cq == 0) {
      alpha_s[r0] = l_run[0];
      alpha_s[r0 + 8] = l_run[1];
    }
    bar_arrive(kBarSums, 256);
  } else {
    setmaxnreg_dec<kProductRegs>();
    stage_q();
    bar_arrive(kBarQ, 256);
    for (int t = 0; t < ntiles; ++t) {
      const int b = t & 1;
      bar_sync(kBarFull + b, kThreads);
      bar_sync(kBarP, 256);
      const float a0 = alpha_s[r0], a1 = alpha_s[r0 + 8];
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= (i >> 1) & 1 ? a1 : a0;
      pv(tile_at(t));
      ptx::wgmma_wait<0>();
      wgmma::keep(o);
      bar_arrive(kBarPFree, 256);  // warpgroup 0 waits for it before the next P, and before the sums
      if (t + 2 < ntiles) bar_arrive(kBarEmpty + b, kThreads);
    }
    bar_sync(kBarSums, 256);
    l_run[0] = alpha_s[r0];
    l_run[1] = alpha_s[r0 + 8];
  }

  // Epilogue: normalise and write (bf16, or fp32 partials for the combine kernel); lse from warpgroup 0.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const float total = l_run[h];
    const int head = head0 + r;
    if (head >= p.heads) continue;
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float lse_v = total > 0.f ? (m_run[h] + log2f(total)) * 0.6931471805599453f : -INFINITY;
    const int64_t rh = row * p.heads + head;
    if (p.splits == 1) {
      __nv_bfloat16* dst = p.out + rh * kMlaLatent + w * 256 + cq * 2;
#pragma unroll
      for (int n = 0; n < 32; ++n)
        *reinterpret_cast<__nv_bfloat162*>(dst + n * 8) =
            __floats2bfloat162_rn(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
      if (p.lse && w == 0 && cq == 0) p.lse[rh] = lse_v;
    } else {
      const int64_t wrh = int64_t(blockIdx.y) * p.rows * p.heads + rh;
      float* dst = p.ws_o + wrh * kMlaLatent + w * 256 + cq * 2;
#pragma unroll
      for (int n = 0; n < 32; ++n)
        *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
      if (w == 0 && cq == 0) p.ws_lse[wrh] = lse_v;
    }
  }
}

// How the wgmma kernel tiles a problem: 64 heads and up to tiles_per_split tiles of 64 keys a CTA.
AttnPlan plan_mla_wgmma(int64_t rows, int heads, int64_t max_keys);

template <PageFormat F, bool SPARSE>
void launch_wgmma(const AttnParams& p, cudaStream_t stream) {
  auto kernel = mla_wgmma_kernel<F, SPARSE>;
  SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(unsigned(p.rows * p.head_tiles), unsigned(p.splits));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// Defined in sparse_wgmma.cu.
void dispatch_sparse_wgmma(PageFormat format, const AttnParams& p, cudaStream_t stream);

}  // namespace sparrow::cuda::mla_detail::wg
