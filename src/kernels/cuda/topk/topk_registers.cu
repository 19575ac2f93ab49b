// Exact top-k by a radix select over keys held in registers (TopkMethod::RegisterRadix, topk.h): built
// for latency, the decode-time case of few to a hundred rows of up to 128K scores, where the other
// methods spend most of their time in rounds of barriers over shared memory rather than in HBM.
//
// One thread-block cluster per row, C = 1..8 CTAs of 512 threads, each owning a contiguous slice of the
// row of at most 16,384 scores. Warp w of a CTA owns the 32·P consecutive scores from w·32·P, lane l the
// float4 groups j·128 + 4l inside them, so every warp load is 512 contiguous bytes and every score is read
// from HBM once, into a register (P = 4..32 a thread), and never stored to shared memory.
//  1. Keys: the scores' bits mapped so that unsigned order is float order (-0 = +0, NaN lowest, as in
//     topk.cu). The cluster's minimum and maximum key (distributed shared memory) fix d = key - min and
//     the number of significant bits of d.
//  2. Passes of 11-bit digits of d from the top: each CTA builds the histogram of its keys that match the
//     digits chosen so far, every CTA sums the cluster's histograms through distributed shared memory and
//     finds the same bin holding the k-th largest (its own scan, no broadcast round). The passes stop when
//     the digits run out or when every key of the chosen bin belongs to the top k; two passes are typical.
//  3. Output: keys above the final bin are taken, keys in it are taken smallest index first (the ties
//     rule of topk.h). A key's place in the ascending output is the number of taken keys before it: CTA
//     offsets through distributed shared memory, warp offsets through shared memory, lane offsets by warp
//     shuffles, in position order, so no sort and no bitmap.
// Each barrier is either a CTA barrier or one of 3 + passes cluster barriers; the result is the same index
// set as the other methods and cpu::top_k, and depends only on the row's scores and k (batch-invariant).
#include "kernels/cuda/topk/topk_registers.cuh"
#include "kernels/cuda/topk/topk_keys.cuh"

#include <cooperative_groups.h>

#include <algorithm>

#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"
#include "core/error.h"

namespace sparrow::cuda::topk_registers {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;  // 4: one int4 of each CTA's histogram
constexpr int kMinSlice = 4096;                   // below this, another CTA costs more than it reads
static_assert(kBinsPerThread == 4, "each thread reads one int4 of bins");

struct Smem {
  __align__(16) int hist[2][kBins];  // alternate passes: a pass's histogram is read by the other CTAs
  unsigned long long scan[kWarps];
  unsigned long long warp_counts[kWarps];  // (keys above the bin) << 32 | (keys in it), per warp
  uint32_t red_min[kWarps], red_max[kWarps];
  int sel_bin, sel_rest, sel_count;
  // Read by the other CTAs of the cluster:
  uint32_t cta_min, cta_max;
  int cta_above, cta_ties;
};

struct Params {
  const float* scores;
  int64_t ld;
  const int32_t* lengths;
  int64_t max_len;
  int k;
  int cluster;
  int slice;
  bool vec4;  // rows and slices start 16-byte aligned
  int32_t* out;
};

using topk_keys::order_key;

// Exclusive prefix sum over the CTA in thread order (64-bit: two 32-bit counts travel packed); `total`
// gets the CTA's sum.
__device__ unsigned long long block_scan(unsigned long long v, Smem& S, unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) S.scan[warp] = x;
  __syncthreads();
  unsigned long long before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const unsigned long long s = S.scan[w];
    before += w < warp ? s : 0ull;
    all += s;
  }
  total = all;
  __syncthreads();  // S.scan is rewritten by the next call
  return before + x - v;
}

// Two CTAs an SM (64 registers a thread) up to 16 scores a thread; at 32 the keys alone would spill there.
template <int P>
__global__ void __launch_bounds__(kThreads, P <= 16 ? 2 : 1) topk_registers_kernel(Params p) {
  static_assert(P % 4 == 0 && P <= kMaxPerThread);
  __shared__ Smem S;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = p.cluster;
  const int rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k = p.k;
  const int64_t len = p.lengths[row];
  const int n = int(len < p.max_len ? (len > 0 ? len : 0) : p.max_len);
  int32_t* out = p.out + row * k;
  if (n <= k) {  // every index is selected; the whole cluster leaves before any shared-memory exchange
    if (rank == 0)
      for (int i = tid; i < k; i += kThreads) out[i] = i < n ? i : -1;
    return;
  }
  const int slice_begin = rank * p.slice;
  const int cnt = max(0, min(n - slice_begin, p.slice));
  const float* src = p.scores + row * p.ld + slice_begin;
  const int wbase = warp * 32 * P;
  // Element (j, e) of this lane sits at slice position wbase + j*128 + 4*lane + e; it is valid when
  // j*128 + e < lim.
  const int lim = cnt - wbase - 4 * lane;

  uint32_t key[P];
#pragma unroll
  for (int j = 0; j < P / 4; ++j) {
    const int at = wbase + j * 128 + 4 * lane;
    if (p.vec4 && j * 128 + 4 <= lim) {
      const float4 f = __ldcs(reinterpret_cast<const float4*>(src + at));
      key[4 * j] = order_key(f.x), key[4 * j + 1] = order_key(f.y);
      key[4 * j + 2] = order_key(f.z), key[4 * j + 3] = order_key(f.w);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) key[4 * j + e] = j * 128 + e < lim ? order_key(__ldcs(src + at + e)) : 0u;
    }
  }
  for (int b = tid; b < kBins; b += kThreads) S.hist[0][b] = 0;

  // 1. The cluster's key range.
  uint32_t lmin = 0xffffffffu, lmax = 0u;
#pragma unroll
  for (int i = 0; i < P; ++i)
    if ((i / 4) * 128 + i % 4 < lim) lmin = min(lmin, key[i]), lmax = max(lmax, key[i]);
  lmin = __reduce_min_sync(0xffffffffu, lmin);
  lmax = __reduce_max_sync(0xffffffffu, lmax);
  if (lane == 0) S.red_min[warp] = lmin, S.red_max[warp] = lmax;
  __syncthreads();
  if (tid == 0) {
    uint32_t a = 0xffffffffu, b = 0u;
    for (int w = 0; w < kWarps; ++w) a = min(a, S.red_min[w]), b = max(b, S.red_max[w]);
    S.cta_min = a, S.cta_max = b;
  }
  cluster.sync();
  uint32_t mn = 0xffffffffu, mx = 0u;
  for (int r = 0; r < C; ++r) {
    const Smem* other = cluster.map_shared_rank(&S, r);
    mn = min(mn, other->cta_min);
    mx = max(mx, other->cta_max);  // a CTA without scores reports (0xffffffff, 0): no effect
  }
  // d = key - mn < 2^rem; invalid elements never match (their d is forced to all ones past the range).
  int rem = 32 - __clz(mx - mn);
#pragma unroll
  for (int i = 0; i < P; ++i) key[i] = (i / 4) * 128 + i % 4 < lim ? key[i] - mn : 0xffffffffu;
  const uint32_t valid_limit = mx - mn;  // every valid d is <= this; the invalid ones are 0xffffffff

  // 2. Digit passes.
  uint32_t prefix = 0;  // the digits of d chosen so far, in place
  int kr = k;           // how many still to take among the keys matching `prefix`
  int buf = 0;
#pragma unroll 1
  while (rem > 0) {
    const int width = min(kDigitBits, rem), shift = rem - width;
    const uint32_t pmask = rem >= 32 ? 0u : (0xffffffffu << rem);
    int* hist = S.hist[buf];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const uint32_t d = key[i];
      if (d <= valid_limit && (d & pmask) == prefix) atomicAdd(&hist[(d >> shift) & uint32_t(kBins - 1)], 1);
    }
    cluster.sync();
    // The other buffer was last read in the previous pass, which every CTA finished before this barrier.
    for (int b = tid; b < kBins; b += kThreads) S.hist[buf ^ 1][b] = 0;
    // Thread `own` sums bins [4 own, 4 own + 4) over the cluster, counted from the top.
    const int own = kThreads - 1 - tid;
    int4 sum = make_int4(0, 0, 0, 0);
    for (int r = 0; r < C; ++r) {
      const int4 v = *reinterpret_cast<const int4*>(cluster.map_shared_rank(hist, r) + kBinsPerThread * own);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const int v = sum.x + sum.y + sum.z + sum.w;
    unsigned long long unused;
    int above = int(block_scan((unsigned long long)v, S, unused));
    if (above < kr && above + v >= kr) {
      const int bins[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
      for (int b = 3; b >= 0; --b) {
        if (above < kr && above + bins[b] >= kr) {
          S.sel_bin = kBinsPerThread * own + b;
          S.sel_rest = kr - above;
          S.sel_count = bins[b];
        }
        above += bins[b];
      }
    }
    __syncthreads();
    prefix |= uint32_t(S.sel_bin) << shift;
    kr = S.sel_rest;
    rem = shift;
    buf ^= 1;
    if (S.sel_count == kr) break;  // the whole bin is taken: its lower digits do not matter
    // (S.sel_* is next written after the next pass's cluster barrier, which every thread reads it before)
  }

  // 3. Output. Keys whose digits above `rem` exceed the chosen ones are "above"; equal ones are "ties",
  // of which the first kr in position order are taken.
  const uint32_t top = prefix >> rem;  // rem <= 21 here, or 0
  int above = 0, ties = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const uint32_t d = key[i];
    above += d <= valid_limit && (d >> rem) > top;
    ties += d <= valid_limit && (d >> rem) == top;
  }
  unsigned long long counts = (unsigned long long)above << 32 | unsigned(ties);
  unsigned long long warp_total = counts;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) warp_total += __shfl_xor_sync(0xffffffffu, warp_total, o);
  if (lane == 0) S.warp_counts[warp] = warp_total;
  __syncthreads();
  unsigned long long before_warp = 0, cta_total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const unsigned long long c = S.warp_counts[w];
    before_warp += w < warp ? c : 0ull;
    cta_total += c;
  }
  if (tid == 0) S.cta_above = int(cta_total >> 32), S.cta_ties = int(cta_total & 0xffffffffu);
  cluster.sync();
  int above_before = 0, ties_before = 0;  // in the lower-ranked CTAs (smaller indices)
  for (int r = 0; r < rank; ++r) {
    const Smem* other = cluster.map_shared_rank(&S, r);
    above_before += other->cta_above;
    ties_before += other->cta_ties;
  }
  above_before += int(before_warp >> 32);
  ties_before += int(before_warp & 0xffffffffu);
  const int index0 = slice_begin + wbase + 4 * lane;
#pragma unroll
  for (int j = 0; j < P / 4; ++j) {
    int a = 0, t = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t d = key[4 * j + e];
      a += d <= valid_limit && (d >> rem) > top;
      t += d <= valid_limit && (d >> rem) == top;
    }
    const int packed = a << 16 | t;  // at most 128 each across the warp
    int incl = packed;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const int excl = incl - packed;
    int ga = above_before + (excl >> 16), gt = ties_before + (excl & 0xffff);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t d = key[4 * j + e];
      if (d > valid_limit) continue;
      if ((d >> rem) > top) {
        out[ga + min(gt, kr)] = index0 + j * 128 + e;
        ++ga;
      } else if ((d >> rem) == top) {
        if (gt < kr) out[ga + gt] = index0 + j * 128 + e;
        ++gt;
      }
    }
    const int warp_sum = __shfl_sync(0xffffffffu, incl, 31);
    above_before += warp_sum >> 16;
    ties_before += warp_sum & 0xffff;
  }
  cluster.sync();  // the other CTAs have read this one's histograms and counts
}

}  // namespace

Plan make_plan(int64_t rows, int64_t max_len) {
  Plan plan;
  // Enough CTAs per row to hold it, and more while the rows leave SMs idle (two CTAs fit an SM) and each
  // CTA keeps at least kMinSlice scores.
  int need = 1;
  while (int64_t(need) * kMaxSlice < max_len) need *= 2;
  const int64_t fill = 2 * int64_t(sm_count()) / std::max<int64_t>(rows, 1);
  const int64_t worth = (max_len + kMinSlice - 1) / kMinSlice;
  const int spread = topk_keys::floor_pow2(std::max<int64_t>(1, std::min<int64_t>({fill, worth, kMaxCluster})));
  plan.cluster = std::max(need, spread);
  plan.slice = int((max_len + plan.cluster - 1) / plan.cluster + 3) / 4 * 4;
  const int per = (plan.slice + kThreads - 1) / kThreads;
  plan.per_thread = per <= 4 ? 4 : per <= 8 ? 8 : per <= 16 ? 16 : 32;
  return plan;
}

bool supports(int64_t max_len) { return max_len <= int64_t(kMaxCluster) * kMaxSlice; }

namespace {
template <int P>
void launch_with(const Params& p, int64_t rows, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(rows * p.cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(p.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  SPARROW_CUDA_CHECK(cudaLaunchKernelEx(&config, topk_registers_kernel<P>, p));
  SPARROW_CUDA_CHECK_LAUNCH();
}
}  // namespace

void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, cudaStream_t stream) {
  SPARROW_CHECK(supports(max_len), "topk_rows: the register radix select takes rows of at most ",
                int64_t(kMaxCluster) * kMaxSlice, " scores, got ", max_len);
  const Plan plan = make_plan(rows, max_len);
  SPARROW_CHECK(plan.cluster <= kMaxCluster && plan.slice <= kMaxSlice && plan.slice <= kThreads * plan.per_thread,
                "topk_rows: bad plan");
  SPARROW_CHECK(rows * plan.cluster < (int64_t(1) << 31), "topk_rows: too many rows (", rows, ")");
  const bool vec4 = ld % 4 == 0 && reinterpret_cast<uintptr_t>(scores) % 16 == 0;
  const Params p{scores, ld, lengths, max_len, k, plan.cluster, plan.slice, vec4, out};
  switch (plan.per_thread) {
    case 4: launch_with<4>(p, rows, stream); break;
    case 8: launch_with<8>(p, rows, stream); break;
    case 16: launch_with<16>(p, rows, stream); break;
    default: launch_with<32>(p, rows, stream);
  }
}

}  // namespace sparrow::cuda::topk_registers
