// MSA block selector kernels (msa.h says what is computed and the cache layout).
//
// Two kernels per launch (per chunk of rows when there are very many):
//
// 1. Block scores, on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulators). The product is
//    keys x query vectors: M = 16 keys per m-tile (A, row-major: each key's dims are contiguous in its
//    page row), N = 8 (row, head) query vectors per n-tile (B, "col"-major: each vector's dims are
//    contiguous), K = dim. A query vector is row r's head g: vector v = r * heads + g, so q is simply
//    [vectors, dim]. A warp owns a chunk of 8 * NT consecutive vectors, holds their B fragments in
//    registers for the whole launch, and walks one range of index blocks of its rows' sequence, 16 * MTI
//    keys per step; after each m-tile it masks keys beyond each vector's position and folds its keys into
//    a per-lane running max of the current index block; when the block is done the 8 lanes sharing t
//    (same vectors, different keys) are max-reduced with shuffles and the block's score goes to the
//    workspace [vectors, nblocks]. Every (vector, block) is written by exactly one warp: ranges split at
//    block boundaries, no atomics. The chunk's rows may belong to different sequences (a decode step:
//    one row per sequence): the warp walks the keys once per distinct sequence, masking the other
//    vectors. Keys are read once per (warp chunk, key), straight from their pages (16-byte loads, each
//    instruction reading 64 contiguous bytes of 8 keys), and the warps of a CTA either split the block
//    range (Decode) or walk the same range for neighbouring vector chunks (Prefill), sharing the key
//    lines through L1.
//
//    The dot product over K is invariant under any permutation of K applied to both operands, so instead
//    of the fragment's k order each lane loads contiguous words of a row: lane t's j-th 32-bit word
//    (j = 0 .. 2 KS - 1; word 2s feeds k-step s's first register pair, 2s+1 its second) is word
//    (j / VEC) * 4 VEC + t * VEC + j % VEC of the row. A and B use the same mapping, so every product
//    pairs equal dims; words past dim/2 are zero (dims that are not a multiple of 16).
//
//    Narrow keys (FP8, NVFP4, MXFP4) use the same mapping over the raw bytes: bf16 word j covers dims 2j
//    and 2j+1, which are bytes 2j, 2j+1 of an FP8 row and byte j of an FP4 row's codes. VEC is chosen per
//    format so that each load is 16 raw bytes when the dim allows it (8 bf16 words of FP8 keys, 16 of
//    FP4 keys: at MiniMax-M3.1's dim 128, two 16-byte loads per lane and key for FP8, one for FP4 plus its
//    block scales), against four for bf16 keys. The raw bytes are then widened to the bf16 words the
//    bf16 path would have loaded (kernels/cuda/gqa/kv_widen.cuh: PRMT / shift / logic ops and bf16x2
//    multiplies, exact; no conversion-pipe instruction, which is what made the first FP8 path 1.5x slower
//    than bf16: bench/results/kernels.md). In the decode tiling the loads of a step's raw keys are issued
//    before the previous step's keys are widened and multiplied (a register double buffer), so a narrow
//    key's load latency hides behind the arithmetic instead of stalling on it.
//
// 2. Selection, one CTA per vector: the vector's block scores go to shared memory as 32-bit keys whose
//    unsigned order is the float order (NaN lowest, -0 = +0, as topk.cu), the forced blocks become +inf,
//    the k-th largest key T is found bit by bit (the largest T with count(key >= T) >= k), and the kept
//    set {key > T} + the first (k - count(key > T)) keys equal to T in index order (ties to the smaller
//    block id) minus the -inf blocks is written in ascending block order by ballot compaction: no sort.
#include "kernels/cuda/msa/msa.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/batch_invariance.h"
#include "core/error.h"
#include "kernels/cuda/gqa/kv_widen.cuh"
#include "kernels/cuda/paged.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/quant/fp4.cuh"
#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"

namespace sparrow::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Block scores of at most this many bytes per launch pair: more rows run in chunks.
constexpr int64_t kWorkspaceCap = int64_t(64) << 20;
// Selection keeps the scores in shared memory up to this many blocks (48 KB, no opt-in needed);
// longer rows work on their workspace row in place (L2).
constexpr int kSelectSmemBlocks = 12288;
// A warp's key range is at least this many keys (its query fragments are loaded once per range).
constexpr int kMinKeysPerWarp = 128;

constexpr uint32_t kKeyPosInf = 0xFF800000u;  // order_key(+inf)
constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // order_key(-inf)

// Dividing by the per-layer scale (1.0) changes no value; the writers still do, as the CPU codec does.
constexpr float kTensorScale = kMsaKeyTensorScale;
static_assert(kTensorScale == 1.0f, "the score kernel reads narrow keys with a per-layer scale of 1.0");

__host__ __device__ constexpr bool is_fp4(PageFormat f) {
  return f == PageFormat::Nvfp4Rows || f == PageFormat::Mxfp4Rows;
}
__host__ __device__ constexpr int fp4_block(PageFormat f) {
  return f == PageFormat::Nvfp4Rows ? quant::kNvfp4Block : quant::kMxfp4Block;
}

// ---------------------------------------------------------------------------------------------------
// Key writes.

// bf16: one thread per 16-byte piece of a row.
__global__ void write_keys_kernel(const uint4* keys, int64_t count, int pieces, const int32_t* token_seq,
                                  const int32_t* token_pos, const int64_t* page_table, int64_t stride,
                                  int block_size, uint8_t* pool) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * pieces) return;
  const int64_t row = i / pieces;
  const int piece = int(i - row * pieces);
  const int pos = token_pos[row];
  if (pos < 0) return;
  const PagedSlot at = paged_slot(pool, page_table, stride, token_seq[row], pos, block_size);
  uint4* dst = reinterpret_cast<uint4*>(at.page + at.slot * pieces * 16);
  dst[piece] = keys[i];
}

// FP8 key writes: one thread per 8 values (16 bytes of bf16 in, 8 bytes of E4M3 out), encoded by the CPU
// page codec's rule (quant::e4m3_encode is kernels/cpu/fp8_codec.h's twin; the codec divides by the per-layer
// scale kKvTensorScale = 1.0 first, which changes nothing).
__global__ void write_keys_fp8_kernel(const uint4* keys, int64_t count, int pieces, const int32_t* token_seq,
                                      const int32_t* token_pos, const int64_t* page_table, int64_t stride,
                                      int block_size, uint8_t* pool) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * pieces) return;
  const int64_t row = i / pieces;
  const int piece = int(i - row * pieces);
  const int pos = token_pos[row];
  if (pos < 0) return;
  const PagedSlot at = paged_slot(pool, page_table, stride, token_seq[row], pos, block_size);
  const uint4 x = keys[i];
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2] = {0u, 0u};
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const uint32_t bits = (in[v / 2] >> (16 * (v % 2))) & 0xFFFFu;  // value v: low half first
    const uint32_t code = quant::e4m3_encode(__fdiv_rn(__uint_as_float(bits << 16), kTensorScale));
    out[v / 4] |= code << (8 * (v % 4));
  }
  uint2* dst = reinterpret_cast<uint2*>(at.page + at.slot * pieces * 8);
  dst[piece] = make_uint2(out[0], out[1]);
}

// NVFP4 / MXFP4 key writes: one thread per block (16 / 32 values; the last block of a dim that is no
// multiple of the block is shorter, a multiple of 8), quantised by the CPU codec's rules (kernels/cpu/
// fp4.h nvfp4_quantize with global = kTensorScale, mxfp4_quantize) through their device twins
// (quant/fp4.cuh): the block's code bytes at the token's code row (4 per 8 values, value 2i in the low
// nibble of byte i), its scale byte at the token's scale row, after all the page's codes.
template <PageFormat F>
__global__ void write_keys_fp4_kernel(const uint4* keys, int64_t count, int dim, int nblocks, const int32_t* token_seq,
                                      const int32_t* token_pos, const int64_t* page_table, int64_t stride,
                                      int block_size, uint8_t* pool) {
  constexpr int BS = fp4_block(F);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * nblocks) return;
  const int64_t row = i / nblocks;
  const int b = int(i - row * nblocks);
  const int pos = token_pos[row];
  if (pos < 0) return;
  const PagedSlot at = paged_slot(pool, page_table, stride, token_seq[row], pos, block_size);
  const int begin = b * BS, n8 = min(BS, dim - begin) / 8;  // 8-value groups in this block
  const uint4* src = keys + (row * dim + begin) / 8;
  float x[BS];
#pragma unroll
  for (int q = 0; q < BS / 8; ++q) {
    const uint4 v = q < n8 ? src[q] : make_uint4(0u, 0u, 0u, 0u);  // zeros change no block's amax
    const uint32_t in[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) x[8 * q + e] = __uint_as_float(((in[e / 2] >> (16 * (e % 2))) & 0xFFFFu) << 16);
  }
  float amax = 0.0f;
  bool not_finite = false;
#pragma unroll
  for (int e = 0; e < BS; ++e) {
    amax = fmaxf(amax, fabsf(x[e]));  // fmaxf ignores NaN, as the CPU's std::fmax
    not_finite = not_finite || !isfinite(x[e]);
  }
  uint32_t codes[BS / 8];
#pragma unroll
  for (int q = 0; q < BS / 8; ++q) codes[q] = 0u;
  uint8_t scale;
  if constexpr (F == PageFormat::Nvfp4Rows) {
    scale = quant::nvfp4_scale(amax, kTensorScale);
    const float step = quant::nvfp4_step(scale, kTensorScale);
#pragma unroll
    for (int e = 0; e < BS; ++e) codes[e / 8] |= quant::nvfp4_encode(x[e], step) << (4 * (e % 8));
  } else {
    scale = quant::mxfp4_scale(amax, not_finite);
    if (scale != quant::kE8m0Nan) {  // a NaN block keeps codes 0, as the CPU codec
      const float inverse = quant::mxfp4_inverse(scale);
#pragma unroll
      for (int e = 0; e < BS; ++e) codes[e / 8] |= quant::mxfp4_encode(x[e], inverse) << (4 * (e % 8));
    }
  }
  // dim / 2 and begin / 2 are multiples of 4: the code words are aligned.
  uint32_t* dst = reinterpret_cast<uint32_t*>(at.page + at.slot * (dim / 2) + begin / 2);
#pragma unroll
  for (int q = 0; q < BS / 8; ++q)
    if (q < n8) dst[q] = codes[q];
  at.page[int64_t(block_size) * (dim / 2) + at.slot * nblocks + b] = scale;
}

// ---------------------------------------------------------------------------------------------------
// Block scores.

struct ScoreParams {
  const uint8_t* q;  // [vectors, dim] bf16
  int64_t vectors;   // rows * heads
  int heads;
  int dim;
  const int32_t* row_seq;
  const int32_t* row_pos;
  const uint8_t* pool;
  const int64_t* page_table;
  int64_t stride;
  int block_size;
  int key_bytes;       // a token's row of values (bf16, E4M3) or codes (E2M1) in its page
  int64_t scale_base;  // FP4: bytes from a page's start to its scales (block_size * dim / 2)
  int scale_bytes;     // FP4: a token's scale bytes (one per block)
  int ib;
  int nblocks;  // workspace row length: max_position / ib + 1
  float* ws;    // [vectors, nblocks]
  int64_t chunks;          // vector chunks of 8 * NT
  int chunks_per_cta;      // 1 (Decode: the warps split the block range) or 4 (Prefill: they share it)
  int splits;              // block ranges
  int blocks_per_split;
};

// Lane t's 2 KS words of a bf16 row (see the top of the file); `pieces` = dim / (8 VEC) loads of VEC words.
template <int KS, int VEC>
__device__ __forceinline__ void load_row(uint32_t (&w)[2 * KS], const uint8_t* row, int t, int pieces) {
#pragma unroll
  for (int c = 0; c < 2 * KS / VEC; ++c) {
    if (c < pieces) {
      const uint8_t* src = row + (c * 4 * VEC + t * VEC) * 4;
      if constexpr (VEC >= 4) {
#pragma unroll
        for (int u = 0; u < VEC / 4; ++u) {
          const uint4 x = *reinterpret_cast<const uint4*>(src + 16 * u);
          w[c * VEC + 4 * u + 0] = x.x, w[c * VEC + 4 * u + 1] = x.y, w[c * VEC + 4 * u + 2] = x.z,
                              w[c * VEC + 4 * u + 3] = x.w;
        }
      } else if constexpr (VEC == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        w[c * 2 + 0] = x.x, w[c * 2 + 1] = x.y;
      } else {
        w[c] = *reinterpret_cast<const uint32_t*>(src);
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) w[c * VEC + i] = 0u;
    }
  }
}

// Lane t's raw bytes of a narrow key row: the bytes of its 2 KS bf16 words (2 a word for FP8, 1 for
// FP4 codes), piece after piece, and for FP4 the scale byte(s) of each piece (a piece of VEC words =
// 2 VEC dims lies in one block, except at VEC 16 for NVFP4: two blocks, two bytes).
template <int KS, int VEC, PageFormat F>
struct RawKey {
  static constexpr int kBytesPerWord = F == PageFormat::Fp8Rows ? 2 : 1;
  static constexpr int kPieceBytes = VEC * kBytesPerWord;
  static constexpr int kPieces = 2 * KS / VEC;
  static constexpr int kWords = (2 * KS * kBytesPerWord + 3) / 4;
  uint32_t code[kWords];
  uint32_t scale[is_fp4(F) ? kPieces : 1];
};

template <int KS, int VEC, PageFormat F>
__device__ __forceinline__ void load_raw(RawKey<KS, VEC, F>& r, const uint8_t* codes, const uint8_t* scales, int t,
                                         int pieces) {
  using R = RawKey<KS, VEC, F>;
#pragma unroll
  for (int i = 0; i < R::kWords; ++i) r.code[i] = 0u;
#pragma unroll
  for (int c = 0; c < R::kPieces; ++c) {
    r.scale[is_fp4(F) ? c : 0] = 0u;
    if (c >= pieces) continue;
    const int w0 = c * 4 * VEC + t * VEC;  // the piece's first bf16 word in the row
    const uint8_t* src = codes + w0 * R::kBytesPerWord;
    if constexpr (R::kPieceBytes == 16) {
      const uint4 x = *reinterpret_cast<const uint4*>(src);
      r.code[4 * c] = x.x, r.code[4 * c + 1] = x.y, r.code[4 * c + 2] = x.z, r.code[4 * c + 3] = x.w;
    } else if constexpr (R::kPieceBytes == 8) {
      const uint2 x = *reinterpret_cast<const uint2*>(src);
      r.code[2 * c] = x.x, r.code[2 * c + 1] = x.y;
    } else if constexpr (R::kPieceBytes == 4) {
      r.code[c] = *reinterpret_cast<const uint32_t*>(src);
    } else if constexpr (R::kPieceBytes == 2) {
      r.code[c / 2] |= uint32_t(*reinterpret_cast<const uint16_t*>(src)) << (16 * (c % 2));
    } else {
      r.code[c / 4] |= uint32_t(*src) << (8 * (c % 4));
    }
    if constexpr (is_fp4(F)) {
      const int d0 = 2 * w0;  // the piece's first dim
      if constexpr (F == PageFormat::Nvfp4Rows && VEC == 16)
        r.scale[c] = *reinterpret_cast<const uint16_t*>(scales + d0 / 16);  // blocks d0/16 and d0/16 + 1
      else
        r.scale[c] = scales[d0 / fp4_block(F)];
    }
  }
}

// The bf16 words load_row would have given for the dequantised key (exact, kv_widen.cuh).
template <int KS, int VEC, PageFormat F>
__device__ __forceinline__ void widen_raw(const RawKey<KS, VEC, F>& r, uint32_t (&a)[2 * KS]) {
  if constexpr (F == PageFormat::Fp8Rows) {
#pragma unroll
    for (int i = 0; i < KS; ++i) widen::e4m3x4_to_bf16(r.code[i], a[2 * i], a[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < RawKey<KS, VEC, F>::kWords; ++i) {
      uint32_t o[4];
      widen::e2m1x8_to_bf16(r.code[i], o);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (4 * i + k < 2 * KS) a[4 * i + k] = o[k];
    }
    // Word j belongs to piece j / VEC; at VEC 16 (NVFP4) its second half to the piece's second block.
    constexpr int kHalves = F == PageFormat::Nvfp4Rows && VEC == 16 ? 2 : 1;
#pragma unroll
    for (int c = 0; c < 2 * KS / VEC; ++c)
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint32_t code = (r.scale[c] >> (8 * h)) & 0xFFu;
        const uint32_t s2 =
            F == PageFormat::Nvfp4Rows ? widen::nvfp4_scale_bf16x2(code) : widen::mxfp4_scale_bf16x2(code);
#pragma unroll
        for (int j = 0; j < VEC / kHalves; ++j) {
          const int w = c * VEC + h * (VEC / kHalves) + j;
          a[w] = widen::mul_bf16x2(a[w], s2);
        }
      }
  }
}

// KS k-steps of 16 dims (dim <= 16 KS), VEC words per load, NT n-tiles (8 NT vectors per warp), MTI
// m-tiles of 16 keys per step; F: how the keys are stored (msa.h).
template <int KS, int VEC, int NT, int MTI, PageFormat F>
__global__ void __launch_bounds__(kThreads) block_scores_kernel(const ScoreParams p) {
  constexpr int kVecs = NT * 8;
  static_assert(kVecs <= 32, "a warp's rows are held one per lane");
  constexpr bool kNarrow = F != PageFormat::BFloat16;
  // Decode tiling with whole 2- to 16-byte pieces: the next step's raw keys are loaded before this step's
  // are widened (Prefill's 4 warps share their keys through L1 instead; the generic VEC 1 tiling of odd
  // dims would need too many registers for a second buffer).
  constexpr bool kPrefetch = kNarrow && NT == 1 && VEC >= 2;
  using Raw = RawKey<KS, VEC, F>;
  const float ninf = -INFINITY;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int vc = p.chunks_per_cta;
  const int64_t chunk = int64_t(blockIdx.y) * vc + warp % vc;
  const int64_t split = int64_t(blockIdx.x) * (kWarps / vc) + warp / vc;
  if (chunk >= p.chunks || split >= p.splits) return;  // whole warps: no barrier follows
  const int64_t v0 = chunk * kVecs;
  const int64_t v1 = min(v0 + kVecs, p.vectors);
  const int pieces = p.dim / (8 * VEC);
  const int64_t row_bytes = int64_t(p.dim) * 2;  // a query vector (bf16)
  const int key_bytes = p.key_bytes;             // a key row (codes for FP4)
  const int bb = int(split) * p.blocks_per_split;
  const int be = min(bb + p.blocks_per_split, p.nblocks);
  const int ib = p.ib;

  // B fragments: lane (g, t) holds vector v0 + nt*8 + g.
  uint32_t qf[NT][2 * KS];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int64_t v = v0 + nt * 8 + g;
    if (v < v1) {
      load_row<KS, VEC>(qf[nt], p.q + v * row_bytes, t, pieces);
    } else {
#pragma unroll
      for (int i = 0; i < 2 * KS; ++i) qf[nt][i] = 0u;
    }
  }
  // The vectors of this lane's accumulators (C columns 2t, 2t+1 of each n-tile): sequence and position.
  int cseq[NT][2], cpos[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t v = v0 + nt * 8 + 2 * t + e;
      cseq[nt][e] = v < v1 ? p.row_seq[v / p.heads] : -1;
      cpos[nt][e] = v < v1 ? p.row_pos[v / p.heads] : -1;
    }

  // The chunk's rows, one per lane; a row is pending until a pass has walked its sequence's keys.
  // Rows that see no key of this range (position before it, or padding rows) need no pass.
  const int64_t r_lo = v0 / p.heads;
  const int nrows = int((v1 - 1) / p.heads - r_lo + 1);
  int my_seq = -1, my_pos = -1;
  if (lane < nrows) my_seq = p.row_seq[r_lo + lane], my_pos = p.row_pos[r_lo + lane];
  bool pending = lane < nrows && my_pos >= int64_t(bb) * ib;

  while (true) {
    const unsigned todo = __ballot_sync(0xffffffffu, pending);
    if (todo == 0u) break;
    const int seq = __shfl_sync(0xffffffffu, my_seq, __ffs(todo) - 1);
    const bool mine = pending && my_seq == seq;
    int maxpos = mine ? my_pos : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, o));
    pending = pending && !mine;
    // lim: the last key a vector sees in this pass (-1 for vectors of other sequences).
    int lim[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) lim[nt][e] = cseq[nt][e] == seq ? cpos[nt][e] : -1;

    const int key_begin = bb * ib;
    const int key_end = min(be * ib, maxpos + 1);
    const int64_t* ptab = p.page_table + int64_t(seq) * p.stride;
    // run[nt][e]: the max over this lane's keys of block `cur` for vector (nt, 2t+e); the 8 lanes sharing
    // t hold different keys of the same vectors and are reduced once per block, when it is written.
    float run[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) run[nt][0] = run[nt][1] = ninf;
    int cur = -1;
    auto flush = [&]() {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float m = run[nt][e];
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
          // Lane g = nt writes n-tile nt (all 8 lanes of a t agree now).
          if (g == nt && lim[nt][e] >= cur * ib) p.ws[(v0 + nt * 8 + 2 * t + e) * p.nblocks + cur] = m;
        }
    };
    // The m-tile of keys mk0 .. mk0+15 from its A fragments: a0 = key mk0 + g, a1 = the key 8 after it.
    auto score_mtile = [&](const uint32_t (&a0)[2 * KS], const uint32_t (&a1)[2 * KS], int mk0) {
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
          const uint32_t a[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
          ptx::mma_bf16(acc[nt], a, qf[nt][2 * s], qf[nt][2 * s + 1]);
        }
      }
      // acc[nt][e] = key_a · vector (nt, 2t+e), acc[nt][2+e] = key_b · the same vector.
      const int key_a = mk0 + g, key_b = key_a + 8;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (!(key_a < key_end && key_a <= lim[nt][e])) acc[nt][e] = ninf;
          if (!(key_b < key_end && key_b <= lim[nt][e])) acc[nt][2 + e] = ninf;
        }
      const int blk_a = key_a / ib, blk_b = key_b / ib;
      const int last = (min(mk0 + 16, key_end) - 1) / ib;
#pragma unroll 1
      for (int b = mk0 / ib; b <= last; ++b) {
        if (b != cur) {
          if (cur >= 0) flush();
          cur = b;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) run[nt][0] = run[nt][1] = ninf;
        }
        // fmaxf ignores a NaN operand, as std::max(acc, NaN) does in the CPU max-pool.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            run[nt][e] = fmaxf(run[nt][e], fmaxf(blk_a == b ? acc[nt][e] : ninf, blk_b == b ? acc[nt][2 + e] : ninf));
      }
    };

    if constexpr (!kNarrow) {
#pragma unroll 1
      for (int k0 = key_begin; k0 < key_end; k0 += 16 * MTI) {
        // A fragments: a[mi][0] = key k0 + 16 mi + g, a[mi][1] = the key 8 after it.
        uint32_t a[MTI][2][2 * KS];
#pragma unroll
        for (int mi = 0; mi < MTI; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int key = k0 + mi * 16 + h * 8 + g;
            if (key < key_end) {
              const int page = key / p.block_size;
              const int slot = key - page * p.block_size;
              load_row<KS, VEC>(a[mi][h], p.pool + ptab[page] + int64_t(slot) * key_bytes, t, pieces);
            } else {
#pragma unroll
              for (int i = 0; i < 2 * KS; ++i) a[mi][h][i] = 0u;
            }
          }
#pragma unroll
        for (int mi = 0; mi < MTI; ++mi) {
          const int mk0 = k0 + mi * 16;
          if (mk0 >= key_end) break;
          score_mtile(a[mi][0], a[mi][1], mk0);
        }
      }
    } else {
      // Raw key bytes of the step at k: rk[mi][0] = key k + 16 mi + g, rk[mi][1] = the key 8 after it
      // (zeros past key_end: no load).
      auto fetch = [&](Raw (&rk)[MTI][2], int k) {
#pragma unroll
        for (int mi = 0; mi < MTI; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int key = k + mi * 16 + h * 8 + g;
            if (key < key_end) {
              const int page = key / p.block_size;
              const int slot = key - page * p.block_size;
              const uint8_t* base = p.pool + ptab[page];
              load_raw<KS, VEC, F>(rk[mi][h], base + int64_t(slot) * key_bytes,
                                   base + p.scale_base + int64_t(slot) * p.scale_bytes, t, pieces);
            } else {
              load_raw<KS, VEC, F>(rk[mi][h], nullptr, nullptr, t, 0);
            }
          }
      };
      Raw rk[MTI][2];
      if constexpr (kPrefetch) fetch(rk, key_begin);
#pragma unroll 1
      for (int k0 = key_begin; k0 < key_end; k0 += 16 * MTI) {
        Raw next[kPrefetch ? MTI : 1][2];
        if constexpr (kPrefetch)
          fetch(next, k0 + 16 * MTI);  // in flight while this step is widened and multiplied
        else
          fetch(rk, k0);
#pragma unroll
        for (int mi = 0; mi < MTI; ++mi) {
          const int mk0 = k0 + mi * 16;
          if (mk0 >= key_end) break;
          uint32_t a0[2 * KS], a1[2 * KS];
          widen_raw<KS, VEC, F>(rk[mi][0], a0);
          widen_raw<KS, VEC, F>(rk[mi][1], a1);
          score_mtile(a0, a1, mk0);
        }
        if constexpr (kPrefetch) {
#pragma unroll
          for (int mi = 0; mi < MTI; ++mi) rk[mi][0] = next[mi][0], rk[mi][1] = next[mi][1];
        }
      }
    }
    if (cur >= 0) flush();
  }
}

// ---------------------------------------------------------------------------------------------------
// Selection.

struct SelectParams {
  float* ws;  // [vectors, nblocks]; rows longer than kSelectSmemBlocks are rewritten in place as keys
  int nblocks;
  bool in_smem;
  int heads;
  const int32_t* row_pos;
  int ib;
  int topk;
  int local;
  int init;
  int32_t* blocks;  // [vectors, topk]
  int32_t* counts;  // [vectors] or null
};

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN: below -inf
  if (b == 0x80000000u) b = 0u;                   // -0 ties with +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sum of one int per thread over the CTA. `buf`: kWarps ints, not touched by the previous call (callers
// alternate two buffers: a thread can only reuse one after everyone passed the barrier in between).
__device__ __forceinline__ int block_sum(int v, int* buf) {
  v = int(__reduce_add_sync(0xffffffffu, unsigned(v)));
  if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += buf[w];
  return total;
}

__global__ void __launch_bounds__(kThreads, 4) select_kernel(const SelectParams p) {
  extern __shared__ uint32_t smem_keys[];
  __shared__ int sums[2][kWarps];
  __shared__ int warp_gt[kWarps], warp_eq[kWarps], warp_kept[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t v = blockIdx.x;
  const int k = p.topk;
  int32_t* out = p.blocks + v * k;
  const int pos = p.row_pos[v / p.heads];
  if (pos < 0) {  // a padding row keeps nothing
    for (int i = tid; i < k; i += kThreads) out[i] = -1;
    if (p.counts && tid == 0) p.counts[v] = 0;
    return;
  }
  const int n = min(pos / p.ib + 1, p.nblocks);  // blocks the row sees
  float* scores = p.ws + v * int64_t(p.nblocks);
  uint32_t* keys = p.in_smem ? smem_keys : reinterpret_cast<uint32_t*>(scores);
  for (int i = tid; i < n; i += kThreads) keys[i] = order_key(scores[i]);
  __syncthreads();
  // select_blocks: the local blocks newest - l (clamped at 0) and the init blocks 0 .. init - 1 get +inf.
  if (tid == 0)
    for (int l = 0; l < min(p.local, n); ++l) keys[max(n - 1 - l, 0)] = kKeyPosInf;
  for (int i = tid; i < min(p.init, n); i += kThreads) keys[i] = kKeyPosInf;
  __syncthreads();

  // T: the k-th largest key (0 when every block is kept: all keys are >= 0).
  uint32_t thr = 0u;
  if (n > k) {
#pragma unroll 1
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = thr | (1u << bit);
      int c = 0;
      for (int i = tid; i < n; i += kThreads) c += keys[i] >= cand;
      if (block_sum(c, sums[bit & 1]) >= k) thr = cand;
    }
  }

  // Warp w owns blocks [w * span, (w + 1) * span), walked 32 at a time in index order.
  const int span = (n + kWarps * 32 - 1) / (kWarps * 32) * 32;
  const int lo = warp * span, hi = min(n, lo + span);
  const unsigned lt = (1u << lane) - 1u;
  int gt = 0, eq = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < hi ? keys[i] : 0u;
    gt += __popc(__ballot_sync(0xffffffffu, i < hi && key > thr));
    eq += __popc(__ballot_sync(0xffffffffu, i < hi && key == thr));
  }
  if (lane == 0) warp_gt[warp] = gt, warp_eq[warp] = eq;
  __syncthreads();
  int total_gt = 0, eq_before = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    total_gt += warp_gt[w];
    if (w < warp) eq_before += warp_eq[w];
  }
  // Of the keys equal to T, the first `take` in index order are kept (ties to the smaller block id).
  const int take = n > k ? k - total_gt : INT_MAX;

  // Two walks: count what this warp keeps, then write it at its place in ascending order.
  int kept_before = 0, total_kept = 0;
#pragma unroll 1
  for (int phase = 0; phase < 2; ++phase) {
    int eq_seen = eq_before, kept = 0;
    for (int base = lo; base < hi; base += 32) {
      const int i = base + lane;
      const uint32_t key = i < hi ? keys[i] : 0u;
      const bool is_eq = i < hi && key == thr;
      const unsigned eq_mask = __ballot_sync(0xffffffffu, is_eq);
      const bool sel = i < hi && (key > thr || (is_eq && eq_seen + __popc(eq_mask & lt) < take));
      // select_blocks drops blocks whose score is -inf (no visible key scored a number).
      const unsigned keep = __ballot_sync(0xffffffffu, sel && key != kKeyNegInf);
      if (phase == 1 && (keep >> lane & 1u)) out[kept_before + kept + __popc(keep & lt)] = i;
      kept += __popc(keep);
      eq_seen += __popc(eq_mask);
    }
    if (phase == 0) {
      if (lane == 0) warp_kept[warp] = kept;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        total_kept += warp_kept[w];
        if (w < warp) kept_before += warp_kept[w];
      }
    }
  }
  for (int i = total_kept + tid; i < k; i += kThreads) out[i] = -1;
  if (p.counts && tid == 0) p.counts[v] = total_kept;
}

// ---------------------------------------------------------------------------------------------------
// Host side.

int blocks_of(int64_t max_position, int ib) { return int(std::max<int64_t>(max_position, 0) / ib + 1); }

// Rows per launch pair: the block scores stay under kWorkspaceCap, and the score grid's y dimension
// (vector chunks of >= 8) under 65536.
int64_t rows_per_chunk(int64_t rows, int heads, int nblocks) {
  const int64_t per_row = int64_t(heads) * nblocks * int64_t(sizeof(float));
  int64_t cr = std::max<int64_t>(1, kWorkspaceCap / per_row);
  cr = std::min<int64_t>(cr, int64_t(65535) * 8 / heads);
  return std::min(rows, cr);
}

// bf16 words one 16-byte load of a format's raw key bytes covers: bf16 4 (8 dims), FP8 8, FP4 16.
constexpr int wide_vec(PageFormat f) { return f == PageFormat::BFloat16 ? 4 : f == PageFormat::Fp8Rows ? 8 : 16; }

struct Variant {
  int ks, vec;
};

// (k-steps, words per load) for a dim: exact tilings for 16 (the test fixture), 128 (MiniMax-M3.1) and
// 256, with 16-byte loads of raw key bytes; any other multiple of 8 pads to 256 dims and loads single
// words.
Variant variant_for(int dim, PageFormat format) {
  if (dim == 16) return {1, 2};
  if (dim == 128) return {8, wide_vec(format)};
  if (dim == 256) return {16, wide_vec(format)};
  return {16, 1};
}

template <int KS, int VEC, int NT, int MTI, PageFormat F>
void launch_scores(const ScoreParams& p, cudaStream_t stream) {
  const int per_cta = kWarps / p.chunks_per_cta;
  const dim3 grid{unsigned((p.splits + per_cta - 1) / per_cta),
                  unsigned((p.chunks + p.chunks_per_cta - 1) / p.chunks_per_cta), 1u};
  block_scores_kernel<KS, VEC, NT, MTI, F><<<grid, kThreads, 0, stream>>>(p);
}

template <int KS, int VEC, PageFormat F>
void launch_scores_tiled(ScoreParams p, bool prefill, cudaStream_t stream) {
  // Prefill: 32 vectors per warp (16 at KS = 16, whose fragments are twice as large); Decode: 8.
  constexpr int kWideNT = KS >= 16 ? 2 : 4;
  constexpr int kMTI = KS >= 16 ? 1 : 2;
  const int nt = prefill ? kWideNT : 1;
  p.chunks = (p.vectors + nt * 8 - 1) / (nt * 8);
  p.chunks_per_cta = prefill ? kWarps : 1;
  // Enough warps to fill the chip several times over, each walking >= kMinKeysPerWarp keys.
  const int64_t target_warps = int64_t(sm_count()) * 32;
  const int64_t splits_wanted = std::max<int64_t>(1, target_warps / p.chunks);
  const int64_t min_blocks = std::max<int64_t>(1, (kMinKeysPerWarp + p.ib - 1) / p.ib);
  const int64_t per = std::max<int64_t>((p.nblocks + splits_wanted - 1) / splits_wanted, min_blocks);
  p.blocks_per_split = int(per);
  p.splits = int((p.nblocks + per - 1) / per);
  if (prefill)
    launch_scores<KS, VEC, kWideNT, kMTI, F>(p, stream);
  else
    launch_scores<KS, VEC, 1, kMTI, F>(p, stream);
}

template <PageFormat F>
void launch_scores_for(const Variant& var, const ScoreParams& p, bool prefill, cudaStream_t stream) {
  constexpr int W = wide_vec(F);
  if (var.ks == 1)
    launch_scores_tiled<1, 2, F>(p, prefill, stream);
  else if (var.ks == 8)
    launch_scores_tiled<8, W, F>(p, prefill, stream);
  else if (var.vec == W)
    launch_scores_tiled<16, W, F>(p, prefill, stream);
  else
    launch_scores_tiled<16, 1, F>(p, prefill, stream);
}


int fp4_blocks(PageFormat f, int dim) { return (dim + fp4_block(f) - 1) / fp4_block(f); }

}  // namespace

int64_t msa_key_bytes(PageFormat format, int dim) {
  switch (format) {
    case PageFormat::BFloat16: return int64_t(dim) * 2;
    case PageFormat::Fp8Rows: return dim;
    case PageFormat::Nvfp4Rows:
    case PageFormat::Mxfp4Rows: return dim / 2 + fp4_blocks(format, dim);
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  fail("msa_key_bytes: unknown key format ", int(format));
}

void msa_write_keys(const void* keys_bf16, int64_t count, int dim, const int32_t* token_seq,
                    const int32_t* token_pos, const int64_t* page_table, int64_t page_table_stride,
                    int block_size, uint8_t* pool, PageFormat format, cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && block_size > 0, "msa_write_keys: bad count ", count, " or block_size ", block_size);
  SPARROW_CHECK(dim > 0 && dim % 8 == 0, "msa_write_keys: dim ", dim, " must be a positive multiple of 8");
  SPARROW_CHECK(reinterpret_cast<uintptr_t>(keys_bf16) % 16 == 0, "msa_write_keys: keys must be 16-byte aligned");
  SPARROW_CHECK(msa_reads_key_format(format), "msa_write_keys: index keys in a page format it does not write (", int(format), ")");
  if (count == 0) return;
  const int pieces = dim / 8;
  const auto* keys = static_cast<const uint4*>(keys_bf16);
  auto grid = [](int64_t threads) { return unsigned((threads + 255) / 256); };
  switch (format) {
    case PageFormat::BFloat16:
      write_keys_kernel<<<grid(count * pieces), 256, 0, stream>>>(keys, count, pieces, token_seq, token_pos, page_table,
                                                                  page_table_stride, block_size, pool);
      break;
    case PageFormat::Fp8Rows:
      write_keys_fp8_kernel<<<grid(count * pieces), 256, 0, stream>>>(keys, count, pieces, token_seq, token_pos,
                                                                      page_table, page_table_stride, block_size, pool);
      break;
    case PageFormat::Nvfp4Rows: {
      const int nb = fp4_blocks(format, dim);
      write_keys_fp4_kernel<PageFormat::Nvfp4Rows><<<grid(count * nb), 256, 0, stream>>>(
          keys, count, dim, nb, token_seq, token_pos, page_table, page_table_stride, block_size, pool);
      break;
    }
    case PageFormat::Mxfp4Rows: {
      const int nb = fp4_blocks(format, dim);
      write_keys_fp4_kernel<PageFormat::Mxfp4Rows><<<grid(count * nb), 256, 0, stream>>>(
          keys, count, dim, nb, token_seq, token_pos, page_table, page_table_stride, block_size, pool);
      break;
    }
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

size_t msa_select_workspace_bytes(int64_t rows, int index_heads, int64_t max_position, int ib) {
  if (rows <= 0 || index_heads <= 0 || ib <= 0) return 0;
  const int nb = blocks_of(max_position, ib);
  return size_t(rows_per_chunk(rows, index_heads, nb)) * index_heads * nb * sizeof(float);
}

void msa_select_blocks(const void* q_bf16, int64_t rows, int index_heads, int dim, const int32_t* row_seq,
                       const int32_t* row_pos, int64_t max_position, const uint8_t* pool, PageFormat key_format,
                       const int64_t* page_table, int64_t page_table_stride, int block_size, int ib,
                       int topk_blocks, int local_blocks, int init_blocks, int32_t* blocks, int32_t* counts,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream, MsaScoreKernel kernel) {
  SPARROW_CHECK(index_heads >= 1 && index_heads <= kMsaMaxHeads, "msa_select_blocks: index_heads ", index_heads,
                " not in 1..", kMsaMaxHeads);
  SPARROW_CHECK(dim > 0 && dim % 8 == 0 && dim <= kMsaMaxDim, "msa_select_blocks: dim ", dim,
                " must be a positive multiple of 8 up to ", kMsaMaxDim);
  SPARROW_CHECK(topk_blocks >= 1 && topk_blocks <= kMsaMaxTopkBlocks, "msa_select_blocks: topk_blocks ",
                topk_blocks, " not in 1..", kMsaMaxTopkBlocks);
  SPARROW_CHECK(ib >= 1 && local_blocks >= 0 && init_blocks >= 0 && block_size > 0, "msa_select_blocks: bad ib ", ib,
                ", local_blocks ", local_blocks, ", init_blocks ", init_blocks, " or block_size ", block_size);
  SPARROW_CHECK(max_position + ib + 64 < int64_t(INT_MAX), "msa_select_blocks: max_position ", max_position,
                " too large");
  SPARROW_CHECK(reinterpret_cast<uintptr_t>(q_bf16) % 16 == 0, "msa_select_blocks: queries must be 16-byte aligned");
  SPARROW_CHECK(msa_reads_key_format(key_format), "msa_select_blocks: index keys in a page format it does not read (", int(key_format), ")");
  if (rows <= 0) return;
  SPARROW_CHECK(workspace_bytes >= msa_select_workspace_bytes(rows, index_heads, max_position, ib),
                "msa_select_blocks: workspace of ", workspace_bytes, " bytes, ",
                msa_select_workspace_bytes(rows, index_heads, max_position, ib), " needed");
  const int nb = blocks_of(max_position, ib);
  const int64_t chunk_rows = rows_per_chunk(rows, index_heads, nb);
  // Batch-invariant mode (core/batch_invariance.h): the decode tiling for every row count, so that a
  // query's block scores do not depend on how many rows its step selects for.
  const bool prefill = kernel == MsaScoreKernel::Prefill ||
                       (kernel == MsaScoreKernel::Auto && rows > kMsaDecodeMaxRows && !batch_invariant());
  const Variant var = variant_for(dim, key_format);
  float* ws = static_cast<float*>(workspace);
  const bool in_smem = nb <= kSelectSmemBlocks;
  const size_t select_smem = in_smem ? size_t(nb) * sizeof(uint32_t) : 0;

  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t cr = std::min(chunk_rows, rows - r0);
    const int64_t vectors = cr * index_heads;
    ScoreParams sp{};
    sp.q = static_cast<const uint8_t*>(q_bf16) + r0 * index_heads * int64_t(dim) * 2;
    sp.vectors = vectors;
    sp.heads = index_heads;
    sp.dim = dim;
    sp.row_seq = row_seq + r0;
    sp.row_pos = row_pos + r0;
    sp.pool = pool;
    sp.page_table = page_table;
    sp.stride = page_table_stride;
    sp.block_size = block_size;
    sp.key_bytes = key_format == PageFormat::BFloat16 ? dim * 2 : key_format == PageFormat::Fp8Rows ? dim : dim / 2;
    sp.scale_base = int64_t(block_size) * (dim / 2);  // FP4: the page's scales follow all its codes
    sp.scale_bytes = is_fp4(key_format) ? fp4_blocks(key_format, dim) : 0;
    sp.ib = ib;
    sp.nblocks = nb;
    sp.ws = ws;
    switch (key_format) {
      case PageFormat::BFloat16: launch_scores_for<PageFormat::BFloat16>(var, sp, prefill, stream); break;
      case PageFormat::Fp8Rows: launch_scores_for<PageFormat::Fp8Rows>(var, sp, prefill, stream); break;
      case PageFormat::Nvfp4Rows: launch_scores_for<PageFormat::Nvfp4Rows>(var, sp, prefill, stream); break;
      case PageFormat::Mxfp4Rows: launch_scores_for<PageFormat::Mxfp4Rows>(var, sp, prefill, stream); break;
          default: break;  // a format these kernels do not read: refused below or at the entry
    }
    SPARROW_CUDA_CHECK_LAUNCH();

    const SelectParams sel{ws,          nb,         in_smem,   index_heads,
                           row_pos + r0, ib,        topk_blocks, local_blocks, init_blocks,
                           blocks + r0 * index_heads * topk_blocks, counts ? counts + r0 * index_heads : nullptr};
    select_kernel<<<unsigned(vectors), kThreads, select_smem, stream>>>(sel);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparrow::cuda
