// Exact top-k by radix select (topk.h). Scores map to 32-bit keys whose unsigned order is the float
// order (flip all bits of negatives, set the sign bit of positives; -0 counts as +0, NaN becomes 0 and
// ranks last). Three histogram passes over 11, 11 and 10 bits find the key T of the k-th largest
// element and how many elements equal to T are taken (`need`); a last in-order pass writes every index
// with key > T and the first `need` with key == T, already ascending (ties to the smaller index), so
// nothing is sorted.
//
// Each CTA keeps a slice of at most 16K keys of one row in shared memory, read from HBM once. A long
// row is split over G CTAs that add their histograms into a per-row global histogram and meet at a
// per-row barrier (an atomic counter) after each pass; the launch is cooperative so that all CTAs of a
// row are resident together (the grid is a multiple of G and CTAs take rows in waves).
#include "kernels/cuda/topk/topk.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {
namespace {

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

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN: below -inf
  if (b == 0x80000000u) b = 0u;                   // -0 ties with +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

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

__global__ void __launch_bounds__(kThreads) topk_kernel(TopkParams p) {
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

int sm_count() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    SPARROW_CUDA_CHECK(cudaGetDevice(&dev));
    SPARROW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  }
  return sms;
}

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

}  // namespace

size_t topk_workspace_bytes(int64_t rows, int64_t max_len, int k) {
  if (rows <= 0 || max_len <= k) return 0;
  const Plan plan = make_plan(rows, max_len);
  return size_t(rows) * size_t(plan.ws_stride) * sizeof(int);
}

void topk_rows(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
               int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  SPARROW_CHECK(k > 0 && rows >= 0 && max_len >= 0 && ld >= max_len, "topk_rows: bad arguments (k ", k, ", rows ",
                rows, ", max_len ", max_len, ", ld ", ld, ")");
  if (rows == 0) return;
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
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kMaxSlice * int(sizeof(uint32_t))));
    attr_set = true;
  }
  if (plan.parts == 1) {
    const int64_t grid = std::min<int64_t>(rows, int64_t(1) << 30);
    topk_kernel<<<unsigned(grid), kThreads, smem, stream>>>(p);
    SPARROW_CUDA_CHECK_LAUNCH();
    return;
  }
  SPARROW_CUDA_CHECK(cudaMemsetAsync(workspace, 0, need, stream));
  int per_sm = 0;
  SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_kernel, kThreads, smem));
  const int64_t resident = int64_t(per_sm) * sm_count();
  SPARROW_CHECK(resident >= plan.parts, "topk_rows: ", plan.parts, " CTAs per row cannot be resident together");
  const int64_t grid = std::min<int64_t>(p.items, resident / plan.parts * plan.parts);
  void* args[] = {&p};
  SPARROW_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(topk_kernel), dim3(unsigned(grid)),
                                                 dim3(kThreads), args, smem, stream));
}

}  // namespace sparrow::cuda
