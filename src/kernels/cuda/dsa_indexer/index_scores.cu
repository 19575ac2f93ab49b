// DSA lightning indexer kernels (see index_scores.h for the math and the cache layout).
//
// Scoring is a GEMM with M = query rows x heads, N = keys, K = 128, followed by relu, a weighted sum
// over heads and the key's scale. It runs on mma.sync m16n8k32 e4m3 (PTX ISA, "Matrix fragments for
// mma.m16n8k32" with 8-bit types): one warp owns 64 M-rows (one query row of 64 heads, or two rows of
// 32 heads) held in registers as A fragments for the whole launch, and streams keys 8 at a time as B
// fragments loaded straight from the page (each key's 128 bytes are contiguous, so a warp's 8 keys are
// 1 KB of consecutive memory when the page holds them in order).
//
// The dot product over K is invariant under any permutation of K applied to both operands, so instead
// of the fragment's k order (thread t holds k = 4t..4t+3 and 16+4t..16+4t+3 of each 32-wide step) lane
// t loads 32 contiguous bytes of its row (dims 32t .. 32t+31) with two 16-byte loads and feeds step s
// with dims 32t+8s .. 32t+8s+7: A and B use the same mapping, so every product pairs equal dims.
//
// MXFP4 keys take the same path: lane t loads the 16 code bytes of dims 32t .. 32t+31 (one MXFP4 block) and
// the key's scale word, and widens them to the same 32 e4m3 bytes in registers (fp4_keys.cuh: exact, relative
// to a power of two per key that multiplies like an FP8 key's scale). NVFP4 keys (16-bit products) are
// scored by the wgmma kernel for every row count (index_scores.h).
//
// The key writes quantise in the same launch as the copy into the page: FP8 (amax / 448 per token), MXFP4
// and NVFP4 through the device twins of the CPU codecs (kernels/cuda/quant/fp4.cuh), byte for byte.
#include "kernels/cuda/dsa_indexer/index_scores.h"

#include "kernels/cuda/dsa_indexer/decode_scores.cuh"
#include "kernels/cuda/dsa_indexer/fp4_keys.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "core/batch_invariance.h"
#include "core/error.h"
#include "core/device/sm_count.h"
#include "kernels/cuda/paged.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

constexpr int kDim = kDsaIndexDim;

__device__ __forceinline__ float load_elem(const void* p, DsaDType type, int64_t i) {
  return type == DsaDType::F32 ? static_cast<const float*>(p)[i]
                               : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

// One warp quantises one 128-vector: lane i holds dims 4i..4i+3. Returns the scale (amax / 448) and
// the four codes packed little-endian (dim 4i in the low byte).
__device__ __forceinline__ uint32_t quantize_row(const void* src, DsaDType type, int64_t base, int lane,
                                                 float& scale) {
  float v[4];
  if (type == DsaDType::F32) {
    float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(src) + base + lane * 4);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = load_elem(src, type, base + lane * 4 + i);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  scale = amax / 448.0f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // x / scale (IEEE division) so a CPU reference reproduces the codes exactly; zero rows stay zero.
    float x = scale > 0.0f ? __fdiv_rn(v[i], scale) : 0.0f;
    packed |= uint32_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  return packed;
}

__global__ void write_keys_kernel(const void* keys, DsaDType type, int64_t count, const int32_t* token_seq,
                                  const int32_t* token_pos, const int64_t* page_table, int64_t stride,
                                  int block_size, uint8_t* pool) {
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (token >= count) return;
  float scale;
  uint32_t packed = quantize_row(keys, type, token * kDim, lane, scale);
  const PagedSlot at = paged_slot(pool, page_table, stride, token_seq[token], token_pos[token], block_size);
  uint8_t* base = at.page;
  const int64_t slot = at.slot;
  reinterpret_cast<uint32_t*>(base + slot * kDim)[lane] = packed;
  if (lane == 0) reinterpret_cast<float*>(base + int64_t(block_size) * kDim)[slot] = scale;
}

// One warp writes one key in a 4-bit format (page_codec.cpp's Fp4RowsCodec, kernels/cpu/fp4_codec.h): lane i
// holds dims 4i .. 4i+3, so an MXFP4 block (32 values) is 8 lanes and an NVFP4 block (16) 4 lanes; the block
// scale comes from a shuffle reduction over them, the codes from the device twins (quant/fp4.cuh).
template <PageFormat F>
__global__ void write_fp4_keys_kernel(const void* keys, DsaDType type, int64_t count, const int32_t* token_seq,
                                      const int32_t* token_pos, const int64_t* page_table, int64_t stride,
                                      int block_size, uint8_t* pool) {
  constexpr bool kMx = F == PageFormat::Mxfp4Rows;
  const int64_t token = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (token >= count) return;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = load_elem(keys, type, token * kDim + lane * 4 + i);
  // fmaxf leaves NaNs out of the amax, as the CPU codecs do (std::fmax for NVFP4; MXFP4 blocks holding a
  // NaN or an infinity get the NaN scale whatever their amax).
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 1; o < (kMx ? 8 : 4); o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  uint32_t codes = 0, scale;
  if constexpr (kMx) {
    const bool finite = isfinite(v[0]) && isfinite(v[1]) && isfinite(v[2]) && isfinite(v[3]);
    const unsigned bad = __ballot_sync(0xffffffffu, !finite);
    scale = quant::mxfp4_scale(amax, ((bad >> (lane & ~7)) & 0xFFu) != 0u);
    if (scale != quant::kE8m0Nan) {  // a NaN-scale block keeps codes 0
      const float inverse = quant::mxfp4_inverse(uint8_t(scale));
#pragma unroll
      for (int i = 0; i < 4; ++i) codes |= quant::mxfp4_encode(v[i], inverse) << (4 * i);
    }
  } else {
    scale = quant::nvfp4_scale(amax, 1.0f);  // second-level scale kKvTensorScale = 1.0 (cache/page_codec.h)
    const float step = quant::nvfp4_step(uint8_t(scale), 1.0f);
#pragma unroll
    for (int i = 0; i < 4; ++i) codes |= quant::nvfp4_encode(v[i], step) << (4 * i);
  }
  const PagedSlot at = paged_slot(pool, page_table, stride, token_seq[token], token_pos[token], block_size);
  uint8_t* base = at.page;
  const int64_t slot = at.slot;
  // Dims 4i .. 4i+3 are code bytes 2i, 2i+1 (element 2k in the low nibble).
  reinterpret_cast<uint16_t*>(base + slot * dsa::kFp4CodeBytes)[lane] = uint16_t(codes);
  // The block scales, block b held by lane 8b (MXFP4) or 4b (NVFP4), gathered into lane 0's words.
  uint32_t words[2] = {0u, 0u};
#pragma unroll
  for (int b = 0; b < (kMx ? 4 : 8); ++b)
    words[b / 4] |= (__shfl_sync(0xffffffffu, scale, b * (kMx ? 8 : 4)) & 0xFFu) << (8 * (b % 4));
  uint8_t* scales = base + int64_t(block_size) * dsa::kFp4CodeBytes + slot * dsa::fp4_scale_bytes(F);
  if (lane == 0) {
    if constexpr (kMx) *reinterpret_cast<uint32_t*>(scales) = words[0];
    else *reinterpret_cast<uint2*>(scales) = make_uint2(words[0], words[1]);
  }
}

__global__ void quantize_queries_kernel(const void* q, DsaDType type, const float* weights, float weight_scale,
                                        int64_t vectors, uint8_t* q_fp8, float* w_folded) {
  const int64_t v = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (v >= vectors) return;
  float scale;
  uint32_t packed = quantize_row(q, type, v * kDim, lane, scale);
  reinterpret_cast<uint32_t*>(q_fp8 + v * kDim)[lane] = packed;
  if (lane == 0) w_folded[v] = __fmul_rn(weights[v], weight_scale) * scale;
}

__global__ void encode_kernel(const float* x, int64_t n, uint8_t* out) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct ScoreParams : IndexScoreArgs {
  int64_t groups;        // ceil(rows / rows_per_group)
  int groups_per_cta;    // warps of a CTA on different groups (same keys)
  int64_t keys_per_cta;  // multiple of 32 * (warps / groups_per_cta)
};

constexpr int kWarps = 4;
constexpr int kNT = 2;                 // n-tiles of 8 keys per warp iteration
constexpr int kTileKeys = 8 * kNT;

// HEADS = 64: a warp's 64 M-rows are one query row; HEADS = 32: two consecutive rows. MX: MXFP4 keys
// (widened to e4m3 in registers), else FP8 keys.
template <int HEADS, bool MX>
__global__ void __launch_bounds__(kWarps * 32, 3) index_scores_kernel(ScoreParams p) {
  constexpr int R = 64 / HEADS;    // query rows per warp group
  constexpr int TPR = HEADS / 16;  // m-tiles per query row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int gpc = p.groups_per_cta, kpc = kWarps / gpc;
  const int64_t group = int64_t(blockIdx.y) * gpc + warp % gpc;
  const int kslice = warp / gpc;
  if (group >= p.groups) return;
  const int64_t r0 = group * R;

  bool valid[R];
  int seq[R];
  int64_t vis[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    valid[j] = r0 + j < p.rows;
    seq[j] = valid[j] ? p.row_seq[r0 + j] : 0;
    vis[j] = valid[j] ? p.row_visible[r0 + j] : 0;
  }

  // A fragments: a[mt][half][word], half 0 = M-row mt*16+g, half 1 = M-row mt*16+g+8; word w holds
  // dims 32t+4w .. 32t+4w+3. Weights of the same two M-rows.
  uint32_t a[4][2][8];
  float wt[4][2];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = mt * 16 + g + h * 8;
      const bool ok = valid[mt / TPR];
      if (ok) {
        const uint4* src = reinterpret_cast<const uint4*>(p.q + (r0 * HEADS + m) * kDim + t * 32);
        uint4 x0 = src[0], x1 = src[1];
        a[mt][h][0] = x0.x, a[mt][h][1] = x0.y, a[mt][h][2] = x0.z, a[mt][h][3] = x0.w;
        a[mt][h][4] = x1.x, a[mt][h][5] = x1.y, a[mt][h][6] = x1.z, a[mt][h][7] = x1.w;
        wt[mt][h] = p.w[r0 * HEADS + m];
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) a[mt][h][i] = 0;
        wt[mt][h] = 0.0f;
      }
    }
  }

  const int64_t k_begin = int64_t(blockIdx.x) * p.keys_per_cta;
  const int64_t k_end = min(k_begin + p.keys_per_cta, p.max_visible);

  // Two rows of one warp group that belong to different sequences read different keys: run them one
  // after the other (only possible with HEADS = 32, e.g. decode with one query token per sequence).
  int npass = 1;
  unsigned pass_mask[2] = {0u, 0u};
  if (R == 1 || !valid[R - 1] || seq[0] == seq[R - 1]) {
    pass_mask[0] = R == 1 ? 1u : (valid[R - 1] ? 3u : 1u);
  } else {
    npass = 2;
    pass_mask[0] = 1u;
    pass_mask[1] = 2u;
  }

#pragma unroll 1
  for (int pass = 0; pass < npass; ++pass) {
    const unsigned mask = pass_mask[pass];
    const int first = (mask & 1u) ? 0 : 1;
    const int64_t* ptab = p.page_table + int64_t(seq[first]) * p.stride;
    int64_t vmax = 0;
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (mask & (1u << j)) vmax = max(vmax, vis[j]);
    float wp[4][2];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) wp[mt][h] = (mask & (1u << (mt / TPR))) ? wt[mt][h] : 0.0f;

#pragma unroll 1
    for (int64_t kb = k_begin + int64_t(kslice) * kTileKeys; kb < k_end; kb += int64_t(kpc) * kTileKeys) {
      float res[kNT][R][2];
      if (kb < vmax) {
        // Load kNT n-tiles of keys: lane (g, t) loads key kb + nt*8 + g, dims 32t .. 32t+31 (FP8: 32 bytes;
        // MXFP4: 16 code bytes and the key's 4 scale bytes), and that key's scale. All loads are issued
        // before the first widening.
        uint4 b[kNT][2];
        uint32_t mx_scales[kNT];
        float ksc[kNT];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int64_t key = kb + nt * 8 + g;
          if (key < vmax) {
            const int64_t page = key / p.block_size;
            const int64_t slot = key - page * p.block_size;
            const uint8_t* base = p.pool + ptab[page];
            if constexpr (MX) {
              b[nt][0] = *reinterpret_cast<const uint4*>(base + slot * dsa::kFp4CodeBytes + t * 16);
              const uint8_t* scales = base + int64_t(p.block_size) * dsa::kFp4CodeBytes;
              mx_scales[nt] = reinterpret_cast<const uint32_t*>(scales)[slot];
            } else {
              const uint4* src = reinterpret_cast<const uint4*>(base + slot * kDim + t * 32);
              b[nt][0] = src[0];
              b[nt][1] = src[1];
              ksc[nt] = reinterpret_cast<const float*>(base + int64_t(p.block_size) * kDim)[slot];
            }
          } else {
            b[nt][0] = make_uint4(0, 0, 0, 0);
            b[nt][1] = make_uint4(0, 0, 0, 0);
            mx_scales[nt] = 0u;  // zero codes and a finite factor: scores 0, stored as -inf past the bound
            ksc[nt] = 0.0f;
          }
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          uint32_t bw[8];
          if constexpr (MX) {
            dsa::mxfp4_widen_block(b[nt][0], mx_scales[nt], t, bw, ksc[nt]);  // word w: dims 32t + 4w .. + 3
          } else {
            bw[0] = b[nt][0].x, bw[1] = b[nt][0].y, bw[2] = b[nt][0].z, bw[3] = b[nt][0].w;
            bw[4] = b[nt][1].x, bw[5] = b[nt][1].y, bw[6] = b[nt][1].z, bw[7] = b[nt][1].w;
          }
          float acc[4][4];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][i] = 0.0f;
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
              mma_e4m3(acc[mt], a[mt][0][2 * s], a[mt][1][2 * s], a[mt][0][2 * s + 1], a[mt][1][2 * s + 1],
                       bw[2 * s], bw[2 * s + 1]);
          // C fragment: acc[mt][0..1] = M-row mt*16+g, keys 2t, 2t+1; acc[mt][2..3] = M-row +8.
          float part[R][2];
#pragma unroll
          for (int j = 0; j < R; ++j) part[j][0] = part[j][1] = 0.0f;
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            const int j = mt / TPR;
            part[j][0] += wp[mt][0] * fmaxf(acc[mt][0], 0.0f) + wp[mt][1] * fmaxf(acc[mt][2], 0.0f);
            part[j][1] += wp[mt][0] * fmaxf(acc[mt][1], 0.0f) + wp[mt][1] * fmaxf(acc[mt][3], 0.0f);
          }
          // Sum over the 8 lanes that share t (the M-rows g = 0..7).
#pragma unroll
          for (int j = 0; j < R; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int o = 4; o < 32; o <<= 1) part[j][e] += __shfl_xor_sync(0xffffffffu, part[j][e], o);
          const float s0 = __shfl_sync(0xffffffffu, ksc[nt], (2 * t) * 4);
          const float s1 = __shfl_sync(0xffffffffu, ksc[nt], (2 * t + 1) * 4);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            res[nt][j][0] = part[j][0] * s0;
            res[nt][j][1] = part[j][1] * s1;
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int j = 0; j < R; ++j) res[nt][j][0] = res[nt][j][1] = 0.0f;
      }
      // Lanes with g = nt store n-tile nt: 4 * kNT lanes write 8 * kNT consecutive scores per row.
      if (g < kNT) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (!(mask & (1u << j))) continue;
          float v0 = res[0][j][0], v1 = res[0][j][1];
#pragma unroll
          for (int nt = 1; nt < kNT; ++nt)
            if (g == nt) v0 = res[nt][j][0], v1 = res[nt][j][1];
          const int64_t col = kb + g * 8 + 2 * t;
          const float ninf = -INFINITY;
          if (col >= vis[j]) v0 = ninf;
          if (col + 1 >= vis[j]) v1 = ninf;
          float* dst = p.scores + (r0 + j) * p.ld + col;
          if (col + 1 < k_end) {
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
          } else if (col < k_end) {
            dst[0] = v0;
          }
        }
      }
    }
  }
}

}  // namespace

const char* dsa_key_format_name(PageFormat format) {
  switch (format) {
    case PageFormat::Fp8IndexKey: return "fp8";
    case PageFormat::Mxfp4Rows: return "mxfp4";
    case PageFormat::Nvfp4Rows: return "nvfp4";
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  return "?";
}

void dsa_write_keys(const void* keys, DsaDType type, int64_t count, const int32_t* token_seq,
                    const int32_t* token_pos, const int64_t* page_table, int64_t page_table_stride,
                    int block_size, PageFormat format, uint8_t* pool, cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && block_size > 0, "dsa_write_keys: bad count ", count, " or block_size ", block_size);
  SPARROW_CHECK(dsa_reads_key_format(format), "dsa_write_keys: index keys in a page format it does not write (",
                int(format), ")");
  if (count == 0) return;
  constexpr int kPerBlock = 8;
  const unsigned blocks = unsigned((count + kPerBlock - 1) / kPerBlock);
  switch (format) {
    case PageFormat::Fp8IndexKey:
      write_keys_kernel<<<blocks, kPerBlock * 32, 0, stream>>>(keys, type, count, token_seq, token_pos, page_table,
                                                               page_table_stride, block_size, pool);
      break;
    case PageFormat::Mxfp4Rows:
      write_fp4_keys_kernel<PageFormat::Mxfp4Rows><<<blocks, kPerBlock * 32, 0, stream>>>(
          keys, type, count, token_seq, token_pos, page_table, page_table_stride, block_size, pool);
      break;
    case PageFormat::Nvfp4Rows:
      write_fp4_keys_kernel<PageFormat::Nvfp4Rows><<<blocks, kPerBlock * 32, 0, stream>>>(
          keys, type, count, token_seq, token_pos, page_table, page_table_stride, block_size, pool);
      break;
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

void dsa_quantize_queries(const void* q, DsaDType type, const float* weights, int64_t rows, int heads,
                          uint8_t* q_fp8, float* w_folded, cudaStream_t stream, float weight_scale) {
  SPARROW_CHECK(rows >= 0 && heads > 0, "dsa_quantize_queries: bad rows ", rows, " or heads ", heads);
  const int64_t vectors = rows * heads;
  if (vectors == 0) return;
  constexpr int kPerBlock = 8;
  quantize_queries_kernel<<<unsigned((vectors + kPerBlock - 1) / kPerBlock), kPerBlock * 32, 0, stream>>>(
      q, type, weights, weight_scale, vectors, q_fp8, w_folded);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void dsa_index_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads,
                      const int32_t* row_seq, const int32_t* row_visible, const uint8_t* pool,
                      const int64_t* page_table, int64_t page_table_stride, int block_size, PageFormat format,
                      float* scores, int64_t ld, int64_t max_visible, cudaStream_t stream, DsaScoreKernel kernel,
                      int rows_per_sequence) {
  SPARROW_CHECK(heads == 32 || heads == 64, "dsa_index_scores: heads must be 32 or 64, got ", heads);
  SPARROW_CHECK(block_size > 0, "dsa_index_scores: bad block_size ", block_size);
  SPARROW_CHECK(dsa_reads_key_format(format), "dsa_index_scores: index keys in a page format it does not read (",
                int(format), ")");
  SPARROW_CHECK(ld >= max_visible && ld % 2 == 0, "dsa_index_scores: ld ", ld, " must be even and >= max_visible ",
                max_visible);
  if (rows <= 0 || max_visible <= 0) return;
  const int sms = sm_count();
  const bool fp4 = format != PageFormat::Fp8IndexKey;
  SPARROW_CHECK(!(kernel == DsaScoreKernel::Tiles && format == PageFormat::Nvfp4Rows),
                "dsa_index_scores: the tiled kernel reads fp8 and mxfp4 keys; nvfp4 keys take the wgmma kernel");
  // Batch-invariant mode (core/batch_invariance.h): the wgmma kernel for every row count, so that a query's
  // scores do not depend on how many rows its step scores (the tiled kernel sums in another order).
  const bool wgmma = kernel == DsaScoreKernel::Wgmma ||
                     (kernel == DsaScoreKernel::Auto && (fp4 || rows <= kDsaWgmmaMaxRows || batch_invariant()));
  if (wgmma) {
    dsa_decode_scores(q_fp8, w_folded, rows, heads, row_seq, row_visible, pool, page_table, page_table_stride,
                      block_size, format, scores, ld, max_visible, rows_per_sequence, sms, stream);
    return;
  }
  ScoreParams p{{q_fp8, w_folded, rows, row_seq, row_visible, pool, page_table, page_table_stride, block_size, scores,
                 ld, max_visible},
                0,
                1,
                0};
  const int rows_per_group = 64 / heads;
  p.groups = (rows + rows_per_group - 1) / rows_per_group;
  // Many groups (prefill, large decode batches): 4 groups per CTA share each key tile through L1.
  // Few groups (small decode batches): the CTA's 4 warps split its keys.
  p.groups_per_cta = p.groups >= 64 ? kWarps : 1;
  const int kpc = kWarps / p.groups_per_cta;
  const int64_t group_blocks = (p.groups + p.groups_per_cta - 1) / p.groups_per_cta;
  // Enough CTAs to fill the chip several times over, each warp walking >= 64 keys (its A fragments,
  // 8 KB per group, are loaded once per CTA).
  const int64_t target_ctas = int64_t(sms) * 16;
  const int64_t splits_wanted = std::max<int64_t>(1, target_ctas / std::max<int64_t>(group_blocks, 1));
  const int64_t unit = int64_t(kTileKeys) * kpc;
  int64_t per = (max_visible + splits_wanted - 1) / splits_wanted;
  per = std::max<int64_t>(per, 64 * kpc);
  per = (per + unit - 1) / unit * unit;
  p.keys_per_cta = per;
  const int64_t splits = (max_visible + per - 1) / per;
  SPARROW_CHECK(group_blocks < 65536, "dsa_index_scores: too many rows (", rows, ")");
  const dim3 grid{unsigned(splits), unsigned(group_blocks), 1u};
  const bool mx = format == PageFormat::Mxfp4Rows;
  if (heads == 64) {
    if (mx) index_scores_kernel<64, true><<<grid, kWarps * 32, 0, stream>>>(p);
    else index_scores_kernel<64, false><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    if (mx) index_scores_kernel<32, true><<<grid, kWarps * 32, 0, stream>>>(p);
    else index_scores_kernel<32, false><<<grid, kWarps * 32, 0, stream>>>(p);
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

void fp8_e4m3_encode(const float* x, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (n <= 0) return;
  encode_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(x, n, out);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
