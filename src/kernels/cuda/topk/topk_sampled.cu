// Exact top-k by a sampled threshold (TopkMethod::SampledThreshold, topk.h). One thread-block cluster
// per row, C = 1..8 CTAs, each owning a contiguous slice of the row; HBM sees each score once.
//  1. Every CTA of the cluster reads the same 1,024 evenly spaced scores of the row and finds among them
//     the key L of rank r_L = r + 4 sqrt(r) + 4, r = k * 1024 / n being the rank the k-th largest key
//     is expected at. So at least k of the row's keys are >= L unless more than r_L - 1 samples lie
//     above the k-th key (a four-sigma event for any order of the scores but an adversarial one), and
//     about (r_L / r) k of them are. Meanwhile the first part of the slice is prefetched into L2.
//  2. Each CTA streams its slice and appends every (key, position) with key >= L to a buffer in shared
//     memory: a comparison per score, a warp-wide append where any lane has a candidate.
//  3. The cluster adds up its candidates through distributed shared memory. Fewer than k, or a full
//     buffer, mean the sample misled: the cluster then selects over its slices in global memory instead
//     (the same selection, read again from L2 / HBM), so the result never depends on the sample, only
//     the time does.
//  4. Radix select over the candidates (11-bit digits of key - L, histograms summed across the cluster)
//     gives the k-th key T and how many keys equal to T belong to the top k.
//  5. Each CTA marks its keys > T, and its keys == T, in two bitmaps over its slice; ties go to the
//     smaller index (CTA order is index order, and within a CTA the bitmap is in index order), and each
//     CTA writes its selected positions, ascending, at its offset in the row's output.
// Keys are the scores' bits mapped so that unsigned order is float order (-0 = +0, NaN lowest), as in
// topk.cu; the result is the same index set as the other two methods and cpu::top_k, batch-invariant:
// a row's result depends on its scores and k only.
#include "kernels/cuda/topk/topk_sampled.cuh"
#include "kernels/cuda/topk/topk_keys.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"
#include "core/error.h"

namespace sparrow::cuda::topk_sampled {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kSamples = kThreads;              // one per thread
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kCap = 8192;                      // candidate buffer per CTA (keys + positions: 64 KiB)
constexpr int kVec = 4;                         // float4 loads per thread per chunk
constexpr int kPerThread = 4 * kVec;            // scores per thread per chunk
constexpr int kChunk = kThreads * kPerThread;   // 16384 scores
constexpr int kPrefetchChunks = 2;              // chunks prefetched into L2 while the sample is selected

struct Smem {
  uint32_t cand_key[kCap];
  uint32_t cand_pos[kCap];                 // position in the slice
  uint32_t above_bits[kMaxSlice / 32];     // keys > T, by position in the slice
  uint32_t tie_bits[kMaxSlice / 32];       // keys == T
  int hist[2][kBins];                      // alternate passes: a pass's histogram is read remotely
  uint32_t samples[kSamples];
  unsigned long long scan[kWarps];
  uint32_t red[kWarps];
  int sel_bin, sel_rest;
  uint32_t lower;                          // L
  // Read by the other CTAs of the cluster:
  int count;                               // candidates appended (may exceed kCap: overflow)
  uint32_t max_key;
  int above, ties;                         // keys > T and == T in this slice
};

struct Params {
  const float* scores;
  int64_t ld;
  const int32_t* lengths;
  int64_t max_len;
  int k;
  int cluster;
  int slice;
  int32_t* out;
};

using topk_keys::order_key;

__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

// Exclusive prefix sum over the CTA in thread order (64-bit, so that two 32-bit counts can travel packed
// in one value); `total` gets the CTA's sum.
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
  if (warp == 0) {
    unsigned long long y = S.scan[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long z = __shfl_up_sync(0xffffffffu, y, o);
      if (lane >= o) y += z;
    }
    S.scan[lane] = y;
  }
  __syncthreads();
  const unsigned long long r = x - v + (warp > 0 ? S.scan[warp - 1] : 0ull);
  total = S.scan[kWarps - 1];
  __syncthreads();
  return r;
}

__device__ uint32_t block_min_max(uint32_t v, bool is_max, Smem& S) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t y = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? max(v, y) : min(v, y);
  }
  if (lane == 0) S.red[warp] = v;
  __syncthreads();
  v = S.red[0];
  for (int w = 1; w < kWarps; ++w) v = is_max ? max(v, S.red[w]) : min(v, S.red[w]);
  __syncthreads();
  return v;
}

// The key T of the kk-th largest among the keys for_each(fn) hands to fn, over the cluster's CTAs
// (cluster_wide) or this CTA alone, and `need`, how many keys equal to T belong to the top kk. Every
// key handed over is >= base with key - base <= range; there are at least kk >= 1 of them. Radix select
// on d = key - base, 11 bits a pass from the highest bit range has, so that keys bunched in a narrow
// range (the indexer's) spread over the bins rather than pile onto a few.
template <class ForEach>
__device__ void radix_select(Smem& S, bool cluster_wide, ForEach for_each, uint32_t base, uint32_t range, int kk,
                             uint32_t& T, int& need) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x;
  const int ranks = cluster_wide ? int(cluster.num_blocks()) : 1;
  uint32_t fixed_mask = 0, fixed_bits = 0;
  int rem = 32 - __clz(range);  // the low `rem` bits of d are still open
  int buf = 0;
  while (rem > 0) {
    const int nb = min(kDigitBits, rem), shift = rem - nb;
    const uint32_t digit_mask = (1u << nb) - 1u;
    int* hist = S.hist[buf];
    for (int b = tid; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for_each([&](uint32_t key) {
      const uint32_t d = key - base;
      if ((d & fixed_mask) == fixed_bits) atomicAdd(&hist[(d >> shift) & digit_mask], 1);
    });
    if (cluster_wide) cluster.sync(); else __syncthreads();
    // Thread t owns bins [own * per, own * per + per), own = kThreads - 1 - t: a scan in thread order
    // counts the keys in higher bins.
    const int own = kThreads - 1 - tid;
    int c[kBinsPerThread];
    int mine = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      c[j] = 0;
      for (int r = 0; r < ranks; ++r) {
        const int* h = cluster_wide ? cluster.map_shared_rank(hist, r) : hist;
        c[j] += h[own * kBinsPerThread + j];
      }
      mine += c[j];
    }
    unsigned long long total;
    int above = int(block_scan((unsigned long long)mine, S, total));
    if (above < kk && above + mine >= kk) {
      for (int j = kBinsPerThread - 1; j >= 0; --j) {
        if (above + c[j] >= kk) {
          S.sel_bin = own * kBinsPerThread + j;
          S.sel_rest = kk - above;
          break;
        }
        above += c[j];
      }
    }
    __syncthreads();
    fixed_bits |= uint32_t(S.sel_bin) << shift;
    fixed_mask |= digit_mask << shift;
    kk = S.sel_rest;
    rem = shift;
    buf ^= 1;
    __syncthreads();  // sel_bin is rewritten by the next pass
  }
  // The other CTAs may still read this CTA's last histogram; nothing may reuse it before they are done.
  if (cluster_wide) cluster.sync();
  T = base + fixed_bits;
  need = kk;
}

__device__ __forceinline__ void mark(Smem& S, uint32_t key, uint32_t pos, uint32_t T) {
  if (key > T) atomicOr(&S.above_bits[pos >> 5], 1u << (pos & 31));
  else if (key == T) atomicOr(&S.tie_bits[pos >> 5], 1u << (pos & 31));
}

__global__ void __launch_bounds__(kThreads, 1) topk_sampled_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& S = *reinterpret_cast<Smem*>(smem_raw);
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31;
  const int C = p.cluster, rank = int(cluster.block_rank()), k = p.k;
  const int64_t row = blockIdx.x / C;
  const int64_t len = p.lengths[row];
  const int n = int(len < p.max_len ? (len > 0 ? len : 0) : p.max_len);
  int32_t* out = p.out + row * k;
  if (n <= k) {  // every index is selected; the whole cluster leaves before any cluster barrier
    if (rank == 0)
      for (int i = tid; i < k; i += kThreads) out[i] = i < n ? i : -1;
    return;
  }
  const int slice_begin = rank * p.slice;
  const int cnt = max(0, min(n - slice_begin, p.slice));
  const float* row_scores = p.scores + row * p.ld;
  const float* src = row_scores + slice_begin;
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15u) == 0;

  for (int c0 = 0; c0 < min(cnt, kPrefetchChunks * kChunk); c0 += 32 * kThreads)  // 128 B a thread
    if (c0 + 32 * tid < cnt) prefetch_l2(src + c0 + 32 * tid);
  const int words = (cnt + 31) / 32;
  for (int w = tid; w < words; w += kThreads) S.above_bits[w] = 0, S.tie_bits[w] = 0;
  if (tid == 0) S.count = 0;
  __syncthreads();

  // 1. The lower bound L from the sample.
  S.samples[tid] = order_key(row_scores[(2 * int64_t(tid) + 1) * n / (2 * kSamples)]);
  const double r = double(k) * kSamples / n;
  const int sample_rank = int(ceil(r + 4.0 * sqrt(r) + 4.0));
  uint32_t lower = 0;
  if (sample_rank < kSamples) {
    const uint32_t smin = block_min_max(S.samples[tid], false, S);  // also orders the samples' writes
    const uint32_t smax = block_min_max(S.samples[tid], true, S);
    int unused;
    radix_select(S, false, [&](auto fn) { fn(S.samples[tid]); }, smin, smax - smin, sample_rank, lower, unused);
  }

  // 2. One pass over the slice: candidates (key >= L) into the buffer.
  uint32_t max_key = 0;
#pragma unroll 1
  for (int c0 = 0; c0 < cnt; c0 += kChunk) {
    if (c0 + kPrefetchChunks * kChunk < cnt) {
      const int v = c0 + kPrefetchChunks * kChunk + 32 * tid;
      if (tid < kChunk / 32 && v < cnt) prefetch_l2(src + v);
    }
    // Element j of this thread: vec, float4 group j / 4 (groups kThreads * 4 apart), lane j % 4 of it;
    // otherwise scores kThreads apart. Either way coalesced.
    auto pos_of = [&](int j) { return vec ? c0 + (j >> 2) * 4 * kThreads + 4 * tid + (j & 3) : c0 + j * kThreads + tid; };
    uint32_t key[kPerThread];
    if (vec) {
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const int p0 = pos_of(4 * u);
        float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
        if (p0 + 4 <= cnt) {
          f = __ldcs(reinterpret_cast<const float4*>(src + p0));
        } else {
          if (p0 + 0 < cnt) f.x = src[p0 + 0];
          if (p0 + 1 < cnt) f.y = src[p0 + 1];
          if (p0 + 2 < cnt) f.z = src[p0 + 2];
        }
        key[4 * u + 0] = order_key(f.x), key[4 * u + 1] = order_key(f.y);
        key[4 * u + 2] = order_key(f.z), key[4 * u + 3] = order_key(f.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) key[j] = pos_of(j) < cnt ? order_key(__ldcs(src + pos_of(j))) : 0u;
    }
    const bool full = c0 + kChunk <= cnt;  // all but the last chunk: no bound checks
    int mine = 0;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const bool valid = full || pos_of(u) < cnt;
      max_key = valid ? max(max_key, key[u]) : max_key;
      mine += valid && key[u] >= lower;
    }
    if (__any_sync(0xffffffffu, mine > 0)) {
      int incl = mine;  // warp inclusive scan
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int at = 0;
      if (lane == 31) at = atomicAdd(&S.count, incl);
      at = __shfl_sync(0xffffffffu, at, 31) + incl - mine;
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        if ((full || pos_of(u) < cnt) && key[u] >= lower) {
          if (at < kCap) S.cand_key[at] = key[u], S.cand_pos[at] = uint32_t(pos_of(u));
          ++at;
        }
      }
    }
  }
  max_key = block_min_max(max_key, true, S);  // its barriers also publish the buffer and S.count
  if (tid == 0) S.max_key = max_key;

  // 3. The cluster's candidates: enough, and every one kept?
  cluster.sync();
  int total = 0;
  bool overflow = false;
  uint32_t row_max = 0;
  for (int r2 = 0; r2 < C; ++r2) {
    const Smem* other = cluster.map_shared_rank(&S, r2);
    total += other->count;
    overflow |= other->count > kCap;
    row_max = max(row_max, other->max_key);
  }
  uint32_t T;
  int need;
  if (!overflow && total >= k) {
    // 4. Select among the candidates.
    const int held = S.count;
    radix_select(S, true, [&](auto fn) { for (int i = tid; i < held; i += kThreads) fn(S.cand_key[i]); },
                 lower, row_max - lower, k, T, need);
    for (int i = tid; i < held; i += kThreads) mark(S, S.cand_key[i], S.cand_pos[i], T);
  } else {
    // The sample misled (or the row's keys are too few to filter): select over the slices themselves.
    radix_select(S, true, [&](auto fn) { for (int i = tid; i < cnt; i += kThreads) fn(order_key(src[i])); },
                 0u, 0xffffffffu, k, T, need);
    for (int i = tid; i < cnt; i += kThreads) mark(S, order_key(src[i]), uint32_t(i), T);
  }
  __syncthreads();

  // 5. Ascending output. Thread t owns the bitmap words [t * per, t * per + per).
  const int per = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, tid * per), w1 = min(words, w0 + per);
  int above = 0, ties = 0;
  for (int w = w0; w < w1; ++w) above += __popc(S.above_bits[w]), ties += __popc(S.tie_bits[w]);
  unsigned long long cta_total;
  const unsigned long long before = block_scan((unsigned long long)above << 32 | unsigned(ties), S, cta_total);
  if (tid == 0) S.above = int(cta_total >> 32), S.ties = int(cta_total & 0xffffffffu);
  cluster.sync();
  int ties_before_cta = 0, out_before_cta = 0;  // in the lower-ranked CTAs (smaller indices)
  for (int r2 = 0; r2 < rank; ++r2) {
    const Smem* other = cluster.map_shared_rank(&S, r2);
    out_before_cta += other->above + min(max(need - ties_before_cta, 0), other->ties);
    ties_before_cta += other->ties;
  }
  const int ties_taken_cta = min(max(need - ties_before_cta, 0), S.ties);
  const int ties_before = int(before & 0xffffffffu);
  const int ties_mine = min(max(ties_taken_cta - ties_before, 0), ties);
  unsigned long long unused_total;
  const int at0 = out_before_cta + int(block_scan((unsigned long long)(above + ties_mine), S, unused_total));
  int at = at0, ties_left = ties_mine;
  for (int w = w0; w < w1; ++w) {
    uint32_t tie = S.tie_bits[w];
    uint32_t take = 0;
    while (tie && ties_left > 0) {  // the lowest positions first
      const uint32_t low = tie & (~tie + 1u);
      take |= low;
      tie ^= low;
      --ties_left;
    }
    uint32_t bits = S.above_bits[w] | take;
    while (bits) {
      const int b = __ffs(bits) - 1;
      out[at++] = slice_begin + w * 32 + b;
      bits &= bits - 1u;
    }
  }
  cluster.sync();  // the other CTAs have read this one's counts
}

}  // namespace

Plan make_plan(int64_t rows, int64_t max_len) {
  Plan plan;
  // Enough CTAs per row to hold the row (kMaxSlice each), and as many as fill the GPU in one wave.
  int need = 1;
  while (int64_t(need) * kMaxSlice < max_len) need *= 2;
  const int fill = std::min<int>(kMaxCluster, topk_keys::floor_pow2(std::max<int64_t>(1, sm_count() / std::max<int64_t>(rows, 1))));
  plan.cluster = std::max(need, fill);
  // Slices a multiple of 32 scores: whole bitmap words, float4-aligned slice starts.
  plan.slice = int((max_len + plan.cluster - 1) / plan.cluster + 31) / 32 * 32;
  return plan;
}

bool supports(int64_t max_len) { return max_len <= int64_t(kMaxCluster) * kMaxSlice; }

void launch(const float* scores, int64_t ld, const int32_t* lengths, int64_t rows, int64_t max_len, int k,
            int32_t* out, cudaStream_t stream) {
  SPARROW_CHECK(supports(max_len), "topk_rows: the sampled threshold takes rows of at most ",
                int64_t(kMaxCluster) * kMaxSlice, " scores, got ", max_len);
  const Plan plan = make_plan(rows, max_len);
  SPARROW_CHECK(plan.cluster <= kMaxCluster && plan.slice <= kMaxSlice, "topk_rows: bad plan");
  SPARROW_CHECK(rows * plan.cluster < (int64_t(1) << 31), "topk_rows: too many rows (", rows, ")");
  Params p{scores, ld, lengths, max_len, k, plan.cluster, plan.slice, out};
  const int smem = int(sizeof(Smem));
  static bool attr_set = false;
  if (!attr_set) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(topk_sampled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    attr_set = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(rows * plan.cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = size_t(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  SPARROW_CUDA_CHECK(cudaLaunchKernelEx(&config, topk_sampled_kernel, p));
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda::topk_sampled
