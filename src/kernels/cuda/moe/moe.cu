// Mixture of experts on the GPU.
//
// route_grouped_sigmoid: one warp per token, the exact steps of cpu::route_grouped_sigmoid
// (kernels/cpu/moe_reference.cpp) with cpu::top_k's order (larger first, NaN last, ties to the smaller index). exp is taken in double and
// rounded so the scores match glibc's expf; sums and quotients round like the CPU's (no FMA).
//
// moe_experts, all on the device and without a host round trip (so it can be captured in a graph):
//   1. counting sort of the tokens·top_k (token, slot) pairs by expert: per-expert counts (atomics),
//      offsets and a tile schedule (one block, a parallel scan), then each pair takes a slot in its expert's segment
//      (atomics); for the Decode path below, all of it in one block and one launch (decode_sort_kernel)
//      instead of four. The order of pairs inside a segment varies from run to run, but no result depends
//      on it: every output row of the products below is computed alone, in a fixed order over k, and
//      the final combine sums each token's slots in slot order.
//   2. one grouped product over all experts for gate_up with the activation fused into its epilogue:
//      h[pair] = act(x[token] · gate[e]ᵀ, x[token] · up[e]ᵀ) in bf16 (the rows of x are gathered by the
//      product's loader, no copy of x is made);
//   3. one grouped product for down: y[pair] = bf16(weight[pair] · (h[pair] · down[e]ᵀ));
//   4. out[t] = bf16(Σ_j y[pair(t, j)]) in fp32, slots in order.
// Steps 1 and 4 are shared; steps 2 and 3 take one of three paths, chosen on the host from the sizes
// alone (moe_experts_path in moe.h; the same for bf16, FP8 and packed weights):
//   - Decode (use_decode: at most 8 rows per expert on average, i.e. tokens·top_k <= 8·experts: decode
//     steps, DeepSeek-V3.2 and MiniMax-M3.1 up to 256 tokens, Kimi K3.1 Pro up to 896): skinny::kernel
//     (kernels/cuda/gemm/skinny.cuh, shared with the dense decode-sized products of gemm_skinny.h) with
//     the two jobs of dec:: below, a memory-bound streaming kernel. The schedule holds tiles of at most
//     one pass of rows (8, fewer at fewer tokens) per touched expert; a CTA takes (tile, group of output
//     rows), each warp 16 weight rows that it streams from HBM with 16-byte loads, 4 slabs in flight, the
//     tile's activation rows staged in shared memory, products on mma.sync m16n8k16 straight from
//     registers, fp32 accumulation; FP8
//     block scales are applied to each 128-column block's partial sum. Not bit-identical to the tiled
//     paths (moe.h says what each guarantees).
//   - Tiled (otherwise): a device-built list of 64-row tiles (expert, first row, end row); the grid is
//     sized by a host-side bound (pairs/64 + experts, at most pairs) and surplus blocks exit. Tiles use
//     bf16 tensor cores through WMMA (fp32 accumulation), 64x64x32 blocks, a 3-stage cp.async pipeline.
//   - Wgmma (prefill-sized steps: on average 32 or more rows per expert, hidden % 256 == 0, inter % 128
//     == 0): the products on wgmma over 128-row tiles (wg:: below, use_wgmma).
// Tiled and Wgmma round alike (bf16 operands and intermediates, fp32 accumulation) but may differ in the
// last bit, as any two summation orders do; so does Decode.
//
// moe_experts_fp8 is the same pipeline with e4m3 weights and 128x128 block scales (moe.h). On the Tiled
// path the e4m3 tiles and their scale are copied raw (half the bytes), and each k step dequantises its
// stage into a bf16 tile, bf16(e4m3 * scale), before the unchanged WMMA step. Every product therefore
// sees exactly the operands moe_experts would see on weights dequantised by dequantize_fp8_blocks, in
// the same order: bit-identical results, half the weight traffic. The wgmma path converts the same way,
// so the two functions stay bit-identical there too (both take the same path for a shape). The Decode
// path converts e4m3 to bf16 exactly (no scale) and scales each 128-column block's fp32 partial: within
// rounding of moe_experts on the dequantised weights, not bit-identical.
//
// moe_experts_packed (NVFP4 / MXFP4 / MXFP8 as released) reads the codes in place, on the same three paths
// for the same shapes: the Decode path turns them into bf16 times their group scale in registers
// (skinny.cuh fp4_to_bf16x2 and e8m0_bf16x2, exact); the Tiled (WMMA) and Wgmma kernels stage the raw code
// tiles and their group scales by cp.async and convert each stage into the bf16 tile (fp4_to_bf16x8; MXFP8
// e4m3 times the row's E8M0 scale), the exact dequantised values, so there too the products match
// moe_experts on the dequantised weights bit for bit (NVFP4 with global scales of 1; moe.h).
#include "kernels/cuda/moe/expert_lora.cuh"
#include "kernels/cuda/moe/moe.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/gemm/skinny.cuh"
#include "kernels/cuda/gemm/skinny_ordered.cuh"
#include "kernels/cuda/glu.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "core/batch_invariance.h"
#include "core/device/cuda_check.h"
#include "kernels/uniform_routing.h"

namespace sparrow::cuda {

namespace {

using bf16 = __nv_bfloat16;

// ------------------------------------------------------------------------------------------------
// Routing
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ bool better(float va, int32_t ia, float vb, int32_t ib) {
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

// (value, index) as one 64-bit key whose maximum is better()'s best: every number above NaN, larger values
// first, equal values (-0 and +0 too, NaN and NaN) to the smaller index. Key 0 is below every entry: taken.
__device__ __forceinline__ uint64_t selection_key(float v, int32_t i) {
  uint32_t u = 0;  // NaN
  if (!isnan(v)) {
    const uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
    u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // order-preserving, and > 0 (-inf maps to 0x007FFFFF)
  }
  return (uint64_t(u) << 32) | uint32_t(~uint32_t(i));  // ~i > 0 for any index below 2^31
}
__device__ __forceinline__ int32_t key_index(uint64_t key) { return int32_t(~uint32_t(key)); }

// The largest of the warp's keys (lane l holds keys[j] of entries l + 32 j); every lane gets it and the
// lane that holds it marks it taken (keys are distinct: their low halves are the indices).
template <int J>
__device__ __forceinline__ uint64_t warp_take_max(uint64_t (&keys)[J]) {
  uint64_t best = 0;
  int at = -1;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (keys[j] > best) best = keys[j], at = j;
  uint64_t top = best;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, top, o);
    top = other > top ? other : top;
  }
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (j == at && best == top) keys[j] = 0;
  return top;
}

// One warp a token; lane l holds the choices of experts l + 32 j (j < J, J * 32 >= num_experts) in
// registers, so each of the top_k (and topk_group) selections is a register scan and one warp maximum, not
// a pass over shared memory (the shared-memory form took 7 us for MiniMax's 128 experts, 20 us for
// DeepSeek's 256 on an H100: bench/results/kernels.md, "Small kernels at batch 1").
template <int J>
__global__ void route_kernel(const float* logits, const float* bias, int num_experts, int n_group, int topk_group,
                             int top_k, bool normalize, float normalize_eps, float scaling, int32_t* experts,
                             float* weights) {
  extern __shared__ float smem[];
  float* scores = smem;                              // [E]
  float* choice = scores + num_experts;              // [E] (the group scores read it)
  int32_t* chosen = reinterpret_cast<int32_t*>(choice + num_experts);      // [top_k]
  uint8_t* group_kept = reinterpret_cast<uint8_t*>(chosen + top_k);        // [n_group]
  const int lane = threadIdx.x;
  const int64_t t = blockIdx.x;
  const float* lr = logits + t * num_experts;
  // The logits and biases are all loaded before the first use: a use right after each load (under the
  // e < num_experts branch) made every load wait for the one before.
  float c[J], logit[J], bias_of[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    logit[j] = e < num_experts ? lr[e] : 0.0f;
    bias_of[j] = bias != nullptr && e < num_experts ? bias[e] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    c[j] = 0.0f;
    if (e < num_experts) {
      const float x = float(exp(-double(logit[j])));  // correctly rounded expf
      const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, x));
      scores[e] = s;
      c[j] = __fadd_rn(s, bias_of[j]);
      choice[e] = c[j];
    }
  }
  if (n_group > 1) {
    __syncwarp();
    // A group's score: the sum of its two best biased scores (cpu::top_k(group, 2), summed in rank order).
    const int per_group = num_experts / n_group;
    uint64_t group_keys[J];  // group l + 32 j (n_group <= num_experts)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int g = lane + 32 * j;
      group_keys[j] = 0;
      if (g >= n_group) continue;
      group_kept[g] = 0;
      const float* cg = choice + g * per_group;
      float v1 = __int_as_float(0x7fc00000), v2 = v1;
      int32_t i1 = 0x7fffffff, i2 = 0x7fffffff;
      for (int i = 0; i < per_group; ++i) {
        if (better(cg[i], i, v1, i1)) {
          v2 = v1, i2 = i1, v1 = cg[i], i1 = i;
        } else if (better(cg[i], i, v2, i2)) {
          v2 = cg[i], i2 = i;
        }
      }
      float sum = __fadd_rn(0.0f, v1);
      if (per_group > 1) sum = __fadd_rn(sum, v2);
      group_keys[j] = selection_key(sum, g);
    }
    __syncwarp();
    for (int k = 0; k < topk_group; ++k) {
      const uint64_t top = warp_take_max(group_keys);
      if (lane == 0) group_kept[key_index(top)] = 1;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < num_experts && !group_kept[e / per_group]) c[j] = -INFINITY;
    }
  }
  uint64_t keys[J];
#pragma unroll
  for (int j = 0; j < J; ++j) keys[j] = lane + 32 * j < num_experts ? selection_key(c[j], lane + 32 * j) : 0;
  for (int k = 0; k < top_k; ++k) {
    const uint64_t top = warp_take_max(keys);
    if (lane == 0) chosen[k] = key_index(top);
  }
  __syncwarp();
  // The weights: the normaliser sums the chosen scores in rank order 0, 1, ... (cpu::route's order).
  float sum = 0.0f;
  for (int k = 0; k < top_k; ++k) sum = __fadd_rn(sum, scores[chosen[k]]);
  for (int k = lane; k < top_k; k += 32) {
    const int32_t e = chosen[k];
    float w = scores[e];
    if (normalize) w = __fdiv_rn(w, __fadd_rn(sum, normalize_eps));
    experts[t * top_k + k] = e;
    weights[t * top_k + k] = __fmul_rn(w, scaling);
  }
}

// ------------------------------------------------------------------------------------------------
// Experts: sort, grouped products, combine
// ------------------------------------------------------------------------------------------------

constexpr int BM = 64, BN = 64, BK = 32, STAGES = 3, THREADS = 128;
constexpr int STAGES_FP8 = 4;  // pipeline depth with e4m3 weights (see SmemTiles<NB, true>)
constexpr int LDS = BK + 8;   // smem row pitch (bf16) of the A/B tiles: 80 B, breaks bank conflicts
constexpr int LDC = BN + 4;   // fp32 epilogue pitch

struct Tile {
  int32_t expert, begin, end;
};

__global__ void count_kernel(const int32_t* experts, int64_t pairs, int num_experts, int32_t* counts) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int e = experts[p];
    if (e >= 0 && e < num_experts) atomicAdd(&counts[e], 1);
  }
}

// Exclusive prefix sums over a block of THREADS threads of two per-thread values at once (a thread's rows
// and tiles): a shuffle scan inside each warp, then the earlier warps' totals (`warp_a`, `warp_b`: shared
// scratch of THREADS / 32 each). Every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ void block_exclusive_scan(int32_t& a, int32_t& b, int32_t* warp_a, int32_t* warp_b) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t ia = a, ib = b;  // inclusive scan inside the warp
  for (int o = 1; o < 32; o *= 2) {
    const int32_t ua = __shfl_up_sync(0xffffffffu, ia, o), ub = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += ua, ib += ub;
  }
  if (lane == 31) warp_a[warp] = ia, warp_b[warp] = ib;
  __syncthreads();
  a = ia - a, b = ib - b;  // exclusive, then the earlier warps' totals
  for (int w = 0; w < warp; ++w) a += warp_a[w], b += warp_b[w];
}

// One block (SCHEDULE_THREADS threads): offsets, cursors and the tile list, tiles of `bm` rows (BM for the
// WMMA products, wg::BM for the wgmma ones, one pass of the decode products: decode_tile_rows). The offsets are
// an exclusive scan of (rows, tiles) over the experts: thread i sums a contiguous run of experts, the
// block scans those sums (warp shuffles, then the 8 warp totals), and each thread writes its run's
// offsets. (A serial loop in one thread paid one L2 round trip per expert: ~0.1 us each, tens of us per
// call with 256-896 experts, as much as a decode step's whole product at one token.)
constexpr int SCHEDULE_THREADS = 256;
__global__ void __launch_bounds__(SCHEDULE_THREADS) schedule_kernel(const int32_t* counts, int num_experts, int bm,
                                                                    int32_t* cursor, Tile* tiles, int32_t* num_tiles,
                                                                    int32_t* tile_start) {
  __shared__ int32_t warp_rows[SCHEDULE_THREADS / 32], warp_tiles[SCHEDULE_THREADS / 32];
  const int tid = threadIdx.x;
  const int per = (num_experts + SCHEDULE_THREADS - 1) / SCHEDULE_THREADS;
  const int e0 = min(num_experts, tid * per), e1 = min(num_experts, e0 + per);
  int32_t own_rows = 0, own_tiles = 0;
  for (int e = e0; e < e1; ++e) {
    const int32_t c = counts[e];
    own_rows += c;
    own_tiles += (c + bm - 1) / bm;
  }
  int32_t off = own_rows, first_tile = own_tiles;
  block_exclusive_scan<SCHEDULE_THREADS>(off, first_tile, warp_rows, warp_tiles);
  for (int e = e0; e < e1; ++e) {
    cursor[e] = off;
    tile_start[e] = first_tile;
    off += counts[e];
    first_tile += (counts[e] + bm - 1) / bm;
  }
  if (tid == SCHEDULE_THREADS - 1) *num_tiles = first_tile;  // the last thread's end is the total
  __syncthreads();  // cursor and tile_start (global memory) are read below by other threads of the block
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int32_t begin = cursor[e], end = begin + counts[e];
    int32_t t = tile_start[e];
    for (int32_t r = begin; r < end; r += bm) tiles[t++] = Tile{e, r, min(r + bm, end)};
  }
}

__global__ void keep_local_experts_kernel(int32_t* experts, int64_t slots, int first, int count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < slots; i += int64_t(gridDim.x) * blockDim.x) {
    const int e = experts[i];
    experts[i] = e >= first && e < first + count ? e - first : -1;
  }
}

__global__ void place_kernel(const int32_t* experts, int64_t pairs, int num_experts, int32_t* cursor,
                             int32_t* sorted_pair, int32_t* pos_of_pair) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int e = experts[p];
    int32_t pos = -1;
    if (e >= 0 && e < num_experts) {
      pos = atomicAdd(&cursor[e], 1);
      sorted_pair[pos] = int32_t(p);
    }
    pos_of_pair[p] = pos;
  }
}

// The decode path's whole sort in one block (instead of a memset and the three kernels above): counts in
// shared memory, the tile list (each touched expert's segment in tiles of `tile_rows` rows, one pass of the
// decode kernel each), then each pair's slot. For at most DECODE_SORT_EXPERTS experts and
// DECODE_SORT_PAIRS pairs (run_moe_experts checks); the slots within an expert are taken by atomics, as in
// place_kernel, and no row's product depends on the order of the rows beside it.
constexpr int DECODE_SORT_THREADS = 1024, DECODE_SORT_EXPERTS = 1024, DECODE_SORT_PAIRS = 16384;
__global__ void __launch_bounds__(DECODE_SORT_THREADS)
    decode_sort_kernel(const int32_t* experts, int pairs, int num_experts, int tile_rows, Tile* tiles,
                       int32_t* num_tiles, int32_t* sorted_pair, int32_t* pos_of_pair) {
  __shared__ int32_t count[DECODE_SORT_EXPERTS], cursor[DECODE_SORT_EXPERTS];
  __shared__ int32_t warp_rows[DECODE_SORT_THREADS / 32], warp_tiles[DECODE_SORT_THREADS / 32];
  const int tid = threadIdx.x;
  for (int e = tid; e < num_experts; e += DECODE_SORT_THREADS) count[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += DECODE_SORT_THREADS) {
    const int e = experts[p];
    if (e >= 0 && e < num_experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Exclusive scan of (rows, tiles) over the experts, one expert a thread (num_experts <= threads).
  const int32_t own_rows = tid < num_experts ? count[tid] : 0, own_tiles = (own_rows + tile_rows - 1) / tile_rows;
  int32_t begin = own_rows, tile = own_tiles;
  block_exclusive_scan<DECODE_SORT_THREADS>(begin, tile, warp_rows, warp_tiles);
  if (tid < num_experts) {
    cursor[tid] = begin;
    for (int32_t r = 0; r < own_rows; r += tile_rows)
      tiles[tile++] = Tile{tid, begin + r, begin + min(r + tile_rows, own_rows)};
  }
  if (tid == DECODE_SORT_THREADS - 1) *num_tiles = tile;  // the last thread's end is the total
  __syncthreads();
  for (int p = tid; p < pairs; p += DECODE_SORT_THREADS) {
    const int e = experts[p];
    int32_t pos = -1;
    if (e >= 0 && e < num_experts) {
      pos = atomicAdd(&cursor[e], 1);
      sorted_pair[pos] = p;
    }
    pos_of_pair[p] = pos;
  }
}

using ptx::cp_async16;  // zero-filled when !valid
using ptx::cp_async4;
using ptx::cp_async8;
using ptx::cp_async_commit;
using ptx::cp_async_wait;


// bf16(e4m3 * scale) for the two codes of `two` (low byte first), the values dequantize_fp8_blocks gives
// (skinny_ordered.cuh, whose ordered decode products use the same).
__device__ __forceinline__ uint32_t dequant2(uint32_t two, float sc) { return skinny::e4m3x2_scaled_bf16x2(two, sc); }
// Eight codes (w0 then w1, lowest byte first) -> eight bf16 (lowest address first).
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, float sc) {
  return make_uint4(dequant2(w0, sc), dequant2(w0 >> 16, sc), dequant2(w1, sc), dequant2(w1 >> 16, sc));
}

// A tile's product over K with NB weight operands (2 for gate/up, 1 for down). A rows come from
// a_rows[] (per-thread row pointers, null = zero row); weight rows are w[b] + n * K.
template <int NB, bool FP8>
struct SmemTiles {
  bf16 a[STAGES][BM][LDS];
  bf16 b[STAGES][NB][BN][LDS];
};
// FP8 weights: the raw e4m3 tiles and their block scale land by cp.async in STAGES_FP8 stages (half the
// bytes of a bf16 stage, so one stage more fits the 48 KB of static shared memory: 46 KB for gate/up);
// each k step converts its stage into the one bf16 tile b, which the WMMA code then reads as in the bf16
// kernel. b and a first: WMMA loads need 32-byte aligned tile addresses.
template <int NB>
struct SmemTiles<NB, true> {
  bf16 a[STAGES_FP8][BM][LDS];
  bf16 b[NB][BN][LDS];
  uint8_t q[STAGES_FP8][NB][BN][BK];
  float scale[STAGES_FP8][NB];
};
// FP4 weights: the raw code tiles (16 bytes a row and stage) land by cp.async; each k step converts its
// stage into the bf16 tile b as the FP8 path does (the group scales are read from global memory one step
// ahead, into registers).
template <int NB>
struct SmemTilesFp4 {
  bf16 a[STAGES_FP8][BM][LDS];
  bf16 b[NB][BN][LDS];
  uint8_t q[STAGES_FP8][NB][BN][BK / 2];
};
template <int NB, skinny::Codes C>
union GemmSmem {
  std::conditional_t<skinny::is_fp4(C), SmemTilesFp4<NB>,
                     SmemTiles<NB, C == skinny::Codes::Fp8 || C == skinny::Codes::Mxfp8>> tiles;
  float c[NB][BM][LDC];
};

// Eight E2M1 codes (one word, code k in bits 4k..4k+3) -> eight bf16 times the scale pair, in column order
// (skinny::fp4_to_bf16x2 pairs codes k and k + 4; the WMMA and wgmma tiles want them in place). Values carry the
// 2^-16 of fp4_scale_pairs' scale, which the epilogue takes back.
__device__ __forceinline__ uint4 fp4_to_bf16x8(uint32_t w, uint32_t scale) {
  uint32_t p[4];
  skinny::fp4_to_bf16x2(w, scale, p);  // (0, 4), (1, 5), (2, 6), (3, 7)
  return make_uint4(__byte_perm(p[0], p[1], 0x5410), __byte_perm(p[2], p[3], 0x5410), __byte_perm(p[0], p[1], 0x7632),
                    __byte_perm(p[2], p[3], 0x7632));
}

// IS_GATE_UP: h = act(A·gateᵀ, A·upᵀ) (A = gathered x, K = hidden, N = inter);
// else:        y = weight · (A·downᵀ) (A = h, K = inter, N = hidden).
// FP8: w_base is e4m3 [E, NB*N, K] with fp32 scales w_scales [E, NB, ceil(N/128), ceil(K/128)] (moe.h);
// MXFP8: w_base is e4m3 [E, NB*N, K] with E8M0 group scales w_groups [E, NB*N, K/32];
// FP4: w_base is packed e2m1 [E, NB*N, K/2] with group scales w_groups [E, NB*N, K/group] and (NVFP4)
// w_global [E, NB]; else w_base is bf16 [E, NB*N, K] and the scales unused.
template <bool IS_GATE_UP, skinny::Codes C>
__global__ void __launch_bounds__(THREADS) grouped_gemm_kernel(
    const Tile* tiles, const int32_t* num_tiles, const int32_t* sorted_pair, int top_k, const bf16* a_base,
    const void* w_base, const float* w_scales, const uint8_t* w_groups, const float* w_global,
    const float* pair_weight, int64_t K, int64_t N, bf16* out, Glu kind, float alpha, float limit,
    expert_lora::LoraTerms lora) {
  constexpr int NB = IS_GATE_UP ? 2 : 1;
  // FP8 here: e4m3 code tiles, with a 128x128 block scale (Fp8) or a per-row E8M0 group scale (MX8).
  constexpr bool MX8 = C == skinny::Codes::Mxfp8, FP8 = C == skinny::Codes::Fp8 || MX8, FP4 = skinny::is_fp4(C);
  using namespace nvcuda;
  __shared__ __align__(128) GemmSmem<NB, C> sm;
  if (int(blockIdx.x) >= *num_tiles) return;
  const Tile tile = tiles[blockIdx.x];
  const int64_t n0 = int64_t(blockIdx.y) * BN;
  const int tid = threadIdx.x;

  // Each thread copies 2 A chunks per stage: rows tid/4 and tid/4 + 32, 8 bf16 at column (tid % 4) * 8.
  const int lrow = tid / 4, lcol = (tid % 4) * 8;
  const bf16* a_row[2];
  for (int i = 0; i < 2; ++i) {
    const int r = tile.begin + lrow + 32 * i;
    a_row[i] = nullptr;
    if (r < tile.end) {
      if constexpr (IS_GATE_UP) a_row[i] = a_base + int64_t(sorted_pair[r] / top_k) * K;
      else a_row[i] = a_base + int64_t(r) * K;
    }
  }
  auto load_a = [&](bf16 (*a)[LDS], int64_t k0) {
    const int64_t k = k0 + lcol;
    const bool kv = k < K;  // K % 8 == 0: a chunk is all in or all out
    for (int i = 0; i < 2; ++i)
      cp_async16(&a[lrow + 32 * i][lcol], kv && a_row[i] ? a_row[i] + k : a_base, kv && a_row[i] != nullptr);
  };

  const int warp = tid / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NB][2][2];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[b][i][j], 0.0f);
  // One BK step: a is the [BM][LDS] A tile, w the NB consecutive [BN][LDS] weight tiles.
  auto mma_step = [&](const bf16* a, const bf16* w) {
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], a + (wm + 16 * i) * LDS + kk, LDS);
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < 2; ++j) {
          // The weight tile is stored [n][k], i.e. B = Wᵀ [k][n] in column-major order.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, w + (b * BN + wn + 16 * j) * LDS + kk, LDS);
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[b][i][j], fa[i], fb, acc[b][i][j]);
        }
    }
  };

  const int64_t ktiles = (K + BK - 1) / BK;
  if constexpr (FP4) {
    // Each thread copies 8 code bytes (16 columns) of row tid / 2, half tid % 2, per weight operand per
    // stage; K % 32 == 0, so a stage's 32 columns are all in or all out. Its group scale (one byte: NVFP4's
    // 16 columns are one group, MXFP4's 32 one group) comes from global memory a step ahead.
    const uint8_t* wq = static_cast<const uint8_t*>(w_base);
    const int qrow = tid / 2, qhalf = tid % 2;
    constexpr int G = skinny::group_size(C);
    const uint8_t* w_row[NB];
    const uint8_t* g_row[NB];
    for (int b = 0; b < NB; ++b) {
      const int64_t n = n0 + qrow;
      const int64_t row = int64_t(tile.expert) * (NB * N) + b * N + n;
      w_row[b] = n < N ? wq + row * (K / 2) : nullptr;
      g_row[b] = n < N ? w_groups + row * (K / G) : nullptr;
    }
    auto load_stage = [&](int stage, int64_t k0) {
      load_a(sm.tiles.a[stage], k0);
      const bool kv = k0 < K;
      for (int b = 0; b < NB; ++b)
        cp_async8(&sm.tiles.q[stage][b][qrow][qhalf * 8], kv && w_row[b] ? w_row[b] + k0 / 2 + qhalf * 8 : wq,
                  kv && w_row[b] != nullptr);
    };
    auto scale_of = [&](int b, int64_t kt) -> uint32_t {
      return g_row[b] && kt < ktiles ? __ldg(g_row[b] + (kt * BK + qhalf * 16) / G) : 0u;
    };
    uint32_t sc[NB], sc_next[NB];
    for (int b = 0; b < NB; ++b) sc[b] = scale_of(b, 0);
    for (int s = 0; s < STAGES_FP8 - 1; ++s) {
      if (s < ktiles) load_stage(s, s * BK);
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      for (int b = 0; b < NB; ++b) sc_next[b] = scale_of(b, kt + 1);
      cp_async_wait<STAGES_FP8 - 2>();
      __syncthreads();
      const int64_t next = kt + STAGES_FP8 - 1;
      if (next < ktiles) load_stage(int(next % STAGES_FP8), next * BK);
      cp_async_commit();
      const int st = int(kt % STAGES_FP8);
      for (int b = 0; b < NB; ++b) {
        const uint2 raw = *reinterpret_cast<const uint2*>(&sm.tiles.q[st][b][qrow][qhalf * 8]);
        uint32_t pair[2];
        skinny::fp4_scale_pairs<C>(sc[b], pair);
        *reinterpret_cast<uint4*>(&sm.tiles.b[b][qrow][qhalf * 16]) = fp4_to_bf16x8(raw.x, pair[0]);
        *reinterpret_cast<uint4*>(&sm.tiles.b[b][qrow][qhalf * 16 + 8]) = fp4_to_bf16x8(raw.y, pair[0]);
        sc[b] = sc_next[b];
      }
      __syncthreads();
      mma_step(&sm.tiles.a[st][0][0], &sm.tiles.b[0][0][0]);
    }
  } else if constexpr (!FP8) {
    // Each thread copies 2 chunks per weight operand per stage, at the A chunks' rows and column.
    const bf16* wb = static_cast<const bf16*>(w_base);
    const bf16* w_row[NB][2];
    for (int i = 0; i < 2; ++i) {
      const int64_t n = n0 + lrow + 32 * i;
      const bf16* we = wb + int64_t(tile.expert) * (NB * N) * K;  // this expert's [NB*N, K] weight
      for (int b = 0; b < NB; ++b) w_row[b][i] = n < N ? we + (b * N + n) * K : nullptr;
    }
    auto load_stage = [&](int stage, int64_t k0) {
      load_a(sm.tiles.a[stage], k0);
      const int64_t k = k0 + lcol;
      const bool kv = k < K;
      for (int i = 0; i < 2; ++i)
        for (int b = 0; b < NB; ++b)
          cp_async16(&sm.tiles.b[stage][b][lrow + 32 * i][lcol], kv && w_row[b][i] ? w_row[b][i] + k : wb,
                     kv && w_row[b][i] != nullptr);
    };
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles) load_stage(s, s * BK);
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      const int64_t next = kt + STAGES - 1;
      if (next < ktiles) load_stage(int(next % STAGES), next * BK);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      const int st = int(kt % STAGES);
      mma_step(&sm.tiles.a[st][0][0], &sm.tiles.b[st][0][0][0]);
      __syncthreads();
    }
  } else {
    // Each thread copies one 16-byte chunk (16 codes) per weight operand per stage: row tid/2, column
    // (tid % 2) * 16 of the 64 x 32 tile; K % 16 == 0, so a chunk is all in or all out. Thread b < NB also
    // copies operand b's block scale for the stage: BK divides 128 and a 64-row tile (n0 % 64 == 0) lies
    // inside one 128-row block, so one scale covers an operand's whole stage. MX8: a stage's 32 columns
    // are one group of each row; the thread's row scale comes from global memory a step ahead (as FP4's).
    const uint8_t* wq = static_cast<const uint8_t*>(w_base);
    const int qrow = tid / 2, qcol = (tid % 2) * 16;
    const uint8_t* w_row[NB];
    for (int b = 0; b < NB; ++b) {
      const int64_t n = n0 + qrow;
      const uint8_t* we = wq + int64_t(tile.expert) * (NB * N) * K;
      w_row[b] = n < N ? we + (b * N + n) * K : nullptr;
    }
    const int64_t kblocks = (K + 127) / 128, nblocks = (N + 127) / 128;
    const float* s_row =
        MX8 ? nullptr : w_scales + ((int64_t(tile.expert) * NB + min(tid, NB - 1)) * nblocks + n0 / 128) * kblocks;
    const uint8_t* g_row[NB];  // MX8: the thread's row of group scales per operand
    for (int b = 0; b < NB; ++b) {
      const int64_t n = n0 + qrow;
      g_row[b] = MX8 && n < N ? w_groups + (int64_t(tile.expert) * (NB * N) + b * N + n) * (K / 32) : nullptr;
    }
    auto load_stage = [&](int stage, int64_t k0) {
      load_a(sm.tiles.a[stage], k0);
      const int64_t k = k0 + qcol;
      const bool kv = k < K;
      for (int b = 0; b < NB; ++b)
        cp_async16(&sm.tiles.q[stage][b][qrow][qcol], kv && w_row[b] ? w_row[b] + k : wq,
                   kv && w_row[b] != nullptr);
      if (!MX8 && tid < NB) cp_async4(&sm.tiles.scale[stage][tid], s_row + k0 / 128, true);
    };
    auto group_scale = [&](int b, int64_t kt) -> float {  // MX8: 2^(e - 127) (e = 0: fp32's subnormal 2^-127)
      const uint32_t e = g_row[b] && kt < ktiles ? __ldg(g_row[b] + kt * BK / 32) : 127u;
      return __uint_as_float(e == 0u ? 0x00400000u : e == 255u ? 0x7FC00000u : e << 23);
    };
    float gsc[NB], gsc_next[NB];
    for (int b = 0; b < NB; ++b) gsc[b] = MX8 ? group_scale(b, 0) : 0.0f;
    for (int s = 0; s < STAGES_FP8 - 1; ++s) {
      if (s < ktiles) load_stage(s, s * BK);
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      if constexpr (MX8)
        for (int b = 0; b < NB; ++b) gsc_next[b] = group_scale(b, kt + 1);
      // Stage kt is in for every thread, and every warp is done with step kt - 1 (its A stage, which the
      // load below refills, and the bf16 tile b, which the conversion below rewrites).
      cp_async_wait<STAGES_FP8 - 2>();
      __syncthreads();
      const int64_t next = kt + STAGES_FP8 - 1;
      if (next < ktiles) load_stage(int(next % STAGES_FP8), next * BK);
      cp_async_commit();
      const int st = int(kt % STAGES_FP8);
      for (int b = 0; b < NB; ++b) {
        const uint4 raw = *reinterpret_cast<const uint4*>(&sm.tiles.q[st][b][qrow][qcol]);
        const float sc = MX8 ? gsc[b] : sm.tiles.scale[st][b];
        *reinterpret_cast<uint4*>(&sm.tiles.b[b][qrow][qcol]) = dequant8(raw.x, raw.y, sc);
        *reinterpret_cast<uint4*>(&sm.tiles.b[b][qrow][qcol + 8]) = dequant8(raw.z, raw.w, sc);
        if constexpr (MX8) gsc[b] = gsc_next[b];
      }
      __syncthreads();
      mma_step(&sm.tiles.a[st][0][0], &sm.tiles.b[0][0][0]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue reuses the tile buffers
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&sm.c[b][wm + 16 * i][wn + 16 * j], acc[b][i][j], LDC, wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < BM * BN; idx += THREADS) {
    const int r = idx / BN, c = idx % BN;
    const int row = tile.begin + r;
    const int64_t col = n0 + c;
    if (row >= tile.end || col >= N) continue;
    float v;
    float sums[NB];
    for (int b = 0; b < NB; ++b) {
      sums[b] = sm.c[b][r][c];
      if constexpr (FP4) {  // the tiles' 2^-16 (skinny::FP4_UNSCALE) and NVFP4's global scale
        sums[b] *= skinny::FP4_UNSCALE;
        if constexpr (C == skinny::Codes::Nvfp4) sums[b] = __fmul_rn(sums[b], w_global[int64_t(tile.expert) * NB + b]);
      }
    }
    if constexpr (IS_GATE_UP) {
      sums[0] += lora.term(row, col, expert_lora::Gate);
      sums[1] += lora.term(row, col, expert_lora::Up);
      v = glu_value(sums[0], sums[1], kind, alpha, limit);
    } else {
      sums[0] += lora.term(row, col, expert_lora::Down);
      v = __fmul_rn(pair_weight[sorted_pair[row]], sums[0]);
    }
    out[int64_t(row) * N + col] = __float2bfloat16_rn(v);
  }
}

// out[t] = the sum of token t's slot outputs y[pos_of_pair[t, j]] in slot order (fp32, one bf16 rounding).
// Blocks (token, columns), each thread 8 columns by 16-byte loads (hidden is a multiple of 8 and y, out are
// 16-byte aligned: run_moe_experts checks), the slots' row positions read once a thread and every slot's
// load in flight together: one block a token walking the row 256 columns at a time took 10.7 us at one
// token (bench/results/kernels.md, "Small kernels at batch 1").
constexpr int kCombineThreads = 128, kCombineCols = 8 * kCombineThreads;
__global__ void combine_kernel(const bf16* y, const int32_t* pos_of_pair, int top_k, int64_t hidden, bf16* out) {
  const int64_t t = blockIdx.x;
  const int64_t d = int64_t(blockIdx.y) * kCombineCols + 8 * int64_t(threadIdx.x);
  if (d >= hidden) return;
  float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  constexpr int kBatch = 8;  // slots whose loads are issued together
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    uint4 v[kBatch];
    bool live[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int32_t pos = j0 + j < top_k ? pos_of_pair[t * top_k + j0 + j] : -1;
      live[j] = pos >= 0;
      if (live[j]) v[j] = *reinterpret_cast<const uint4*>(y + int64_t(pos) * hidden + d);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (!live[j]) continue;
      const bf16* e = reinterpret_cast<const bf16*>(&v[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] = __fadd_rn(sum[i], __bfloat162float(e[i]));
    }
  }
  uint4 packed;
  bf16* o = reinterpret_cast<bf16*>(&packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(sum[i]);
  *reinterpret_cast<uint4*>(out + t * hidden + d) = packed;
}

void launch_combine(const bf16* y, const int32_t* pos_of_pair, int64_t tokens, int top_k, int64_t hidden, bf16* out,
                    cudaStream_t stream) {
  const dim3 grid(unsigned(tokens), unsigned((hidden + kCombineCols - 1) / kCombineCols));
  combine_kernel<<<grid, kCombineThreads, 0, stream>>>(y, pos_of_pair, top_k, hidden, out);
}

// ------------------------------------------------------------------------------------------------
// Prefill: the grouped products on Hopper's warpgroup tensor cores (wgmma)
// ------------------------------------------------------------------------------------------------
//
// The WMMA kernel above issues mma.sync through 64x64 tiles and tops out well under the bf16 peak; with
// many rows per expert (prefill) the products are compute-bound (DeepSeek-V3.2 at 16K tokens: 512 rows per
// expert, ~2.8x more FLOPs than the expert weights' bytes allow at the ridge point), so they run here on
// wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   - a CTA is two warpgroups (256 threads) and owns one tile of up to 128 rows of one expert (wg::BM) by
//     256 weight rows (wg::BN): down: 256 output columns; gate/up: 128 output columns, whose gate and up
//     rows are interleaved in 64-row blocks [gate 64 | up 64 | gate 64 | up 64] so that every thread holds
//     the gate and the up accumulator of the same output element (the activation is fused as before);
//   - a tile of more than 64 rows: warpgroup w computes rows [64w, 64w + 64) x all 256 weight rows
//     (m64n256k16); a tile of at most 64 rows (the remainder of an expert, or an expert with few tokens, as
//     Kimi's 896 experts have at 4K tokens): both warpgroups share rows [0, 64) and warpgroup w computes the
//     weight rows [128w, 128w + 128) (m64n128k16), so neither warpgroup idles;
//   - operands go to shared memory by cp.async in the 128-byte swizzled K-major layout wgmma reads (16-byte
//     chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16), 1024-byte aligned tiles; as in
//     dsa_indexer/decode_scores.cu), 64 columns (one swizzle row) per stage, wg::STAGES stages: the copies
//     of stage kt + 2 are in flight while the products of kt - 1 and kt run;
//   - FP8 weights: the raw e4m3 stage and its two block scales land by cp.async, and each step converts the
//     stage into a bf16 tile (double-buffered) with the same bf16(e4m3 * scale) as the WMMA path, so
//     moe_experts_fp8 stays bit-identical to moe_experts on the dequantised weights on this path too;
//   - group-scaled weights (moe_experts_packed, the Codes parameter): the raw stage of codes (NVFP4 / MXFP4:
//     E2M1 pairs, 32 bytes a row, a quarter of the bf16 stage; MXFP8: e4m3, 64 bytes a row) lands by
//     cp.async, and every other stage the group scales of two stages per weight row (NVFP4: eight E4M3
//     bytes; MXFP4 / MXFP8: four E8M0 bytes) into one of two scale buffers; the
//     same inline step converts them into the bf16 tile: FP4 with fp4_to_bf16x8 (e2m1 * scale * 2^-16,
//     exact: the WMMA and decode paths' values; the epilogue multiplies the fp32 sums by 2^16 and NVFP4's
//     weight_scale_2), MXFP8 e4m3 * 2^(e - 127) in one bf16x2 product (exact, the values of the WMMA
//     path's fp32 product). With a scale of 1 for NVFP4's global, every path's weights are then the exact
//     dequantised values (a power of two apart for FP4), so the products match moe_experts on them;
//   - CTAs are numbered expert by expert, and inside an expert weight tile by weight tile with the expert's
//     row tiles innermost: the row tiles reading one weight tile run side by side (the weights come from
//     HBM about once: at 4K tokens DeepSeek's experts are 22.5 GB, more time than their FLOPs), and an
//     expert's gathered rows are re-read from L2 by its next weight tiles;
//   - the epilogue stages the bf16 results through shared memory and writes 16-byte rows.
// Every output element is still computed alone over k in a fixed order (fp32 accumulation, 16 columns
// per wgmma step), so results do not depend on the order of the rows inside an expert's segment.
// Shapes: hidden % 256 == 0 and inter % 128 == 0 (every tile full in N and K); see use_wgmma.
namespace wg {

using skinny::Codes;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, THREADS = 256;
constexpr int A_BYTES = BM * BK * 2;  // 16 KB: 128 rows of one 128-byte swizzle row
constexpr int B_BYTES = BN * BK * 2;  // 32 KB
// A weight row's codes in one stage: 64 bytes of e4m3 (FP8, MXFP8) or 32 of E2M1 pairs (NVFP4, MXFP4).
__host__ __device__ constexpr int q_row_bytes(Codes c) { return skinny::is_fp4(c) ? BK / 2 : BK; }
// A stage's raw codes, plain [BN][q_row_bytes].
__host__ __device__ constexpr int q_bytes(Codes c) { return BN * q_row_bytes(c); }
// Group scales: a weight row's scales of two stages (128 columns) are one copy, NVFP4's eight E4M3 bytes or
// MX's four E8M0 bytes, copied with the even stage into one of two buffers [BN][g_word_bytes] (a copy per
// stage and row, 4 bytes from a different line each, added half as many L2 requests as the FP4 codes).
__host__ __device__ constexpr int g_word_bytes(Codes c) { return c == Codes::Nvfp4 ? 8 : 4; }
// The scale area: FP8 the two fp32 block scales of each stage's rows, group-scaled codes the two buffers.
__host__ __device__ constexpr int s_area_bytes(Codes c) {
  return c == Codes::Fp8 ? STAGES * 2 * 4 : 2 * BN * g_word_bytes(c);
}
// Shared memory, from a 1024-byte aligned base:
//   bf16 weights:  [STAGES x A][STAGES x B]
//   coded weights: [STAGES x A][2 x B (converted)][STAGES x Q][scales]
// (MXFP8, the largest: 194 KB.) The epilogue reuses the start as a bf16 [BM][OUT_COLS + 8] tile.
constexpr int smem_bytes(Codes c) {
  return 1024 + STAGES * A_BYTES +
         (c == Codes::Bf16 ? STAGES * B_BYTES : 2 * B_BYTES + STAGES * q_bytes(c) + s_area_bytes(c));
}
static_assert(smem_bytes(Codes::Bf16) <= 227 * 1024 && smem_bytes(Codes::Fp8) <= 227 * 1024 &&
                  smem_bytes(Codes::Mxfp8) <= 227 * 1024 && smem_bytes(Codes::Nvfp4) <= 227 * 1024,
              "shared memory per block");
static_assert(BM * (BN + 8) * 2 <= STAGES * A_BYTES + 2 * B_BYTES, "epilogue tile fits in the pipeline's space");

struct Args {
  const Tile* tiles;           // wg::BM-row tiles, by expert
  const int32_t* num_tiles;
  const int32_t* tile_start;   // first tile of each expert
  const int32_t* counts;       // rows of each expert
  const int32_t* sorted_pair;  // pair of each sorted row
  int top_k;
  const bf16* a;               // gate/up: x [tokens, K] (rows gathered); down: h [pairs, K] (sorted rows)
  int64_t K;
  const void* w;               // [E, (gate/up ? 2 : 1) * N, K]: bf16, e4m3 or E2M1 pairs (K / 2 bytes a row)
  const float* w_scales;       // FP8: moe.h's block scales
  const uint8_t* w_groups;     // group-scaled codes: [E, (gate/up ? 2 : 1) * N, K / group], 8 / 4-byte aligned
  const float* w_global;       // NVFP4: weight_scale_2, [E, 2] (gate, up) or [E] (down)
  int64_t N;                   // output columns: gate/up: inter; down: hidden
  int n_tiles;                 // N / 128 (gate/up) or N / 256 (down)
  const float* pair_weight;
  bf16* out;                   // h or y, [pairs, N] in sorted order
  Glu kind;
  float alpha, limit;
  expert_lora::LoraTerms lora;  // LoRA on the experts: terms added before the activation / the pair weight
};

using ptx::wgmma_commit;
using ptx::wgmma_fence;
using ptx::wgmma_wait;
using wgmma::fence_proxy_async;
using wgmma::sw128_descriptor;

// Eight e4m3 codes (w0 then w1, lowest byte first) times an E8M0 scale pair (skinny::e8m0_bf16x2) -> eight
// bf16, lowest address first: exact, the same values as the WMMA path's fp32 product (skinny.cuh's MXFP8).
__device__ __forceinline__ uint4 mx8_to_bf16x8(uint32_t w0, uint32_t w1, uint32_t sc) {
  using skinny::bf16x2_mul;
  using skinny::e4m3x2_to_bf16x2;
  return make_uint4(bf16x2_mul(e4m3x2_to_bf16x2(w0), sc), bf16x2_mul(e4m3x2_to_bf16x2(w0 >> 16), sc),
                    bf16x2_mul(e4m3x2_to_bf16x2(w1), sc), bf16x2_mul(e4m3x2_to_bf16x2(w1 >> 16), sc));
}

// C: the weights' codes. Bf16 is read as is; every other format is staged raw and converted (see above).
template <bool GATE_UP, Codes C>
__global__ void __launch_bounds__(THREADS, 1) grouped_kernel(const Args p) {
  constexpr bool RAW = C != Codes::Bf16, FP8 = C == Codes::Fp8, FP4 = skinny::is_fp4(C);
  constexpr bool GROUPED = skinny::has_groups(C);
  constexpr int Q_ROW = q_row_bytes(C), Q_BYTES = q_bytes(C), G_WORD = g_word_bytes(C);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* a_smem = smem;                          // STAGES x A_BYTES
  uint8_t* b_smem = smem + STAGES * A_BYTES;       // bf16: STAGES x B_BYTES; coded: 2 converted tiles
  uint8_t* q_smem = b_smem + 2 * B_BYTES;          // coded only: STAGES x Q_BYTES
  uint8_t* s_smem = q_smem + STAGES * Q_BYTES;     // coded only: s_area_bytes(C)

  // CTA -> (expert, weight tile, row tile): the expert's CTAs are [first * n_tiles, (first + count) *
  // n_tiles), weight tile outer, row tile inner. CTAs past the last tile (the grid is a host-side bound)
  // exit.
  const int64_t cta = blockIdx.x;
  const int64_t t0 = cta / p.n_tiles;
  if (t0 >= *p.num_tiles) return;
  const int expert = p.tiles[t0].expert;
  const int64_t first = p.tile_start[expert];
  const int64_t count = (p.counts[expert] + BM - 1) / BM;
  const int64_t local = cta - first * p.n_tiles;
  const int64_t n_tile = local / count;
  const Tile tile = p.tiles[first + local % count];
  const int rows = tile.end - tile.begin;
  const bool half = rows <= 64;

  const int tid = threadIdx.x;
  const int64_t K = p.K, N = p.N;
  const int ktiles = int(K / BK);

  // Copy assignments. bf16 A and B: 16-byte chunk `chunk` of rows row0 + 32 i (8 threads per 128-byte
  // row). Raw codes: chunk `cchunk` of rows crow0 + Q_RPP i (e4m3: 4 threads per 64-byte row, 4 rows a
  // thread; E2M1: 2 per 32-byte row, 2 rows a thread).
  const int chunk = tid % 8, row0 = tid / 8;
  const int swz = (chunk ^ (row0 % 8)) * 16;  // (row0 + 32 i) % 8 == row0 % 8
  const bf16* a_src[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + 32 * i;
    a_src[i] = nullptr;
    if (r < rows) {
      const int64_t src_row = GATE_UP ? int64_t(p.sorted_pair[tile.begin + r] / p.top_k) : int64_t(tile.begin + r);
      a_src[i] = p.a + src_row * K + chunk * 8;
    }
  }
  // Weight row of tile row r: gate/up interleaves 64-row blocks of gate and up rows (see above).
  auto weight_row = [&](int r) -> int64_t {
    if constexpr (GATE_UP) {
      const int blk = r / 64;
      return (blk % 2) * N + n_tile * 128 + (blk / 2) * 64 + r % 64;
    } else {
      return n_tile * BN + r;
    }
  };
  const int64_t expert_rows = (GATE_UP ? 2 : 1) * N;
  constexpr int Q_CPR = Q_ROW / 16, Q_RPP = THREADS / Q_CPR;  // raw: chunks per row, rows per copy pass
  constexpr int B_PER_THREAD = RAW ? BN / Q_RPP : 8;
  const int cchunk = tid % Q_CPR, crow0 = tid / Q_CPR;
  const int64_t q_row_stride = K / BK * Q_ROW;  // bytes of a raw weight row
  const void* b_src[B_PER_THREAD];
#pragma unroll
  for (int i = 0; i < B_PER_THREAD; ++i) {
    if constexpr (RAW) {
      const int r = crow0 + Q_RPP * i;
      b_src[i] = static_cast<const uint8_t*>(p.w) + (int64_t(expert) * expert_rows + weight_row(r)) * q_row_stride +
                 cchunk * 16;
    } else {
      const int r = row0 + 32 * i;
      b_src[i] = static_cast<const bf16*>(p.w) + (int64_t(expert) * expert_rows + weight_row(r)) * K + chunk * 8;
    }
  }
  // FP8: thread s < 2 copies the block scale of the tile's weight rows with scale slot s (gate/up: slot =
  // (r / 64) % 2, the gate or the up half, both inside the 128-row block n_tile; down: slot = r / 128, the
  // 128-row blocks 2 n_tile and 2 n_tile + 1); one scale per 64-column stage (BK divides 128).
  const float* s_src = nullptr;
  if constexpr (FP8) {
    const int64_t kb = K / 128;
    const int slot = min(tid, 1);
    s_src = GATE_UP ? p.w_scales + ((int64_t(expert) * 2 + slot) * (N / 128) + n_tile) * kb
                    : p.w_scales + (int64_t(expert) * (N / 128) + 2 * n_tile + slot) * kb;
  }
  // Group-scaled: thread t copies the scales of tile row t (BN == THREADS) for stages 2j and 2j + 1 (columns
  // [128 j, 128 j + 128)) with stage 2j: bytes [8 j, 8 j + 8) of the row's NVFP4 scales (stage kt's four
  // groups at 4 (kt % 2)), the word [4 j, 4 j + 4) of its MX scales (stage kt's two at 2 (kt % 2)). K % 128
  // == 0 (use_wgmma) keeps every row's copies 8-byte (NVFP4: K / 16 bytes a row) or 4-byte (MX: K / 32)
  // aligned, given a 8- or 4-byte aligned base (checked on the host).
  const uint8_t* g_src = nullptr;
  if constexpr (GROUPED) {
    static_assert(BN == THREADS, "one scale row a thread");
    g_src = p.w_groups + (int64_t(expert) * expert_rows + weight_row(tid)) * (K / skinny::group_size(C));
  }

  auto load_stage = [&](int slot, int64_t k0) {
    uint8_t* a_dst = a_smem + slot * A_BYTES;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (half && i >= 2) break;  // a tile of <= 64 rows uses rows [0, 64) only
      const int r = row0 + 32 * i;
      cp_async16(a_dst + r * 128 + swz, a_src[i] != nullptr ? a_src[i] + k0 : p.a, a_src[i] != nullptr);
    }
    if constexpr (RAW) {
      uint8_t* q_dst = q_smem + slot * Q_BYTES;
      const int64_t q0 = k0 / BK * Q_ROW;
#pragma unroll
      for (int i = 0; i < B_PER_THREAD; ++i)
        cp_async16(q_dst + (crow0 + Q_RPP * i) * Q_ROW + cchunk * 16, static_cast<const uint8_t*>(b_src[i]) + q0, true);
      if constexpr (FP8) {
        if (tid < 2) cp_async4(reinterpret_cast<float*>(s_smem) + slot * 2 + tid, s_src + k0 / 128, true);
      } else if (k0 % (2 * BK) == 0) {  // the scales of this stage and the next, into buffer (k0 / 128) % 2
        uint8_t* g_dst = s_smem + (k0 / (2 * BK)) % 2 * (BN * G_WORD) + tid * G_WORD;
        if constexpr (C == Codes::Nvfp4)
          cp_async8(g_dst, g_src + k0 / 16, true);
        else
          cp_async4(g_dst, g_src + k0 / 32, true);
      }
    } else {
      uint8_t* b_dst = b_smem + slot * B_BYTES;
#pragma unroll
      for (int i = 0; i < B_PER_THREAD; ++i)
        cp_async16(b_dst + (row0 + 32 * i) * 128 + swz, static_cast<const bf16*>(b_src[i]) + k0, true);
    }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  const int wgi = tid / 128;  // this thread's warpgroup

  // Pipeline: stage kt lives in slot kt % STAGES; iteration kt refills the slot of kt - 2, whose products
  // every warpgroup has waited for (wgmma_wait<1> in iteration kt - 1, before this iteration's barrier).
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < ktiles) load_stage(s, int64_t(s) * BK);
    cp_async_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 3>();  // this thread's copies of stage kt have landed
    fence_proxy_async();
    __syncthreads();              // everyone's have; every warpgroup is done with the products of kt - 2
    const int next = kt + STAGES - 2;
    if (next < ktiles) load_stage(next % STAGES, int64_t(next) * BK);
    cp_async_commit();  // an empty group past the end keeps the group count uniform
    const int slot = kt % STAGES;
    const uint8_t* b_tile;
    if constexpr (RAW) {
      // Convert the stage's codes into the bf16 tile of parity kt (its last reader, the products of kt - 2,
      // is done): thread (row tid / 4 + 64 i, piece tid % 4) turns the piece's 16 columns (16 e4m3 codes or
      // 8 bytes of E2M1 pairs) into the 2 swizzled 16-byte bf16 chunks 2 piece and 2 piece + 1. A piece lies
      // in one group (16 or 32 columns): NVFP4's group `piece` of the stage, MX's group piece / 2.
      const int piece = tid % 4, prow0 = tid / 4;
      uint8_t* bc = b_smem + (kt & 1) * B_BYTES;
      const uint8_t* q = q_smem + slot * Q_BYTES;
      // Scales: FP8 the stage's two block scales; group-scaled the buffer of stages 2 (kt / 2), + 1, written
      // with stage kt - kt % 2 and rewritten with stage kt - kt % 2 + 4, whose copy is issued after this
      // conversion (at the earliest in iteration kt + 1, behind its barrier).
      const uint8_t* sg = FP8 ? s_smem + slot * 8 : s_smem + (kt / 2) % 2 * (BN * G_WORD);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = prow0 + 64 * i;
        uint4 lo, hi;  // bf16 columns [16 piece, 16 piece + 8) and [16 piece + 8, 16 piece + 16)
        if constexpr (FP8) {
          const float sc = reinterpret_cast<const float*>(sg)[GATE_UP ? i % 2 : i / 2];  // row r's (see s_src)
          const uint4 raw = *reinterpret_cast<const uint4*>(q + r * Q_ROW + piece * 16);
          lo = dequant8(raw.x, raw.y, sc);
          hi = dequant8(raw.z, raw.w, sc);
        } else if constexpr (FP4) {
          uint32_t pair[2];
          skinny::fp4_scale_pairs<C>(
              sg[r * G_WORD + (C == Codes::Nvfp4 ? 4 * (kt & 1) + piece : 2 * (kt & 1) + piece / 2)], pair);
          const uint2 raw = *reinterpret_cast<const uint2*>(q + r * Q_ROW + piece * 8);
          lo = fp4_to_bf16x8(raw.x, pair[0]);
          hi = fp4_to_bf16x8(raw.y, pair[0]);
        } else {  // MXFP8
          const uint32_t sc = skinny::e8m0_bf16x2(sg[r * G_WORD + 2 * (kt & 1) + piece / 2]);
          const uint4 raw = *reinterpret_cast<const uint4*>(q + r * Q_ROW + piece * 16);
          lo = mx8_to_bf16x8(raw.x, raw.y, sc);
          hi = mx8_to_bf16x8(raw.z, raw.w, sc);
        }
        *reinterpret_cast<uint4*>(bc + r * 128 + (((2 * piece) ^ (r % 8)) * 16)) = lo;
        *reinterpret_cast<uint4*>(bc + r * 128 + (((2 * piece + 1) ^ (r % 8)) * 16)) = hi;
      }
      fence_proxy_async();
      __syncthreads();
      b_tile = bc;
    } else {
      b_tile = b_smem + slot * B_BYTES;
    }
    const uint8_t* a_tile = a_smem + slot * A_BYTES;
    wgmma_fence();
    wgmma::keep(acc);
    if (!half) {
      const uint8_t* a_wg = a_tile + wgi * (64 * 128);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma::ss_bf16<256>(acc, sw128_descriptor(a_wg + kk * 32), sw128_descriptor(b_tile + kk * 32), 1);
    } else {
      const uint8_t* b_wg = b_tile + wgi * (128 * 128);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma::ss_bf16<128>(acc, sw128_descriptor(a_tile + kk * 32), sw128_descriptor(b_wg + kk * 32), 1);
    }
    wgmma_commit();
    wgmma::keep(acc);
    wgmma_wait<1>();  // the products of kt - 1 are done (kt's may still run)
    wgmma::keep(acc);
  }
  wgmma_wait<0>();
  wgmma::keep(acc);
  cp_async_wait<0>();
  __syncthreads();  // the epilogue tile overwrites the pipeline's shared memory

  // Accumulator layout (PTX ISA, wgmma D fragment for .f32): in warpgroup-local terms, warp v = (tid / 32) % 4,
  // lane l: acc[4j + q] is row 16v + l/4 + 8(q/2), column 8j + 2(l%4) + q%2 of the instruction's 64 x N.
  constexpr int OUT_COLS = GATE_UP ? 128 : 256;
  constexpr int PITCH = OUT_COLS + 8;  // bf16; 16 bytes of padding: the fragment stores hit 32 banks
  bf16* c_tile = reinterpret_cast<bf16*>(smem);
  const int lane = tid % 32, v = (tid / 32) % 4;
  const int frag_row = (half ? 0 : 64 * wgi) + 16 * v + lane / 4;
  const int frag_col = 2 * (lane % 4);
  // FP4: the tiles' 2^-16 (skinny::FP4_UNSCALE) back, then NVFP4's weight_scale_2 of the matrix (gate, up
  // or down: operand b), as the WMMA path's epilogue does.
  float global[GATE_UP ? 2 : 1];
#pragma unroll
  for (int b = 0; b < (GATE_UP ? 2 : 1); ++b)
    global[b] = C == Codes::Nvfp4 ? p.w_global[int64_t(expert) * (GATE_UP ? 2 : 1) + b] : 1.0f;
  auto sum = [&](float v, int b) {
    if constexpr (FP4) {
      v *= skinny::FP4_UNSCALE;
      if constexpr (C == Codes::Nvfp4) v = __fmul_rn(v, global[b]);
    }
    return v;
  };
  // LoRA (expert_lora.cuh): each of the thread's two rows' factors, found once; a row past the tile has none.
  using LoraRow = expert_lora::LoraTerms::Row;
  LoraRow lora_rows[2][GATE_UP ? 2 : 1];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int b = 0; b < (GATE_UP ? 2 : 1); ++b) {
      const int r = frag_row + 8 * h;
      const int proj = GATE_UP ? (b == 0 ? expert_lora::Gate : expert_lora::Up) : expert_lora::Down;
      lora_rows[h][b] = r < rows ? p.lora.row_of(tile.begin + r, proj) : LoraRow{};
    }
  const int64_t col0 = n_tile * OUT_COLS;  // the tile's first output column
  auto lora_term = [&](int h, int b, int col) { return expert_lora::LoraTerms::dot(lora_rows[h][b], col0 + col); };
  if constexpr (GATE_UP) {
    // Full tile: column groups jj = 0..15 (8 output columns each): the gate at j = 16 (jj / 8) + jj % 8,
    // the up 8 groups later. Half tile: the warpgroup's 128 weight rows are [gate 64 | up 64] of output
    // columns [64 wgi, 64 wgi + 64): gate j = jj, up j = jj + 8, jj = 0..7.
    auto put = [&](int jg, int ju, int col) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v0 = glu_value(sum(acc[4 * jg + 2 * h], 0) + lora_term(h, 0, col),
                                   sum(acc[4 * ju + 2 * h], 1) + lora_term(h, 1, col), p.kind, p.alpha, p.limit);
        const float v1 = glu_value(sum(acc[4 * jg + 2 * h + 1], 0) + lora_term(h, 0, col + 1),
                                   sum(acc[4 * ju + 2 * h + 1], 1) + lora_term(h, 1, col + 1), p.kind, p.alpha, p.limit);
        *reinterpret_cast<__nv_bfloat162*>(&c_tile[(frag_row + 8 * h) * PITCH + col]) = __floats2bfloat162_rn(v0, v1);
      }
    };
    if (!half) {
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) put(16 * (jj / 8) + jj % 8, 16 * (jj / 8) + jj % 8 + 8, 8 * jj + frag_col);
    } else {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) put(jj, jj + 8, 64 * wgi + 8 * jj + frag_col);
    }
  } else {
    float wr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row + 8 * h;
      wr[h] = r < rows ? p.pair_weight[p.sorted_pair[tile.begin + r]] : 0.0f;
    }
    auto put = [&](int j, int col) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<__nv_bfloat162*>(&c_tile[(frag_row + 8 * h) * PITCH + col]) =
            __floats2bfloat162_rn(__fmul_rn(wr[h], sum(acc[4 * j + 2 * h], 0) + lora_term(h, 0, col)),
                                  __fmul_rn(wr[h], sum(acc[4 * j + 2 * h + 1], 0) + lora_term(h, 0, col + 1)));
    };
    if (!half) {
#pragma unroll
      for (int j = 0; j < 32; ++j) put(j, 8 * j + frag_col);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) put(j, 128 * wgi + 8 * j + frag_col);
    }
  }
  __syncthreads();
  constexpr int CHUNKS = OUT_COLS / 8;  // 16-byte pieces per row
  bf16* out = p.out + int64_t(tile.begin) * N + n_tile * OUT_COLS;
  for (int idx = tid; idx < rows * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c = idx % CHUNKS;
    *reinterpret_cast<uint4*>(out + int64_t(r) * N + c * 8) =
        *reinterpret_cast<const uint4*>(&c_tile[r * PITCH + c * 8]);
  }
}

}  // namespace wg

// ------------------------------------------------------------------------------------------------
// Decode: few rows per expert, the products streamed from HBM (use_decode)
// ------------------------------------------------------------------------------------------------
//
// The kernel is skinny::kernel (gemm/skinny.cuh: its comment says how it streams the weights and why),
// shared with the dense decode-sized products; the two jobs below tell it where an expert's rows and
// weights are and what to do with the sums:
//   - grid (tile, group of output rows): the schedule cuts each touched expert's rows into tiles of one
//     pass (decode_tile_rows: 8 rows, fewer at fewer tokens), blockIdx.x indexes them; the grid's x is a
//     host-side bound (decode_slots) and surplus CTAs exit. blockIdx.y: `warps` consecutive 16-row weight
//     groups. One K range (the whole row): every output is one sum over K in a fixed order, whichever
//     tile its row is in. An expert with more rows than a pass has several tiles, adjacent in x: their CTAs
//     for one y run side by side and stream the same weight rows at about the same time, so that the L2 can
//     serve the repeats (one CTA looping over passes read them from HBM once per pass: at 8 rows per expert
//     on average ~40% of the experts have more than 8, and the path fell to 48-49% of HBM at 256 tokens).
//   - gate/up: a warp's 16 rows are gate rows i and up rows i of 8 outputs i = 8 group + g, so each lane
//     holds the gate and the up sum of the same (row, output) and glu_value() is applied in the store;
//     the activation rows are x[token(sorted_pair[r])], gathered.
//   - down: 16 rows of y = 16 outputs, the h rows in sorted order, the pair weight applied in the store.
namespace dec {

using skinny::LaneRows;
using skinny::Slice;

// Fields common to both products (skinny::kernel's Job interface).
struct Base {
  const Tile* tiles;           // (expert, first sorted row, end), at most one pass of rows each
  const int32_t* num_tiles;
  const int32_t* sorted_pair;
  int top_k;
  const bf16* a;               // gate/up: x [tokens, K] (rows gathered); down: h [pairs, K] (sorted rows)
  int64_t K;
  const void* w;               // [E, (gate/up ? 2 : 1) * N, K], bf16, e4m3 or packed e2m1
  const float* w_scales;       // FP8: moe.h's block scales
  const uint8_t* w_groups;     // FP4, MXFP8: the group scales, [E, (gate/up ? 2 : 1) * N, K / group]
  const float* w_global;       // NVFP4: weight_scale_2 per matrix, [E, 2] (gate, up) or [E] (down)
  int64_t N;                   // outputs per row: gate/up: inter; down: hidden
  const float* pair_weight;
  bf16* out;                   // h or y, [pairs, N] in sorted order
  int rows;                    // activation rows per pass (1..MAX_ROWS)
  int pitch;                   // bytes between staged activation rows
  Glu kind;
  float alpha, limit;
  expert_lora::LoraTerms lora{};  // LoRA on the experts: terms added before the activation / the pair weight

  __device__ bool slice(Slice& s) const {
    if (int(blockIdx.x) >= *num_tiles) return false;  // a surplus slot: fewer experts touched than the bound
    const Tile tile = tiles[blockIdx.x];
    s = Slice{tile.expert, tile.begin, tile.end};
    return true;
  }
};

// h[row] = act(x[token(row)] · gate[e]ᵀ, x[token(row)] · up[e]ᵀ)   (K = hidden, N = inter).
template <skinny::Codes C>
struct GateUp : Base {
  static constexpr bool FP8 = C == skinny::Codes::Fp8;
  static constexpr bool SPLIT_K = false, TWO_SCALE_ROWS = true;
  // Row lo is gate row i and row hi up row i, i = 8 group + g; N % 8 == 0, so a group either lies inside
  // [0, N) or past it. FP8: each half has its own [ceil(N/128), ceil(K/128)] scales; i in [8 group,
  // 8 group + 8), inside one 128-row block.
  __device__ LaneRows lane_rows(const Slice& s, int64_t group, int g) const {
    const int64_t row_bytes = skinny::row_bytes_of(C, K);
    const uint8_t* w_exp = static_cast<const uint8_t*>(w) + int64_t(s.index) * 2 * N * row_bytes;
    LaneRows r{};
    r.lo_col = 8 * group + g;
    r.hi_col = r.lo_col;
    r.lo = w_exp + r.lo_col * row_bytes;
    r.hi = w_exp + (N + r.lo_col) * row_bytes;
    r.active = r.lo_ok = r.hi_ok = 8 * group < N;
    if constexpr (FP8) {
      const int64_t kb = (K + 127) / 128, nb = (N + 127) / 128;
      r.s_lo = w_scales + ((int64_t(s.index) * 2 + 0) * nb + (8 * group) / 128) * kb;
      r.s_hi = w_scales + ((int64_t(s.index) * 2 + 1) * nb + (8 * group) / 128) * kb;
    }
    if constexpr (skinny::has_groups(C)) {
      const int64_t kg = K / skinny::group_size(C);
      r.q_lo = w_groups + (int64_t(s.index) * 2 * N + r.lo_col) * kg;
      r.q_hi = w_groups + (int64_t(s.index) * 2 * N + N + r.lo_col) * kg;
    }
    return r;
  }
  __device__ const bf16* act_row(const Slice&, int64_t row) const {
    return a + int64_t(sorted_pair[row] / top_k) * K;
  }
  __device__ void store(const Slice& s, int64_t row, int64_t group, int g, float gate, float up) const {
    if constexpr (skinny::is_fp4(C)) {  // the 2^-16 of the register dequantisation, NVFP4's global scales
      gate *= skinny::FP4_UNSCALE, up *= skinny::FP4_UNSCALE;
      if constexpr (C == skinny::Codes::Nvfp4) {
        gate = __fmul_rn(gate, w_global[2 * int64_t(s.index)]);
        up = __fmul_rn(up, w_global[2 * int64_t(s.index) + 1]);
      }
    }
    const int64_t col = 8 * group + g;
    gate += lora.term(row, col, expert_lora::Gate);
    up += lora.term(row, col, expert_lora::Up);
    out[row * N + col] = __float2bfloat16_rn(glu_value(gate, up, kind, alpha, limit));
  }
};

// y[row] = bf16(weight[pair(row)] · (h[row] · down[e]ᵀ))   (K = inter, N = hidden).
template <skinny::Codes C>
struct Down : Base {
  static constexpr bool FP8 = C == skinny::Codes::Fp8;
  static constexpr bool SPLIT_K = false, TWO_SCALE_ROWS = false;
  // Rows 16 group + g and + 8 (inside one 128-row scale block); the last group may be partial (bf16 with
  // hidden % 16 == 8).
  __device__ LaneRows lane_rows(const Slice& s, int64_t group, int g) const {
    // Expert s.index's [N, K] matrix and its [ceil(N/128), ceil(K/128)] scales (FP8) or [N, K / group]
    // group scales (FP4, MXFP8).
    const int64_t row_bytes = skinny::row_bytes_of(C, K);
    const void* scales = nullptr;
    if constexpr (FP8) scales = w_scales + int64_t(s.index) * ((N + 127) / 128) * ((K + 127) / 128);
    if constexpr (skinny::has_groups(C)) scales = w_groups + int64_t(s.index) * N * (K / skinny::group_size(C));
    const uint8_t* w_exp = static_cast<const uint8_t*>(w) + int64_t(s.index) * N * row_bytes;
    return skinny::matrix_lane_rows<C>(w_exp, scales, N, K, group, g);
  }
  __device__ const bf16* act_row(const Slice&, int64_t row) const { return a + row * K; }
  __device__ void store(const Slice& s, int64_t row, int64_t group, int g, float lo, float hi) const {
    const float wgt = pair_weight[sorted_pair[row]];
    if constexpr (skinny::is_fp4(C)) {
      lo *= skinny::FP4_UNSCALE, hi *= skinny::FP4_UNSCALE;
      if constexpr (C == skinny::Codes::Nvfp4) {
        lo = __fmul_rn(lo, w_global[s.index]);
        hi = __fmul_rn(hi, w_global[s.index]);
      }
    }
    const int64_t lo_col = 16 * group + g, hi_col = lo_col + 8;
    if (lo_col < N)
      out[row * N + lo_col] = __float2bfloat16_rn(__fmul_rn(wgt, lo + lora.term(row, lo_col, expert_lora::Down)));
    if (hi_col < N)
      out[row * N + hi_col] = __float2bfloat16_rn(__fmul_rn(wgt, hi + lora.term(row, hi_col, expert_lora::Down)));
  }
};

}  // namespace dec

// Workspace layout, each part 256-byte aligned. max_tiles bounds the Tiled path's 64-row tiles (its grid);
// the tile list has room for one tile per pair, the most any path's schedule makes (the decode path's tiles
// can have a single row).
struct Layout {
  size_t counts, cursor, tile_start, num_tiles, tiles, sorted_pair, pos_of_pair, h, y, total;
  int64_t max_tiles;
};

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

Layout layout(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter) {
  const int64_t pairs = tokens * top_k;
  Layout l{};
  l.max_tiles = std::min<int64_t>(pairs, (pairs + BM - 1) / BM + num_experts);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off += align256(bytes);
    return at;
  };
  l.counts = take(sizeof(int32_t) * num_experts);
  l.cursor = take(sizeof(int32_t) * num_experts);
  l.tile_start = take(sizeof(int32_t) * num_experts);
  l.num_tiles = take(sizeof(int32_t));
  l.tiles = take(sizeof(Tile) * std::max<int64_t>(pairs, 1));
  l.sorted_pair = take(sizeof(int32_t) * pairs);
  l.pos_of_pair = take(sizeof(int32_t) * pairs);
  l.h = take(sizeof(bf16) * pairs * inter);
  l.y = take(sizeof(bf16) * pairs * hidden);
  l.total = off;
  return l;
}

}  // namespace

void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float normalize_eps,
                           float scaling, int32_t* experts, float* weights, cudaStream_t stream) {
  SPARROW_CHECK(num_experts > 0, "route_grouped_sigmoid: bad expert count ", num_experts);
  SPARROW_CHECK(n_group >= 1 && num_experts % n_group == 0, "route_grouped_sigmoid: ", num_experts,
                " experts do not split into ", n_group, " groups");
  SPARROW_CHECK(topk_group >= 1 && topk_group <= n_group, "route_grouped_sigmoid: topk_group ", topk_group,
                " not in [1, ", n_group, "]");
  SPARROW_CHECK(top_k >= 1 && top_k <= num_experts, "route_grouped_sigmoid: top_k ", top_k, " not in [1, ",
                num_experts, "]");
  SPARROW_CHECK(tokens >= 0 && tokens <= 0x7fffffff, "route_grouped_sigmoid: bad token count ", tokens);
  if (tokens == 0) return;
  SPARROW_CHECK(num_experts <= 1024, "route_grouped_sigmoid: ", num_experts, " experts; the GPU router takes at most "
                "1024");
  const size_t smem = sizeof(float) * 2 * num_experts + sizeof(int32_t) * top_k + n_group;
  auto go = [&](auto kernel) {
    kernel<<<unsigned(tokens), 32, smem, stream>>>(logits, bias, int(num_experts), int(n_group), int(topk_group),
                                                   int(top_k), normalize, normalize_eps, scaling, experts, weights);
  };
  const int64_t per_lane = (num_experts + 31) / 32;
  if (per_lane <= 1) go(route_kernel<1>);
  else if (per_lane <= 2) go(route_kernel<2>);
  else if (per_lane <= 4) go(route_kernel<4>);
  else if (per_lane <= 8) go(route_kernel<8>);
  else if (per_lane <= 16) go(route_kernel<16>);
  else go(route_kernel<32>);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float scaling,
                           int32_t* experts, float* weights, cudaStream_t stream) {
  route_grouped_sigmoid(logits, bias, tokens, num_experts, n_group, topk_group, top_k, normalize, 1e-20f, scaling,
                        experts, weights, stream);
}

namespace {

// One thread per token: kernels/uniform_routing.h's draw, keyed by the token's bf16 hidden values.
__global__ void uniform_routing_kernel(const bf16* x, int tokens, int64_t hidden, int num_experts, int top_k,
                                       uint32_t salt, float weight, int32_t* experts, float* weights) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const auto* bits = reinterpret_cast<const uint16_t*>(x + int64_t(t) * hidden);
  uniform_routing::draw_experts(uniform_routing::token_key(bits, hidden, salt), num_experts, top_k,
                                experts + int64_t(t) * top_k);
  for (int j = 0; j < top_k; ++j) weights[int64_t(t) * top_k + j] = weight;
}

}  // namespace

void simulate_uniform_routing(const void* x, int64_t tokens, int64_t hidden, int64_t num_experts, int64_t top_k,
                              uint32_t salt, float weight, int32_t* experts, float* weights, cudaStream_t stream) {
  SPARROW_CHECK(num_experts > 0 && num_experts <= 65536, "simulate_uniform_routing: bad expert count ", num_experts);
  SPARROW_CHECK(top_k >= 1 && top_k <= num_experts, "simulate_uniform_routing: top_k ", top_k, " not in [1, ",
                num_experts, "]");
  SPARROW_CHECK(tokens >= 0 && tokens <= 0x7fffffff && hidden > 0, "simulate_uniform_routing: bad sizes ", tokens,
                " x ", hidden);
  if (tokens == 0) return;
  constexpr int kThreads = 128;
  uniform_routing_kernel<<<unsigned((tokens + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const bf16*>(x), int(tokens), hidden, int(num_experts), int(top_k), salt, weight, experts, weights);
  SPARROW_CUDA_CHECK_LAUNCH();
}

size_t moe_workspace_bytes(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter) {
  return layout(tokens, top_k, num_experts, hidden, inter).total;
}

namespace {

// The wgmma products (wg:: above) where every tile is full in N and K and the experts have, on average,
// at least 32 rows each (prefill-sized steps: DeepSeek-V3.2 from 1024 tokens); decode-sized steps take
// the decode kernel (use_decode), the sizes between the WMMA kernel.
bool wgmma_fits(int64_t hidden, int64_t inter) { return hidden % wg::BN == 0 && inter % 128 == 0; }
bool use_wgmma(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter) {
  return wgmma_fits(hidden, inter) && tokens * top_k >= 32 * num_experts;
}

// Decode steps: at most 8 rows per expert on average. The decode kernel reads each touched expert's
// weights once per tile of up to 8 of its rows, the tiled kernels once per 64-row tile, so both read the
// minimum while experts have <= 8 rows; the decode kernel streams at HBM speed (FP8: ~55 instructions per
// 16 weight bytes, independent of the rows, against ~120 available; see gemm/skinny.cuh), the WMMA tiles
// reached 16-20% of HBM (FP8) there. At 8 rows per expert on average with uniform routing (Poisson(8)
// rows), 41% of the experts have two tiles, whose CTAs run side by side so that the second read can come
// from the L2 (dec:: above); beyond that the tiles of 8 multiply and the 64-row tiles take over. Activation rows
// of both products must fit the shared-memory budget (K up to ~57K).
bool decode_fits(int64_t hidden, int64_t inter, skinny::Codes codes) {
  return skinny::pitch_bytes(hidden, codes) <= skinny::SMEM_CAP && skinny::pitch_bytes(inter, codes) <= skinny::SMEM_CAP;
}
bool use_decode(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter) {
  const int64_t pairs = tokens * top_k;
  return pairs <= skinny::MAX_ROWS * num_experts && pairs <= (int64_t(1) << 30) &&
         decode_fits(hidden, inter, skinny::Codes::Bf16) && decode_fits(hidden, inter, skinny::Codes::Fp8);
}

}  // namespace

MoePath moe_experts_path(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter) {
  // Batch-invariant mode (core/batch_invariance.h): the paths still change with the step's size, but every
  // one gives a row the same bits: the decode path runs its ordered products (skinny_ordered.cuh: the tiled
  // kernels' chunks in their order; bf16 and FP8 weights, the group-scaled formats take the tiles instead,
  // run_moe_experts), and beyond decode sizes the wgmma kernel where the shape fits it, else the WMMA tiles.
  // None splits K, and a row of an MMA's product is its row of A times B whatever the other rows hold.
  if (batch_invariant()) {
    if (use_decode(tokens, top_k, num_experts, hidden, inter)) return MoePath::Decode;
    return wgmma_fits(hidden, inter) ? MoePath::Wgmma : MoePath::Tiled;
  }
  if (use_decode(tokens, top_k, num_experts, hidden, inter)) return MoePath::Decode;
  if (use_wgmma(tokens, top_k, num_experts, hidden, inter)) return MoePath::Wgmma;
  return MoePath::Tiled;
}

namespace {

// One decode product (skinny::make_plan: up to 8 rows per pass -- never more than the step's tokens: a
// router gives a token distinct experts, so an expert has at most `tokens` rows; other routings just take
// more passes -- and 4 or 8 warps per CTA by shared memory). groups: 16-row weight groups per expert
// (gate/up: inter / 8; down: ceil(hidden / 16)); slots: the bound on touched experts (min(pairs, experts)).
// Batch-invariant mode: the ordered products (skinny_ordered.cuh), which bf16 and FP8 weights have.
bool ordered_decode(skinny::Codes codes) {
  return batch_invariant() && (codes == skinny::Codes::Bf16 || codes == skinny::Codes::Fp8);
}
skinny::Plan decode_plan(int64_t tokens, int64_t K, skinny::Codes codes) {
  return ordered_decode(codes) ? skinny::make_ordered_plan(tokens, K) : skinny::make_plan(tokens, K, codes);
}

template <class Job, skinny::Codes C>
void launch_decode(const char* what, Job job, int64_t slots, int64_t groups, int64_t tokens, cudaStream_t stream) {
  const skinny::Plan plan = decode_plan(tokens, job.K, C);
  job.rows = plan.rows;
  job.pitch = plan.pitch;
  const dim3 grid(unsigned(slots), unsigned((groups + plan.warps - 1) / plan.warps));
  SPARROW_CHECK(slots <= 0x7fffffff && grid.y <= 65535, what, ": decode grid too large");
  if constexpr (C == skinny::Codes::Bf16 || C == skinny::Codes::Fp8) {
    if (ordered_decode(C)) return skinny::launch_ordered<Job, C>(job, grid, plan, stream);
  }
  skinny::launch<Job, C>(job, grid, plan, stream);
}

// The decode tiles' rows: one pass of both products (the fewer of their plans' rows), so no CTA loops.
int decode_tile_rows(int64_t tokens, int64_t hidden, int64_t inter, skinny::Codes codes) {
  return std::min(decode_plan(tokens, hidden, codes).rows, decode_plan(tokens, inter, codes).rows);
}

// The decode grid's bound on tiles: a touched expert (at most min(pairs, experts) of them) with c rows has
// ceil(c / R) <= c / R + 1 tiles, so at most ceil(pairs / R) + touched in all, and never more than pairs.
int64_t decode_slots(int64_t pairs, int64_t num_experts, int tile_rows) {
  return std::min(pairs, std::min(pairs, num_experts) + (pairs + tile_rows - 1) / tile_rows);
}

template <bool GATE_UP, skinny::Codes C>
void launch_wgmma(const char* what, const wg::Args& args, int64_t max_tiles, cudaStream_t stream) {
  constexpr int smem = wg::smem_bytes(C);
  static const bool configured = [] {
    SPARROW_CUDA_CHECK(
        cudaFuncSetAttribute(wg::grouped_kernel<GATE_UP, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  const int64_t ctas = max_tiles * args.n_tiles;
  SPARROW_CHECK(ctas <= 0x7fffffff, what, ": too many tiles (", ctas, ")");
  wg::grouped_kernel<GATE_UP, C><<<unsigned(ctas), wg::THREADS, smem, stream>>>(args);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// The scales of moe_experts (none), moe_experts_fp8 (block scales) and moe_experts_packed (group scales and,
// NVFP4, the per-matrix global scales).
struct ExpertScales {
  const float* gate_up_blocks = nullptr;
  const float* down_blocks = nullptr;
  const uint8_t* gate_up_groups = nullptr;
  const uint8_t* down_groups = nullptr;
  const float* gate_up_global = nullptr;
  const float* down_global = nullptr;
};

template <skinny::Codes C>
void run_moe_experts(const char* what, const void* x, int64_t tokens, int64_t hidden, const int32_t* experts,
                     const float* weights, int64_t top_k, const void* gate_up, const void* down,
                     const ExpertScales& sc, int64_t num_experts, int64_t inter, Glu glu_kind, float alpha,
                     float limit, void* out, void* workspace, cudaStream_t stream, const ExpertLora* lora) {
  constexpr bool FP8 = C == skinny::Codes::Fp8, GROUPED = skinny::has_groups(C);
  const bool adapted = lora != nullptr && lora->adapters > 0;
  if (adapted)
    SPARROW_CHECK(lora->token_adapter != nullptr && lora->entries != nullptr && lora->max_rank >= 1 &&
                      reinterpret_cast<uintptr_t>(lora->workspace) % 16 == 0 && lora->workspace != nullptr,
                  what, ": expert LoRA needs its token adapters, entries and a 16-byte aligned workspace");
  const float* gate_up_scales = sc.gate_up_blocks;
  const float* down_scales = sc.down_blocks;
  SPARROW_CHECK(tokens >= 0 && top_k >= 1 && num_experts >= 1 && hidden > 0 && inter > 0, what,
                ": bad sizes tokens=", tokens, " top_k=", top_k, " experts=", num_experts);
  const int64_t mult = skinny::piece_cols(C);  // 16-byte chunks: 8 bf16, 16 e4m3 codes or 32 e2m1 codes
  SPARROW_CHECK(hidden % mult == 0 && inter % mult == 0, what, ": hidden (", hidden, ") and intermediate (", inter,
                ") must be multiples of ", mult);
  SPARROW_CHECK(tokens * top_k <= 0x7fffffff, what, ": too many (token, expert) pairs");
  const void* operands[] = {x, gate_up, down, out, workspace};
  for (const void* p : operands)
    SPARROW_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, what, ": operands must be 16-byte aligned");
  if constexpr (GROUPED) {
    SPARROW_CHECK(sc.gate_up_groups != nullptr && sc.down_groups != nullptr, what, ": null weight scales");
    SPARROW_CHECK((C != skinny::Codes::Nvfp4) == (sc.gate_up_global == nullptr && sc.down_global == nullptr), what,
                  ": NVFP4 weights take global scales (weight_scale_2), MXFP4 and MXFP8 weights none");
    SPARROW_CHECK(decode_fits(hidden, inter, C), what, ": hidden (", hidden, ") or intermediate (", inter,
                  ") too wide for the decode kernel's staged activation rows");
    SPARROW_CHECK(hidden % 32 == 0 && inter % 32 == 0, what, ": hidden (", hidden, ") and intermediate (", inter,
                  ") must be multiples of the 32-value scale groups");
    SPARROW_CHECK(tokens * top_k <= (int64_t(1) << 30), what, ": too many (token, expert) pairs");
  }
  if constexpr (FP8) {
    SPARROW_CHECK(gate_up_scales != nullptr && down_scales != nullptr, what, ": null weight scales");
    SPARROW_CHECK(reinterpret_cast<uintptr_t>(gate_up_scales) % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(down_scales) % 4 == 0,
                  what, ": weight scales must be 4-byte aligned");
  }
  if (tokens == 0) return;
  const int64_t pairs = tokens * top_k;
  const Layout l = layout(tokens, top_k, num_experts, hidden, inter);
  char* ws = static_cast<char*>(workspace);
  auto* counts = reinterpret_cast<int32_t*>(ws + l.counts);
  auto* cursor = reinterpret_cast<int32_t*>(ws + l.cursor);
  auto* tile_start = reinterpret_cast<int32_t*>(ws + l.tile_start);
  auto* num_tiles = reinterpret_cast<int32_t*>(ws + l.num_tiles);
  auto* tiles = reinterpret_cast<Tile*>(ws + l.tiles);
  auto* sorted_pair = reinterpret_cast<int32_t*>(ws + l.sorted_pair);
  auto* pos_of_pair = reinterpret_cast<int32_t*>(ws + l.pos_of_pair);
  auto* h = reinterpret_cast<bf16*>(ws + l.h);
  auto* y = reinterpret_cast<bf16*>(ws + l.y);

  // Every format takes the same path for a shape (moe_experts_path), except that the wgmma kernel copies
  // group scales in 8-byte (NVFP4) or 4-byte (MX) pieces: scale arrays not aligned to them take the WMMA
  // tiles instead.
  MoePath path = moe_experts_path(tokens, top_k, num_experts, hidden, inter);
  if (path == MoePath::Decode && batch_invariant() && !ordered_decode(C))  // no ordered decode products
    path = wgmma_fits(hidden, inter) ? MoePath::Wgmma : MoePath::Tiled;
  const uintptr_t scale_align = C == skinny::Codes::Nvfp4 ? 8 : 4;
  if (GROUPED && path == MoePath::Wgmma &&
      (reinterpret_cast<uintptr_t>(sc.gate_up_groups) % scale_align != 0 ||
       reinterpret_cast<uintptr_t>(sc.down_groups) % scale_align != 0))
    path = MoePath::Tiled;
  const int tile_rows = path == MoePath::Decode ? decode_tile_rows(tokens, hidden, inter, C) : 0;
  if (path == MoePath::Decode && num_experts <= DECODE_SORT_EXPERTS && pairs <= DECODE_SORT_PAIRS) {
    decode_sort_kernel<<<1, DECODE_SORT_THREADS, 0, stream>>>(experts, int(pairs), int(num_experts), tile_rows, tiles,
                                                             num_tiles, sorted_pair, pos_of_pair);
    SPARROW_CUDA_CHECK_LAUNCH();
  } else {
    SPARROW_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int32_t) * num_experts, stream));
    const int pair_blocks = int(std::min<int64_t>((pairs + 255) / 256, 4096));
    count_kernel<<<pair_blocks, 256, 0, stream>>>(experts, pairs, int(num_experts), counts);
    SPARROW_CUDA_CHECK_LAUNCH();
    // Decode: tiles of one pass (use_decode keeps pairs <= 2^30: no overflow in the schedule's arithmetic).
    const int bm = path == MoePath::Decode ? tile_rows : path == MoePath::Wgmma ? wg::BM : BM;
    schedule_kernel<<<1, SCHEDULE_THREADS, 0, stream>>>(counts, int(num_experts), bm, cursor, tiles, num_tiles,
                                                        tile_start);
    SPARROW_CUDA_CHECK_LAUNCH();
    place_kernel<<<pair_blocks, 256, 0, stream>>>(experts, pairs, int(num_experts), cursor, sorted_pair, pos_of_pair);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
  const bool wide = path == MoePath::Wgmma;
  // LoRA: u of gate and up from x now, u of down from h once the first product has written it.
  expert_lora::LoraTerms terms{};
  auto shrink = [&](const void* act, int64_t K, bool by_row, int first, int last) {
    expert_lora::shrink(*lora, terms, experts, pos_of_pair, pairs, int(top_k), int(num_experts),
                        static_cast<const bf16*>(act), K, by_row, first, last, stream);
    SPARROW_CUDA_CHECK_LAUNCH();
  };
  if (adapted) {
    terms = expert_lora::terms_of(*lora, pairs, num_experts);
    shrink(x, hidden, false, expert_lora::Gate, expert_lora::Up);
  }

  if (path == MoePath::Decode) {
    const int64_t slots = decode_slots(pairs, num_experts, tile_rows);  // the tile list has room for pairs
    const dec::GateUp<C> up{{tiles, num_tiles, sorted_pair, int(top_k), static_cast<const bf16*>(x), hidden,
                             gate_up, gate_up_scales, sc.gate_up_groups, sc.gate_up_global, inter, nullptr, h, 0, 0,
                             glu_kind, alpha, limit, terms}};
    launch_decode<dec::GateUp<C>, C>(what, up, slots, inter / 8, tokens, stream);
    if (adapted) shrink(h, inter, true, expert_lora::Down, expert_lora::Down);
    const dec::Down<C> dn{{tiles, num_tiles, sorted_pair, int(top_k), h, inter, down, down_scales, sc.down_groups,
                           sc.down_global, hidden, weights, y, 0, 0, glu_kind, alpha, limit, terms}};
    launch_decode<dec::Down<C>, C>(what, dn, slots, (hidden + 15) / 16, tokens, stream);
    launch_combine(y, pos_of_pair, tokens, int(top_k), hidden, static_cast<bf16*>(out), stream);
    SPARROW_CUDA_CHECK_LAUNCH();
    return;
  }

  if (wide) {
    // At most pairs / wg::BM full tiles plus one partial tile per expert, and never more tiles than rows.
    const int64_t max_tiles = std::min<int64_t>(pairs, (pairs + wg::BM - 1) / wg::BM + num_experts);
    wg::Args up{};  // the fields both products share, then gate/up's
    up.tiles = tiles, up.num_tiles = num_tiles, up.tile_start = tile_start, up.counts = counts;
    up.sorted_pair = sorted_pair, up.top_k = int(top_k), up.kind = glu_kind, up.alpha = alpha, up.limit = limit;
    up.lora = terms;
    wg::Args dn = up;
    up.a = static_cast<const bf16*>(x), up.K = hidden, up.N = inter, up.n_tiles = int(inter / 128), up.out = h;
    up.w = gate_up, up.w_scales = gate_up_scales, up.w_groups = sc.gate_up_groups, up.w_global = sc.gate_up_global;
    launch_wgmma<true, C>(what, up, max_tiles, stream);
    if (adapted) shrink(h, inter, true, expert_lora::Down, expert_lora::Down);
    dn.a = h, dn.K = inter, dn.N = hidden, dn.n_tiles = int(hidden / wg::BN), dn.out = y, dn.pair_weight = weights;
    dn.w = down, dn.w_scales = down_scales, dn.w_groups = sc.down_groups, dn.w_global = sc.down_global;
    launch_wgmma<false, C>(what, dn, max_tiles, stream);
    launch_combine(y, pos_of_pair, tokens, int(top_k), hidden, static_cast<bf16*>(out), stream);
    SPARROW_CUDA_CHECK_LAUNCH();
    return;
  }

  const dim3 grid1(unsigned(l.max_tiles), unsigned((inter + BN - 1) / BN));
  SPARROW_CHECK(grid1.y <= 65535, what, ": intermediate size too large");
  grouped_gemm_kernel<true, C><<<grid1, THREADS, 0, stream>>>(
      tiles, num_tiles, sorted_pair, int(top_k), static_cast<const bf16*>(x), gate_up, gate_up_scales, sc.gate_up_groups,
      sc.gate_up_global, nullptr, hidden, inter, h, glu_kind, alpha, limit, terms);
  SPARROW_CUDA_CHECK_LAUNCH();
  if (adapted) shrink(h, inter, true, expert_lora::Down, expert_lora::Down);
  const dim3 grid2(unsigned(l.max_tiles), unsigned((hidden + BN - 1) / BN));
  SPARROW_CHECK(grid2.y <= 65535, what, ": hidden size too large");
  grouped_gemm_kernel<false, C><<<grid2, THREADS, 0, stream>>>(tiles, num_tiles, sorted_pair, int(top_k), h, down,
                                                               down_scales, sc.down_groups, sc.down_global, weights,
                                                               inter, hidden, y, glu_kind, alpha, limit, terms);
  SPARROW_CUDA_CHECK_LAUNCH();
  launch_combine(y, pos_of_pair, tokens, int(top_k), hidden, static_cast<bf16*>(out), stream);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_experts(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                 int64_t top_k, const void* gate_up, const void* down, int64_t num_experts, int64_t inter,
                 Glu glu_kind, float alpha, float limit, void* out, void* workspace, cudaStream_t stream,
                 const ExpertLora* lora) {
  run_moe_experts<skinny::Codes::Bf16>("moe_experts", x, tokens, hidden, experts, weights, top_k, gate_up, down, {},
                                       num_experts, inter, glu_kind, alpha, limit, out, workspace, stream, lora);
}

void moe_experts_fp8(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                     int64_t top_k, const uint8_t* gate_up, const float* gate_up_scales, const uint8_t* down,
                     const float* down_scales, int64_t num_experts, int64_t inter, Glu glu_kind, float alpha,
                     float limit, void* out, void* workspace, cudaStream_t stream, const ExpertLora* lora) {
  ExpertScales sc;
  sc.gate_up_blocks = gate_up_scales;
  sc.down_blocks = down_scales;
  run_moe_experts<skinny::Codes::Fp8>("moe_experts_fp8", x, tokens, hidden, experts, weights, top_k, gate_up, down, sc,
                                      num_experts, inter, glu_kind, alpha, limit, out, workspace, stream, lora);
}

void moe_experts_packed(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                        int64_t top_k, WeightCodes kind, const uint8_t* gate_up, const uint8_t* gate_up_scales,
                        const float* gate_up_global, const uint8_t* down, const uint8_t* down_scales,
                        const float* down_global, int64_t num_experts, int64_t inter, Glu glu_kind, float alpha,
                        float limit, void* out, void* workspace, cudaStream_t stream,
                        const ExpertLora* lora) {
  ExpertScales sc;
  sc.gate_up_groups = gate_up_scales;
  sc.down_groups = down_scales;
  sc.gate_up_global = gate_up_global;
  sc.down_global = down_global;
  const char* what = "moe_experts_packed";
  switch (kind) {
    case WeightCodes::Nvfp4:
      return run_moe_experts<skinny::Codes::Nvfp4>(what, x, tokens, hidden, experts, weights, top_k, gate_up, down, sc,
                                                   num_experts, inter, glu_kind, alpha, limit, out, workspace, stream,
                                                   lora);
    case WeightCodes::Mxfp4:
      return run_moe_experts<skinny::Codes::Mxfp4>(what, x, tokens, hidden, experts, weights, top_k, gate_up, down, sc,
                                                   num_experts, inter, glu_kind, alpha, limit, out, workspace, stream,
                                                   lora);
    case WeightCodes::Mxfp8:
      return run_moe_experts<skinny::Codes::Mxfp8>(what, x, tokens, hidden, experts, weights, top_k, gate_up, down, sc,
                                                   num_experts, inter, glu_kind, alpha, limit, out, workspace, stream,
                                                   lora);
    default: break;
  }
  fail(what, ": the weights must be NVFP4, MXFP4 or MXFP8");
}

size_t expert_lora_workspace_bytes(int64_t pairs, int64_t max_rank) {
  return expert_lora::u_bytes(pairs, max_rank) + size_t(pairs) * sizeof(int32_t);
}

void keep_local_experts(int32_t* experts, int64_t slots, int first, int count, cudaStream_t stream) {
  if (slots == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((slots + 255) / 256, 1024));
  keep_local_experts_kernel<<<blocks, 256, 0, stream>>>(experts, slots, first, count);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
