// Exact top-k (topk.h). Scores map to 32-bit keys whose unsigned order is the float order (flip all
// bits of negatives, set the sign bit of positives; -0 counts as +0, NaN becomes 0 and ranks last).
//
// Main path ("streaming filter", k <= kMaxK): a CTA reads its slice of a row once, 16K scores per step
// (float4 loads, the next step prefetched into L2), and appends, in index order, every element whose
// key is >= a running lower bound `lo` to a buffer in shared memory. When the buffer would overflow it
// is cut to its exact top-k (radix select + in-order compaction) and `lo` becomes T+1, T being the k-th
// key: the buffer then holds k elements with key >= T and smaller indices than anything still to come,
// so a later element needs key > T to enter the top-k (ties go to the smaller index). Only candidates
// are ever re-read (from shared memory), so HBM sees the scores once. The end of the stream selects the
// exact top-k of the buffer and writes the indices in buffer order, which is index order: no sort.
// Rows needing more than one CTA (few rows) are split into parts; each part writes its own exact top-k
// (key, index) in index order to the workspace and a second kernel streams the parts' lists, in part
// order, through the same filter. No cooperative launch, no memset, no inter-CTA waiting.
//
// The radix select over the buffer works on key - min (min/max found first), 11 bits at a time from
// the highest set bit of max - min, so a narrow score distribution (the indexer's) spreads over the
// 2048 bins of the first pass instead of piling onto a few, which serialises shared-memory atomics.
//
// Per-row radix passes (`legacy::topk_legacy_kernel`, the first implementation): three histogram passes
// over slices kept in shared memory, long rows split over CTAs meeting at per-row barriers under a
// cooperative launch. It runs below 2M scores per launch (faster there: few rows) and for k > kMaxK, where
// the buffer cannot hold k plus one step. The third method, the sampled threshold, is topk_sampled.cu;
// choose() below picks among the three.
#include "kernels/cuda/topk/topk.h"
#include "kernels/cuda/topk/topk_keys.cuh"

#include "kernels/cuda/topk/topk_registers.cuh"
#include "kernels/cuda/topk/topk_sampled.cuh"

#include <algorithm>
#include <climits>

#include "core/error.h"
#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"

namespace sparrow::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------
// legacy: the first radix-select implementation (TopkMethod::RadixPasses).
namespace legacy {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;
constexpr int kMinSlice = 2048;
constexpr int kMaxSlice = 16384;
constexpr int kMaxParts = kThreads;   // the part prefix sums run one part per thread
constexpr int kHeaderInts = 32;       // per-row workspace: barrier counter, then padding

struct TopkParams {
  const float* scores;
  int64_t ld;
  const int32_t* lengths;
  int64_t rows;
  int64_t max_len;
  int k;
  int32_t* out;
  int* ws;
  int64_t ws_stride;  // ints per row
  int slice;
  int parts;
  int64_t items;      // rows * parts
  bool vec4;
};

using topk_keys::order_key;

// Exclusive prefix sum over the block in thread order; `total` gets the sum of all. scratch: 32 ints.
__device__ __forceinline__ int block_exclusive_sum(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int y = lane < kWarps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int z = __shfl_up_sync(0xffffffffu, y, o);
      if (lane >= o) y += z;
    }
    if (lane < kWarps) scratch[lane] = y;
  }
  __syncthreads();
  const int result = x - v + (warp > 0 ? scratch[warp - 1] : 0);
  total = scratch[kWarps - 1];
  __syncthreads();
  return result;
}

// All `parts` CTAs of a row wait here until each has arrived `phase` times.
__device__ __forceinline__ void row_barrier(int* counter, int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1);
    while (*reinterpret_cast<volatile int*>(counter) < target) __nanosleep(20);
    __threadfence();
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) topk_legacy_kernel(TopkParams p) {
  extern __shared__ uint32_t keys[];
  __shared__ int hist[kBins];
  __shared__ int scratch[32];
  __shared__ int sel_bin, sel_rest;
  __shared__ int warp_gt[kWarps], warp_eq[kWarps], warp_eqb[kWarps], warp_selb[kWarps];
  __shared__ int part_eqb, part_selb;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = p.parts, S = p.slice, k = p.k;

  for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
    const int64_t row = item / G;
    const int part = int(item % G);
    const int64_t len = p.lengths[row];
    const int n = int(len < p.max_len ? len : p.max_len);
    int32_t* out = p.out + row * k;
    if (n <= k) {  // every index is selected
      if (part == 0)
        for (int i = tid; i < k; i += kThreads) out[i] = i < n ? i : -1;
      continue;
    }
    const int lo = part * S;
    const int cnt = max(0, min(n - lo, S));
    const float* src = p.scores + row * p.ld + lo;
    if (p.vec4) {
      const float4* src4 = reinterpret_cast<const float4*>(src);
      const int n4 = cnt >> 2;
#pragma unroll 4
      for (int i = tid; i < n4; i += kThreads) {
        float4 f = __ldcs(src4 + i);
        uint4 u = make_uint4(order_key(f.x), order_key(f.y), order_key(f.z), order_key(f.w));
        reinterpret_cast<uint4*>(keys)[i] = u;
      }
      for (int i = n4 * 4 + tid; i < cnt; i += kThreads) keys[i] = order_key(src[i]);
    } else {
#pragma unroll 4
      for (int i = tid; i < cnt; i += kThreads) keys[i] = order_key(src[i]);
    }
    int* ws = G > 1 ? p.ws + row * p.ws_stride : nullptr;
    int phase = 0;

    uint32_t prefix = 0, pmask = 0;
    int kk = k;  // how many still to take among the keys matching `prefix`
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
      const int nb = pass == 2 ? 1024 : 2048;
      for (int b = tid; b < nb; b += kThreads) hist[b] = 0;
      __syncthreads();
      for (int base = warp * 32; base < cnt; base += kThreads) {
        const int i = base + lane;
        const uint32_t key = i < cnt ? keys[i] : 0u;
        const bool m = i < cnt && (key & pmask) == prefix;
        const uint32_t d = (key >> shift) & uint32_t(nb - 1);
        const uint32_t d0 = __shfl_sync(0xffffffffu, d, 0);
        // Runs of equal digits (ties, padding) would serialise 32 atomics on one bank: add once.
        if (__all_sync(0xffffffffu, m && d == d0)) {
          if (lane == 0) atomicAdd(&hist[d0], 32);
        } else if (m) {
          atomicAdd(&hist[d], 1);
        }
      }
      __syncthreads();
      if (G > 1) {
        int* gh = ws + kHeaderInts + pass * kBins;
        for (int b = tid; b < nb; b += kThreads)
          if (hist[b]) atomicAdd(gh + b, hist[b]);
        row_barrier(ws, G * ++phase);
        for (int b = tid; b < nb; b += kThreads) hist[b] = __ldcg(gh + b);
        __syncthreads();
      }
      // The bin holding the kk-th largest: thread `own` scans bins [own*per, own*per+per) from the
      // top, knowing how many elements lie in the bins above its range.
      const int per = nb / kThreads;
      const int own = kThreads - 1 - tid;
      int v = 0;
      for (int b = 0; b < per; ++b) v += hist[own * per + b];
      int total;
      int above = block_exclusive_sum(v, scratch, total);
      if (above < kk && above + v >= kk) {
        for (int b = own * per + per - 1; b >= own * per; --b) {
          if (above + hist[b] >= kk) {
            sel_bin = b;
            sel_rest = kk - above;
            break;
          }
          above += hist[b];
        }
      }
      __syncthreads();
      prefix |= uint32_t(sel_bin) << shift;
      pmask |= uint32_t(nb - 1) << shift;
      kk = sel_rest;
      __syncthreads();
    }
    const uint32_t T = prefix;
    const int need = kk;  // elements equal to T to take, smallest indices first

    // In-order compaction: warp w owns the contiguous segment [w*seg, (w+1)*seg) of the slice.
    const int seg = ((cnt + kWarps - 1) / kWarps + 31) / 32 * 32;
    const int seg_lo = warp * seg, seg_hi = min(cnt, seg_lo + seg);
    int gt = 0, eq = 0;
    for (int i = seg_lo + lane; i < seg_hi; i += 32) {
      const uint32_t key = keys[i];
      gt += key > T;
      eq += key == T;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      gt += __shfl_xor_sync(0xffffffffu, gt, o);
      eq += __shfl_xor_sync(0xffffffffu, eq, o);
    }
    if (lane == 0) warp_gt[warp] = gt, warp_eq[warp] = eq;
    __syncthreads();
    if (G > 1) {
      int* counts = ws + kHeaderInts + 3 * kBins;
      if (tid == 0) {
        int cg = 0, ce = 0;
        for (int w = 0; w < kWarps; ++w) cg += warp_gt[w], ce += warp_eq[w];
        counts[2 * part] = cg;
        counts[2 * part + 1] = ce;
      }
      row_barrier(ws, G * ++phase);
      const int qg = tid < G ? __ldcg(counts + 2 * tid) : 0;
      const int qe = tid < G ? __ldcg(counts + 2 * tid + 1) : 0;
      int total;
      const int eqb = block_exclusive_sum(qe, scratch, total);
      const int qsel = qg + min(max(need - eqb, 0), qe);
      const int selb = block_exclusive_sum(qsel, scratch, total);
      if (tid == part) part_eqb = eqb, part_selb = selb;
      __syncthreads();
    } else if (tid == 0) {
      part_eqb = 0;
      part_selb = 0;
    }
    if (tid == 0) {
      int eb = part_eqb, sb = part_selb;
      for (int w = 0; w < kWarps; ++w) {
        warp_eqb[w] = eb;
        warp_selb[w] = sb;
        sb += warp_gt[w] + min(max(need - eb, 0), warp_eq[w]);
        eb += warp_eq[w];
      }
    }
    __syncthreads();
    int eb = warp_eqb[warp], sb = warp_selb[warp];
    const unsigned lt = (1u << lane) - 1u;
    for (int base = seg_lo; base < seg_hi; base += 32) {
      const int i = base + lane;
      const uint32_t key = i < seg_hi ? keys[i] : 0u;
      const bool is_eq = i < seg_hi && key == T;
      const unsigned eq_bits = __ballot_sync(0xffffffffu, is_eq);
      const bool sel = (i < seg_hi && key > T) || (is_eq && eb + __popc(eq_bits & lt) < need);
      const unsigned sel_bits = __ballot_sync(0xffffffffu, sel);
      if (sel) out[sb + __popc(sel_bits & lt)] = lo + i;
      eb += __popc(eq_bits);
      sb += __popc(sel_bits);
    }
    __syncthreads();  // the slice and the small arrays are reused by the next item
  }
}

struct Plan {
  int slice = kMinSlice;
  int parts = 1;
  int64_t ws_stride = 0;
};

// Slices sized so that all rows together give about three resident CTAs per SM.
Plan make_plan(int64_t rows, int64_t max_len) {
  Plan plan;
  const int64_t want = std::max<int64_t>(1, int64_t(sm_count()) * 3);
  int64_t s = (max_len * std::max<int64_t>(rows, 1) + want - 1) / want;
  s = std::max<int64_t>(s, (max_len + kMaxParts - 1) / kMaxParts);
  s = (s + 1023) / 1024 * 1024;
  s = std::clamp<int64_t>(s, kMinSlice, kMaxSlice);
  plan.slice = int(s);
  plan.parts = int(std::max<int64_t>(1, (max_len + s - 1) / s));
  SPARROW_CHECK(plan.parts <= kMaxParts, "topk_rows: rows of ", max_len, " scores are too long (at most ",
                int64_t(kMaxParts) * kMaxSlice, ")");
  plan.ws_stride = plan.parts > 1 ? (kHeaderInts + 3 * kBins + 2 * plan.parts + 31) / 32 * 32 : 0;
  return plan;
}

size_t workspace_bytes(int64_t rows, int64_t max_len, int k) {
  if (rows <= 0 || max_len <= k) return 0;
  const Plan plan = make_plan(rows, max_len);
  return size_t(rows) * size_t(plan.ws_stride) * sizeof(int);
}

void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  // Rows no longer than k need no selection: slice one CTA per row and skip the workspace.
  const Plan plan = max_len <= k ? Plan{} : make_plan(rows, max_len);
  const size_t need = size_t(rows) * size_t(plan.ws_stride) * sizeof(int);
  SPARROW_CHECK(workspace_bytes >= need, "topk_rows: workspace of ", workspace_bytes, " bytes, need ", need);
  TopkParams p{scores,     ld, lengths, rows, max_len, k, out, static_cast<int*>(workspace), plan.ws_stride,
               plan.slice, plan.parts, rows * plan.parts,
               ld % 4 == 0 && reinterpret_cast<uintptr_t>(scores) % 16 == 0};
  const size_t smem = size_t(plan.slice) * sizeof(uint32_t);
  static bool attr_set = false;
  if (!attr_set) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(topk_legacy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kMaxSlice * int(sizeof(uint32_t))));
    attr_set = true;
  }
  if (plan.parts == 1) {
    const int64_t grid = std::min<int64_t>(rows, int64_t(1) << 30);
    topk_legacy_kernel<<<unsigned(grid), kThreads, smem, stream>>>(p);
    SPARROW_CUDA_CHECK_LAUNCH();
    return;
  }
  SPARROW_CUDA_CHECK(cudaMemsetAsync(workspace, 0, need, stream));
  int per_sm = 0;
  SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_legacy_kernel, kThreads, smem));
  const int64_t resident = int64_t(per_sm) * sm_count();
  SPARROW_CHECK(resident >= plan.parts, "topk_rows: ", plan.parts, " CTAs per row cannot be resident together");
  const int64_t grid = std::min<int64_t>(p.items, resident / plan.parts * plan.parts);
  void* args[] = {&p};
  SPARROW_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(topk_legacy_kernel), dim3(unsigned(grid)),
                                                 dim3(kThreads), args, smem, stream));
}

}  // namespace legacy

// ---------------------------------------------------------------------------------------------------
// stream_topk: the streaming filter (header comment).
namespace stream_topk {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 4;                       // float4 groups per thread per step
constexpr int kStep = kThreads * 4 * kVec;    // 16384 scores per step
constexpr int kGroup = kThreads * 4;          // scores of one float4 group across the CTA
constexpr int kBuf = 20480;                   // candidate buffer (keys + indices: 160 KiB)
constexpr int kMaxK = kBuf - kStep;           // after a cut to k, one whole step must still fit
constexpr int kBins = 2048;
constexpr int kMinSlice = kStep;              // parts shorter than a step are not worth a CTA
constexpr int kMaxParts = 32;                 // keeps the merge (parts x k candidates) short

struct Smem {
  uint32_t keys[kBuf];
  int32_t idx[kBuf];
  int hist[kBins];
  unsigned long long scan[kWarps];
  uint32_t wmin[kWarps], wmax[kWarps];
  int counts[kMaxParts];
  int sel_bin, sel_rest;
};

struct Params {
  const float* scores;
  int64_t ld;
  const int32_t* lengths;
  int64_t max_len;
  int k;
  int parts;
  int64_t slice;
  int32_t* out;
  uint32_t* cand_keys;  // [rows * parts * k] (parts > 1)
  int32_t* cand_idx;    // [rows * parts * k]
  int* cand_count;      // [rows * parts]
};

// Exclusive prefix sum over the CTA in thread order of 64-bit values (used with packed 16- or 32-bit
// fields that cannot carry into each other); `total` gets the sum over the CTA.
__device__ __forceinline__ unsigned long long block_scan(unsigned long long v, unsigned long long* sc,
                                                         unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sc[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned long long y = lane < kWarps ? sc[lane] : 0ull;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long z = __shfl_up_sync(0xffffffffu, y, o);
      if (lane >= o) y += z;
    }
    if (lane < kWarps) sc[lane] = y;
  }
  __syncthreads();
  const unsigned long long r = x - v + (warp > 0 ? sc[warp - 1] : 0ull);
  total = sc[kWarps - 1];
  __syncthreads();
  return r;
}

// The key T of the kk-th largest of keys[0, n) and how many keys equal to T belong to the top kk
// (`need`). Requires n > kk >= 1. Radix select on d = key - min, 11 bits per pass from the top set bit
// of max - min. Every thread returns the same values.
__device__ void find_threshold(Smem& S, int n, int kk, uint32_t& T, int& need) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t lmin = 0xffffffffu, lmax = 0u;
  for (int i = tid; i < n; i += kThreads) {
    const uint32_t key = S.keys[i];
    lmin = min(lmin, key);
    lmax = max(lmax, key);
  }
  lmin = __reduce_min_sync(0xffffffffu, lmin);
  lmax = __reduce_max_sync(0xffffffffu, lmax);
  if (lane == 0) S.wmin[warp] = lmin, S.wmax[warp] = lmax;
  __syncthreads();
  uint32_t mn = 0xffffffffu, mx = 0u;
#pragma unroll 8
  for (int w = 0; w < kWarps; ++w) mn = min(mn, S.wmin[w]), mx = max(mx, S.wmax[w]);
  const uint32_t range = mx - mn;
  if (range == 0) {  // all keys equal: the first kk in order
    T = mn;
    need = kk;
    __syncthreads();  // wmin/wmax are reused by the next call
    return;
  }
  int rem = 32 - __clz(range);  // d < 2^rem
  uint32_t prefix = 0;          // the bits of d above `rem` chosen so far
  int kr = kk;                  // how many still to take among the keys matching `prefix`
#pragma unroll 1
  while (rem > 0) {
    const int width = min(11, rem), shift = rem - width, nb = 1 << width;
    const uint32_t pmask = rem >= 32 ? 0u : (0xffffffffu << rem);
    for (int b = tid; b < nb; b += kThreads) S.hist[b] = 0;
    __syncthreads();
    for (int base = warp * 32; base < n; base += kThreads) {  // warp-uniform trip count
      const int i = base + lane;
      const uint32_t d = i < n ? S.keys[i] - mn : 0u;
      const bool m = i < n && (d & pmask) == prefix;
      const uint32_t dig = (d >> shift) & uint32_t(nb - 1);
      const uint32_t d0 = __shfl_sync(0xffffffffu, dig, 0);
      // A warp of equal digits (ties, a narrow bin) would serialise 32 atomics on one word: add once.
      if (__all_sync(0xffffffffu, m && dig == d0)) {
        if (lane == 0) atomicAdd(&S.hist[d0], 32);
      } else if (m) {
        atomicAdd(&S.hist[dig], 1);
      }
    }
    __syncthreads();
    // Thread `own` sums bins [own*per, own*per + per) counted from the top; the scan in thread order
    // gives how many keys lie above its range; the one whose range holds the kr-th finds the bin.
    const int per = nb > kThreads ? nb / kThreads : 1;
    const int own = kThreads - 1 - tid;
    int v = 0;
    for (int b = 0; b < per; ++b) {
      const int bin = own * per + b;
      if (bin < nb) v += S.hist[bin];
    }
    unsigned long long tot;
    int above = int(block_scan((unsigned long long)v, S.scan, tot));
    if (above < kr && above + v >= kr) {
      for (int bin = min(own * per + per, nb) - 1; bin >= own * per; --bin) {
        if (above + S.hist[bin] >= kr) {
          S.sel_bin = bin;
          S.sel_rest = kr - above;
          break;
        }
        above += S.hist[bin];
      }
    }
    __syncthreads();
    prefix |= uint32_t(S.sel_bin) << shift;
    kr = S.sel_rest;
    rem = shift;
    __syncthreads();  // sel_bin / hist are rewritten by the next pass
  }
  T = mn + prefix;
  need = kr;
}

// Walks keys[0, n) in order and hands every selected element (key > T, or key == T among the first
// `need` such) to emit(pos_out, key, idx), pos_out counting the selected ones in order. Returns how
// many were selected. Safe for in-place compaction into keys/idx: a tile is read whole before its
// scan's barriers and each element moves to a position no greater than its own.
template <class Emit>
__device__ int compact(Smem& S, int n, uint32_t T, int need, Emit emit) {
  const int tid = threadIdx.x;
  int gbase = 0, ebase = 0;
  for (int t0 = 0; t0 < n; t0 += 4 * kThreads) {
    const int p0 = t0 + 4 * tid;
    uint32_t kx[4];
    int32_t ix[4];
    if (p0 + 4 <= n) {
      const uint4 a = *reinterpret_cast<const uint4*>(&S.keys[p0]);
      const int4 b = *reinterpret_cast<const int4*>(&S.idx[p0]);
      kx[0] = a.x, kx[1] = a.y, kx[2] = a.z, kx[3] = a.w;
      ix[0] = b.x, ix[1] = b.y, ix[2] = b.z, ix[3] = b.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kx[e] = p0 + e < n ? S.keys[p0 + e] : 0u;
        ix[e] = p0 + e < n ? S.idx[p0 + e] : -1;
      }
    }
    int gt = 0, eq = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool valid = p0 + e < n;
      gt += valid && kx[e] > T;
      eq += valid && kx[e] == T;
    }
    unsigned long long tot;
    const unsigned long long ex = block_scan((unsigned long long)gt << 32 | unsigned(eq), S.scan, tot);
    int gb = gbase + int(ex >> 32), eb = ebase + int(ex & 0xffffffffu);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (p0 + e >= n) continue;
      if (kx[e] > T) {
        emit(gb + min(eb, need), kx[e], ix[e]);
        ++gb;
      } else if (kx[e] == T) {
        if (eb < need) emit(gb + eb, kx[e], ix[e]);
        ++eb;
      }
    }
    gbase += int(tot >> 32);
    ebase += int(tot & 0xffffffffu);
  }
  __syncthreads();  // the emitted elements are visible to the whole CTA
  return gbase + min(ebase, need);
}

// Cuts the buffer to its exact top-k (count > k) and returns the new lower bound for later elements.
__device__ uint32_t cut_buffer(Smem& S, int& count, int k) {
  uint32_t T;
  int need;
  find_threshold(S, count, k, T, need);
  count = compact(S, count, T, need, [&](int o, uint32_t key, int32_t id) {
    S.keys[o] = key;
    S.idx[o] = id;
  });
  return T + 1;  // T <= 0xff800000 (+inf), no overflow
}

// Appends one step (kVec groups of 4 consecutive elements per thread; element (u, e) of thread t is the
// step's element u*kGroup + 4t + e, so the step's order is index order) to the buffer: those valid with
// key >= lo, cutting the buffer first when they would not fit. idx_of(u, e) gives an element's index.
template <class IdxOf>
__device__ __forceinline__ void append_step(Smem& S, const uint32_t (&key)[kVec][4], uint32_t vmask, int& count,
                                            uint32_t& lo, int k, IdxOf idx_of) {
  unsigned long long ex, tot;
  int total;
  for (;;) {
    unsigned long long packed = 0;
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      int c = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) c += ((vmask >> (4 * u + e)) & 1u) && key[u][e] >= lo;
      packed |= (unsigned long long)c << (16 * u);  // a group sums to at most kGroup = 4096 < 2^16
    }
    ex = block_scan(packed, S.scan, tot);
    total = 0;
#pragma unroll
    for (int u = 0; u < kVec; ++u) total += int((tot >> (16 * u)) & 0xffffu);
    if (count + total <= kBuf) break;
    lo = cut_buffer(S, count, k);  // count > kBuf - kStep >= k here; afterwards count == k
  }
  int group_base = count;
#pragma unroll
  for (int u = 0; u < kVec; ++u) {
    int o = group_base + int((ex >> (16 * u)) & 0xffffu);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (((vmask >> (4 * u + e)) & 1u) && key[u][e] >= lo) {
        S.keys[o] = key[u][e];
        S.idx[o] = idx_of(u, e);
        ++o;
      }
    }
    group_base += int((tot >> (16 * u)) & 0xffffu);
  }
  count += total;
  // The next step's scan barriers order these writes before any read of the buffer.
}

__device__ __forceinline__ int row_len(const Params& p, int64_t row) {
  const int64_t len = p.lengths[row];
  const int64_t m = len < p.max_len ? len : p.max_len;
  return int(m > 0 ? m : 0);
}

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// One CTA per (row, part): streams the part's scores through the filter; a whole row (parts == 1)
// writes its k indices, a part writes its exact top-min(k, slice) (key, index) in index order.
__global__ void __launch_bounds__(kThreads, 1) topk_stream_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& S = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x;
  const int64_t item = blockIdx.x;
  const int64_t row = item / p.parts;
  const int part = int(item % p.parts);
  const int k = p.k;
  const int n = row_len(p, row);
  int32_t* out = p.out + row * k;
  if (n <= k) {  // every index is selected (the merge kernel skips such rows)
    if (part == 0)
      for (int i = tid; i < k; i += kThreads) out[i] = i < n ? i : -1;
    return;
  }
  const int64_t lo_pos = int64_t(part) * p.slice;
  const int64_t rest = int64_t(n) - lo_pos;
  const int cnt = int(rest <= 0 ? 0 : (rest < p.slice ? rest : p.slice));
  const float* src = p.scores + row * p.ld + lo_pos;
  // Read from the 16-byte aligned address at or below src: virtual position v holds element v - mis.
  // Only groups lying wholly inside [mis, vlen) are read as float4, so nothing outside the row is read.
  const int mis = int((reinterpret_cast<uintptr_t>(src) >> 2) & 3u);
  const float* a = src - mis;
  const int vlen = cnt + mis;
  const int32_t idx0 = int32_t(lo_pos) - mis;  // element index of virtual position 0

  int count = 0;
  uint32_t lo = 0;  // every key is >= 0: NaNs enter until the buffer is first cut
#pragma unroll 1
  for (int c0 = 0; c0 < vlen; c0 += kStep) {
    if (c0 + kStep < vlen) {
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const int v = c0 + kStep + u * kGroup + 4 * tid;
        if (v < vlen) prefetch_l2(a + v);
      }
    }
    float f[kVec][4];
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      const int v0 = c0 + u * kGroup + 4 * tid;
      if (v0 >= mis && v0 + 4 <= vlen) {
        const float4 x = __ldcs(reinterpret_cast<const float4*>(a + v0));
        f[u][0] = x.x, f[u][1] = x.y, f[u][2] = x.z, f[u][3] = x.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[u][e] = (v0 + e >= mis && v0 + e < vlen) ? a[v0 + e] : 0.0f;
      }
    }
    uint32_t key[kVec][4];
    uint32_t vmask = 0;
#pragma unroll
    for (int u = 0; u < kVec; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = c0 + u * kGroup + 4 * tid + e;
        key[u][e] = legacy::order_key(f[u][e]);
        vmask |= uint32_t(v >= mis && v < vlen) << (4 * u + e);
      }
    append_step(S, key, vmask, count, lo, k,
                [&](int u, int e) { return idx0 + c0 + u * kGroup + 4 * tid + e; });
  }
  __syncthreads();
  uint32_t T = 0;
  int need = INT_MAX;  // count <= k: everything (all keys >= 0 = T)
  if (count > k) find_threshold(S, count, k, T, need);
  if (p.parts == 1) {
    const int sel = compact(S, count, T, need, [&](int o, uint32_t, int32_t id) { out[o] = id; });
    for (int i = sel + tid; i < k; i += kThreads) out[i] = -1;  // not reached: count >= k when n > k
  } else {
    const int64_t slot = row * p.parts + part;
    uint32_t* ck = p.cand_keys + slot * k;
    int32_t* ci = p.cand_idx + slot * k;
    const int sel = compact(S, count, T, need, [&](int o, uint32_t key, int32_t id) {
      ck[o] = key;
      ci[o] = id;
    });
    if (tid == 0) p.cand_count[slot] = sel;
  }
}

// One CTA per row split into parts: streams the parts' candidate lists, in part order (index order),
// through the same filter and writes the row's k indices.
__global__ void __launch_bounds__(kThreads, 1) topk_merge_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& S = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int k = p.k, G = p.parts;
  if (row_len(p, row) <= k) return;  // written by topk_stream_kernel
  if (tid < G) S.counts[tid] = __ldcg(p.cand_count + row * G + tid);
  __syncthreads();
  const uint32_t* ck = p.cand_keys + row * G * int64_t(k);
  const int32_t* ci = p.cand_idx + row * G * int64_t(k);
  const int vlen = G * k;  // virtual position v: part v / k, its candidate v % k
  int count = 0;
  uint32_t lo = 0;
#pragma unroll 1
  for (int c0 = 0; c0 < vlen; c0 += kStep) {
    uint32_t key[kVec][4];
    int32_t id[kVec][4];
    uint32_t vmask = 0;
#pragma unroll
    for (int u = 0; u < kVec; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = c0 + u * kGroup + 4 * tid + e;
        const int part = v / k;
        const bool valid = v < vlen && v - part * k < S.counts[part < G ? part : 0];
        key[u][e] = valid ? __ldcg(ck + v) : 0u;
        id[u][e] = valid ? __ldcg(ci + v) : -1;
        vmask |= uint32_t(valid) << (4 * u + e);
      }
    append_step(S, key, vmask, count, lo, k, [&](int u, int e) { return id[u][e]; });
  }
  __syncthreads();
  uint32_t T = 0;
  int need = INT_MAX;
  if (count > k) find_threshold(S, count, k, T, need);
  int32_t* out = p.out + row * k;
  const int sel = compact(S, count, T, need, [&](int o, uint32_t, int32_t id) { out[o] = id; });
  for (int i = sel + tid; i < k; i += kThreads) out[i] = -1;  // not reached: the parts hold >= k
}

struct Plan {
  int parts = 1;
  int64_t slice = 0;
};

// One part per row when the rows alone fill the GPU; otherwise split rows so that rows x parts is
// about one CTA per SM (1 CTA fits an SM), parts at least one step long.
Plan make_plan(int64_t rows, int64_t max_len) {
  Plan plan;
  const int64_t sms = sm_count();
  int64_t parts = std::min<int64_t>(sms / std::max<int64_t>(rows, 1), (max_len + kMinSlice - 1) / kMinSlice);
  parts = std::clamp<int64_t>(parts, 1, kMaxParts);
  plan.slice = (max_len + parts - 1) / parts;
  plan.slice = std::max<int64_t>(4, (plan.slice + 3) / 4 * 4);
  plan.parts = int((max_len + plan.slice - 1) / plan.slice);
  if (plan.parts < 1) plan.parts = 1;
  return plan;
}

size_t workspace_bytes(int64_t rows, int64_t max_len, int k) {
  if (rows <= 0 || max_len <= k) return 0;
  const Plan plan = make_plan(rows, max_len);
  if (plan.parts == 1) return 0;
  const size_t slots = size_t(rows) * size_t(plan.parts);
  return slots * size_t(k) * 2 * sizeof(uint32_t) + slots * sizeof(int);
}

void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, void* workspace, size_t ws_bytes, cudaStream_t stream) {
  const Plan plan = max_len <= k ? Plan{1, std::max<int64_t>(max_len, 1)} : make_plan(rows, max_len);
  const size_t need = max_len <= k ? 0 : workspace_bytes(rows, max_len, k);
  SPARROW_CHECK(ws_bytes >= need, "topk_rows: workspace of ", ws_bytes, " bytes, need ", need);
  SPARROW_CHECK(rows * plan.parts < (int64_t(1) << 31), "topk_rows: too many rows (", rows, ")");
  SPARROW_CHECK(max_len < (int64_t(1) << 31) - kStep, "topk_rows: rows too long (", max_len, ")");
  Params p{scores, ld, lengths, max_len, k, plan.parts, plan.slice, out, nullptr, nullptr, nullptr};
  if (plan.parts > 1) {
    const size_t slots = size_t(rows) * size_t(plan.parts);
    p.cand_keys = static_cast<uint32_t*>(workspace);
    p.cand_idx = reinterpret_cast<int32_t*>(p.cand_keys + slots * size_t(k));
    p.cand_count = reinterpret_cast<int*>(p.cand_idx + slots * size_t(k));
  }
  const int smem = int(sizeof(Smem));
  static bool attr_set = false;
  if (!attr_set) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(topk_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    attr_set = true;
  }
  topk_stream_kernel<<<unsigned(rows * plan.parts), kThreads, smem, stream>>>(p);
  SPARROW_CUDA_CHECK_LAUNCH();
  if (plan.parts > 1) {
    topk_merge_kernel<<<unsigned(rows), kThreads, smem, stream>>>(p);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace stream_topk

}  // namespace

namespace {

// Which of the four exact implementations runs, from `sparrow bench kernels --filter topk` on the H200
// (bench/results/kernels.md, 2026-12-03, k = 2048; µs for radix passes / streaming filter / sampled) and, for
// the register radix select, on an H100 with the three others in the same run (2026-12-05):
//   rows of <= 8K scores, and one row of <= 32K: the register radix select (1-128 x 8K: 13.3-18.7 against
//     the streaming filter's 17.9-19.2; 1 x 32K: 18.0 against the radix passes' 20.0; 8 x 32K and longer rows
//     it loses: 22.0 against 20.7, and 27-234 against 20-59 at 128K);
//   other rows of <= 16K scores: the streaming filter (1-128 x 8K: 17.6-18.9 against 19.2-25.9 and 22.8-32.9);
//   fewer than 2M scores a launch: the radix passes (1 x 128K: 19.8 / 50.6 / 33.5; 8 x 128K: 26.6 / 52.0 /
//     34.5; 1 x 1M: 27.9 / 100.8 / 53.0), where the others' fixed costs (a cluster's selection rounds, the
//     filter's merges) outweigh what they save;
//   2M to 16M scores: the sampled threshold (64 x 128K: 89.4 / 67.7 / 38.1; 128 x 128K: 130.3 / 71.1 / 51.4;
//     8 x 1M: 91.8 / 94.8 / 55.9; 64 x 32K: 31.1 / 41.8 / 24.5);
//   above: the streaming filter (64 x 1M: 464 / 190 / 273; 128 x 1M: 918 / 299 / 485), whose one CTA per row
//     part streams with fewer fixed rounds than the sampled threshold's many waves of clusters.
TopkMethod choose(int64_t rows, int64_t max_len, int k, TopkMethod method) {
  static_assert(stream_topk::kMaxK == kTopkStreamingMaxK);
  SPARROW_CHECK(method != TopkMethod::StreamingFilter || k <= stream_topk::kMaxK, "topk: the streaming filter takes k <= ",
                stream_topk::kMaxK, ", got ", k);
  if (method != TopkMethod::Auto) return method;
  const bool streaming = k <= stream_topk::kMaxK;
  const int64_t scores = rows * max_len;
  if (max_len <= 8192 || (rows == 1 && max_len <= 32768)) return TopkMethod::RegisterRadix;
  if (streaming && max_len <= 16384) return TopkMethod::StreamingFilter;
  if (scores < (int64_t(2) << 20)) return TopkMethod::RadixPasses;
  // (the sampled threshold's buffers hold about 2k candidates a row: rows of at least 16k scores)
  if (scores <= (int64_t(16) << 20) && topk_sampled::supports(max_len) && max_len >= 16 * int64_t(k))
    return TopkMethod::SampledThreshold;
  return streaming ? TopkMethod::StreamingFilter : TopkMethod::RadixPasses;
}

}  // namespace

size_t topk_workspace_bytes(int64_t rows, int64_t max_len, int k, TopkMethod method) {
  switch (choose(rows, max_len, k, method)) {
    case TopkMethod::StreamingFilter: return stream_topk::workspace_bytes(rows, max_len, k);
    case TopkMethod::RadixPasses: return legacy::workspace_bytes(rows, max_len, k);
    default: return 0;
  }
}

// Rows that all fit in k (max_len <= k): 0 .. len-1, then -1 up to k, with no score read. Each method's own
// kernel does the same for such rows, but behind its full launch (the register radix's cluster took ~10 us
// for one 2K row at batch 1: bench/results/kernels.md, "Small kernels at batch 1").
namespace {
__global__ void prefix_indices_kernel(const int32_t* lengths, int k, int32_t* out) {
  const int64_t row = blockIdx.x;
  const int i = int(blockIdx.y * blockDim.x + threadIdx.x);
  if (i >= k) return;
  out[row * k + i] = i < lengths[row] ? i : -1;
}
}  // namespace

void topk_rows(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
               int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream, TopkMethod method) {
  SPARROW_CHECK(k > 0 && rows >= 0 && max_len >= 0 && ld >= max_len, "topk_rows: bad arguments (k ", k, ", rows ",
                rows, ", max_len ", max_len, ", ld ", ld, ")");
  if (rows == 0) return;
  if (method == TopkMethod::Auto && max_len <= k) {
    SPARROW_CHECK(rows <= 0x7fffffff, "topk_rows: too many rows");
    prefix_indices_kernel<<<dim3(unsigned(rows), unsigned((k + 255) / 256)), 256, 0, stream>>>(lengths, k, out);
    SPARROW_CUDA_CHECK_LAUNCH();
    return;
  }
  switch (choose(rows, max_len, k, method)) {
    case TopkMethod::StreamingFilter:
      stream_topk::launch(scores, ld, lengths, rows, max_len, k, out, workspace, workspace_bytes, stream);
      break;
    case TopkMethod::SampledThreshold:
      topk_sampled::launch(scores, ld, lengths, rows, max_len, k, out, stream);
      break;
    case TopkMethod::RegisterRadix:
      topk_registers::launch(scores, ld, lengths, rows, max_len, k, out, stream);
      break;
    default: legacy::launch(scores, ld, lengths, rows, max_len, k, out, workspace, workspace_bytes, stream);
  }
}

}  // namespace sparrow::cuda
