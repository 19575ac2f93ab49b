// Token choice on the GPU (sampling.h).
//
// argmax_rows: one block per row scans the vocabulary, then a block reduction. The order is
// cpu::top_k's (what the CPU sampler's argmax uses): larger value first, NaN last, ties to the smaller
// id. That order is total, so the reduction gives the same id whatever the split.
//
// draw_tokens: one block of 1024 threads per row; the row (fp32 logits) is read once from HBM and then
// re-read from L2 by the passes that need it. Nothing is sorted but small candidate sets in shared
// memory, and no workspace is used.
//
// Every token i gets a 64-bit "composite" c_i = key(s_i) << idbits | (V - 1 - i), key being the
// order-preserving uint32 of s_i = logit_i / temperature (flip all bits of negatives, set the sign bit
// of positives; -0 counts as +0, NaN becomes 0: below -inf) and idbits = bit length of V - 1. The c_i are
// distinct and their descending order IS the order O of kernels/sampling_rule.h (s descending, ties to the
// smaller id, NaN last). So every prefix of O is a threshold set {i : c_i >= T}, and each step of the
// definition only has to find its threshold:
//   - the argmax a is the largest c (one block max);
//   - top_k: T_K = the K-th largest c, by radix select (count histograms of 2048 bins over c's bits);
//   - min_p: the weight w = exp(double(s) - s_max) is monotone in s, so the kept set {w >= min_p} is
//     {key >= Km} for the smallest float key Km that passes the CPU's own test, found by a 32-way
//     search over the 2^32 keys in one warp (7 rounds of exact double exp), with no pass over the row.
//     The CPU's "while (n > 1 && w(order[n-1]) < min_p) --n" over the first K of O keeps
//     max(1, min(K, C_m)) tokens, C_m = #{key >= Km}: the shorter prefix of the two, or just a;
//   - top_p: the first element of that prefix at which the cumulative weight reaches top_p * total, by
//     the same radix descent with a weight histogram instead of a count one (256 bins of double sums,
//     one row of bins per warp: shared-memory fp64 atomics are compare-and-swap loops on sm_90, so a
//     warp adds its lanes' equal-bin weights by shuffles and its lowest such lane updates the warp's
//     own bin; the rows are then summed in warp order): each level keeps the bin where the running sum
//     from the top crosses the threshold;
//   - the draw: the largest Gumbel key double(s_i) - log(-log(u_i)) over {c_i >= T}, ties to the
//     smaller id (a block max again; the CPU's running maximum starts from (order[0], -inf), so the
//     reduction starts from that pair too).
// A descent stops as soon as its current bin holds at most kCap (8192) tokens: those are compacted into
// shared memory, sorted there (bitonic), and the step is finished exactly on the sorted list. Ties (equal
// keys) need no special case: the descent goes on into the id bits of c. The common case
// (top-k of tens to thousands, or a min_p / top_p set that fits) is thus: one pass (argmax + a 2048-bin
// histogram of the top 11 key bits), one compaction pass of every token above the bin holding the
// cut, and everything else in shared memory. Large sets (top_p over most of a flat vocabulary) take a
// few more passes over the L2-resident row.
//
// Exactness. s_i is the same fp32 division (IEEE, no contraction); weights use double exp, keys double
// log, as the CPU, so a token's weight and key can differ from the CPU's only by the last-ulp
// difference of the two libraries' exp/log. The top-p sums run in another order than the CPU's
// sequential sum (per-bin and per-chunk sums, then scans), so the kept prefix may differ only where a
// cumulative weight lands within rounding of top_p * total. All sums are in a fixed order (per-warp
// bins reduced in warp order, fixed block scans), so a launch is deterministic.
//
// Cost of the Gumbel keys: two double logs and two 64-bit hashes per kept token. The logs are skipped
// where they cannot matter: an fp32 estimate of the key (MUFU log2, within 1e-4 of the exact key) plus
// a margin of 1e-3 + 1e-6 |s| is an upper bound of the exact key, and the exact double key is computed
// only when that bound reaches the thread's best exact key so far, so a thread computes O(log n) exact
// keys of its n tokens (the winner and any tie are always computed exactly).
//
// Everything depends only on the row's logits and its TokenDraw (not on the batch or the row's
// address), so a row draws the same token alone or in any batch, as kernels/sampling_rule.h asks.
#include "kernels/cuda/sampling/sampling.h"

#include <climits>

#include "core/device/cuda_check.h"

namespace sparrow::cuda {

namespace {

__device__ __forceinline__ bool better(float va, int32_t ia, float vb, int32_t ib) {
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

constexpr int kThreads = 1024;

__global__ void argmax_kernel(const float* logits, int64_t vocab, int32_t* ids) {
  const float* row = logits + int64_t(blockIdx.x) * vocab;
  float best = __int_as_float(0x7fc00000);  // NaN: loses to any number
  int32_t best_id = 0x7fffffff;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float x = row[v];
    if (better(x, int32_t(v), best, best_id)) {
      best = x;
      best_id = int32_t(v);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (better(ov, oi, best, best_id)) {
      best = ov;
      best_id = oi;
    }
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int32_t si[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (better(sv[w], si[w], best, best_id)) {
        best = sv[w];
        best_id = si[w];
      }
    ids[blockIdx.x] = best_id;
  }
}

// ---------------------------------------------------------------------------------------------------
// adjust_logits: one thread per entry, the CPU's fp32 operations with explicit rounding (no FMA
// contraction of the multiply into the subtraction, which the CPU does not do either).

__global__ void adjust_kernel(float* logits, int64_t ld, const LogitAdjustment* adjustments, int64_t count,
                              int64_t vocab) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count; e += int64_t(gridDim.x) * blockDim.x) {
    const LogitAdjustment a = adjustments[e];
    if (a.row < 0 || a.token < 0 || a.token >= vocab) continue;
    float* p = logits + int64_t(a.row) * ld + a.token;
    float x = *p;
    if (a.bias != 0.0f) x = __fadd_rn(x, a.bias);
    if (a.divide_positive != 1.0f) x = x > 0 ? __fdiv_rn(x, a.divide_positive) : __fmul_rn(x, a.divide_positive);
    x = __fsub_rn(x, a.subtract);
    if (a.mask) x = -INFINITY;
    *p = x;
  }
}

// ---------------------------------------------------------------------------------------------------
// draw_tokens

constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;                 // loads in flight per thread in a pass (32 KB per SM)
constexpr int kCountBits = 11;             // radix digits of the count descents
constexpr int kCountBins = 1 << kCountBits;
constexpr int kWeightBits = 8;             // radix digits of the weight descent (per-warp double bins)
constexpr int kWeightBins = 1 << kWeightBits;
constexpr int kCap = 8192;                 // tokens a bin may hold to be finished in shared memory
constexpr unsigned kFull = 0xffffffffu;
constexpr uint64_t kNone = ~uint64_t(0);

static_assert(kCountBins == 2 * kThreads, "find_count_bin gives each thread two bins");
static_assert(kWeightBins == 8 * 32, "the weight-bin search gives each lane of warp 0 eight bins");

struct Shared {
  uint64_t cand[kCap];  // compacted composites, sorted descending
  union {
    double whist[kWarps][kWeightBins];  // per-warp weight bins: no atomics, fixed summation order
    double wbuf[kCap];                  // weights / prefix sums of cand
  } w;
  uint32_t count[kCountBins];
  double dscratch[kWarps];
  int64_t iscratch[kWarps];
  uint64_t uscratch[kWarps];
  int32_t idscratch[kWarps];
  uint64_t bu[4];  // values broadcast from one thread
  double bd[4];
  int64_t bi[4];
  uint32_t ncand;
};

// SplitMix64's finaliser, as sparrow::mix64 (kernels/sampling_rule.h); the static_asserts below check the two
// agree.
__host__ __device__ constexpr uint64_t mix64_dev(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static_assert(mix64_dev(0) == sparrow::mix64(0) && mix64_dev(12345) == sparrow::mix64(12345) &&
              mix64_dev(~0ull) == sparrow::mix64(~0ull));

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN: below -inf
  if (b == 0x80000000u) b = 0u;                   // -0 ties with +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float of a key (+0 for the zeros, a NaN for key 0).
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

constexpr uint32_t kKeyNegInf = 0x007fffffu;  // order_key(-inf)
constexpr uint32_t kKeyPosInf = 0xff800000u;  // order_key(+inf)

__device__ __forceinline__ int bit_length(uint64_t x) { return x ? 64 - __clzll(static_cast<long long>(x)) : 0; }

struct RowCtx {
  const float* x;
  int64_t V;
  float temperature;
  bool divide;  // false: greedy, the logits themselves
  int idbits;
  __device__ int32_t id(uint64_t c) const { return int32_t(V - 1 - int64_t(c & ((uint64_t(1) << idbits) - 1))); }
  __device__ float s(uint64_t c) const { return key_float(uint32_t(c >> idbits)); }
};

// One pass over the row: f(valid, s, c, i) for every position, called by all threads the same number of
// times (valid = false past the end) so that f may use warp-wide intrinsics.
template <class F>
__device__ __forceinline__ void scan_row(const RowCtx& r, F&& f) {
  for (int64_t base = 0; base < r.V; base += int64_t(kThreads) * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads + threadIdx.x;
      v[k] = i < r.V ? __ldg(r.x + i) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads + threadIdx.x;
      const float s = r.divide ? __fdiv_rn(v[k], r.temperature) : v[k];
      const uint64_t c = (uint64_t(order_key(s)) << r.idbits) | uint64_t(r.V - 1 - i);
      f(i < r.V, s, c, int32_t(i));
    }
  }
}

// Warp-aggregated histogram increment: one shared atomic per distinct bin of the warp.
__device__ __forceinline__ void count_add(uint32_t* hist, bool valid, uint32_t bin) {
  if (!__any_sync(kFull, valid)) return;
  const unsigned peers = __match_any_sync(kFull, valid ? bin : 0xffffffffu);
  if (valid && __ffs(peers) - 1 == int(threadIdx.x & 31)) atomicAdd(&hist[bin], uint32_t(__popc(peers)));
}

// Adds w to the warp's own weight bin and counts the token. The lanes of equal bins are summed in a
// fixed order, then the lowest such lane does a plain read-modify-write (the warp owns its row of
// bins): by shuffles in lane order when the groups are small, or by one butterfly over the warp per
// group when a few groups are large (ties: all 32 lanes in one bin take 5 rounds, not 31).
__device__ __forceinline__ void weight_add(Shared& S, bool valid, uint32_t bin, double w) {
  if (!__any_sync(kFull, valid)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned peers = __match_any_sync(kFull, valid ? bin : 0xffffffffu);
  const bool leader = valid && __ffs(peers) - 1 == lane;
  const unsigned leaders = __ballot_sync(kFull, leader);
  unsigned others = valid ? peers & ~(1u << lane) : 0u;
  const int rounds = int(__reduce_max_sync(kFull, unsigned(__popc(others))));
  if (5 * __popc(leaders) < rounds) {
    for (unsigned rest = leaders; rest; rest &= rest - 1) {
      const int l = __ffs(rest) - 1;
      const uint32_t gb = __shfl_sync(kFull, bin, l);
      double v = valid && bin == gb ? w : 0.0;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
      if (lane == l) S.w.whist[warp][gb] += v;
    }
  } else {
    double sum = valid ? w : 0.0;
    for (int k = 0; k < rounds; ++k) {
      const int src = others ? __ffs(others) - 1 : lane;
      const double v = __shfl_sync(kFull, w, src);
      if (others) {
        sum += v;
        others &= others - 1;
      }
    }
    if (leader) S.w.whist[warp][bin] += sum;
  }
  if (leader) atomicAdd(&S.count[bin], uint32_t(__popc(peers)));
  __syncwarp();
}

// Appends c to cand when keep (warp-aggregated slot allocation).
__device__ __forceinline__ void compact_add(Shared& S, bool keep, uint64_t c) {
  const unsigned ballot = __ballot_sync(kFull, keep);
  if (!ballot) return;
  const int lane = threadIdx.x & 31, leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(&S.ncand, uint32_t(__popc(ballot)));
  base = __shfl_sync(kFull, base, leader);
  if (keep) {
    const uint32_t pos = base + uint32_t(__popc(ballot & ((1u << lane) - 1)));
    if (pos < kCap) S.cand[pos] = c;
  }
}

// ---- block reductions (all threads call; they end with a barrier, so scratch may be reused) ----

__device__ uint64_t block_max_u64(Shared& S, uint64_t v) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(kFull, v, o);
    v = y > v ? y : v;
  }
  if (lane == 0) S.uscratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = S.uscratch[lane];
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t y = __shfl_xor_sync(kFull, v, o);
      v = y > v ? y : v;
    }
    if (lane == 0) S.bu[0] = v;
  }
  __syncthreads();
  v = S.bu[0];
  __syncthreads();
  return v;
}

// The CPU's running maximum: key larger, or equal with a smaller id. NaN keys never enter.
__device__ __forceinline__ bool key_better(double ka, int32_t ia, double kb, int32_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

__device__ void block_best(Shared& S, double& k, int32_t& id) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const double ok = __shfl_xor_sync(kFull, k, o);
    const int32_t oi = __shfl_xor_sync(kFull, id, o);
    if (key_better(ok, oi, k, id)) {
      k = ok;
      id = oi;
    }
  }
  if (lane == 0) {
    S.dscratch[warp] = k;
    S.idscratch[warp] = id;
  }
  __syncthreads();
  if (warp == 0) {
    k = S.dscratch[lane];
    id = S.idscratch[lane];
    for (int o = 16; o > 0; o >>= 1) {
      const double ok = __shfl_xor_sync(kFull, k, o);
      const int32_t oi = __shfl_xor_sync(kFull, id, o);
      if (key_better(ok, oi, k, id)) {
        k = ok;
        id = oi;
      }
    }
    if (lane == 0) {
      S.bd[0] = k;
      S.bi[0] = id;
    }
  }
  __syncthreads();
  k = S.bd[0];
  id = int32_t(S.bi[0]);
  __syncthreads();
}

// Exclusive prefix sum in thread order (fixed association, so deterministic for doubles); total = sum.
template <class T>
__device__ T block_exclusive_sum(T v, T* scratch, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  T excl = __shfl_up_sync(kFull, x, 1);
  if (lane == 0) excl = T(0);
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    T y = scratch[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T z = __shfl_up_sync(kFull, y, o);
      if (lane >= o) y += z;
    }
    scratch[lane] = y;
  }
  __syncthreads();
  if (warp > 0) excl = scratch[warp - 1] + excl;
  total = scratch[kWarps - 1];
  __syncthreads();
  return excl;
}

// The bin d of S.count (2048 bins) holding rank t (0-based, counted from the highest bin) and the
// number of tokens in the bins above it. Needs t < the histogram's total.
__device__ void find_count_bin(Shared& S, int64_t t, int& d, int64_t& above) {
  const int hb = kCountBins - 1 - 2 * int(threadIdx.x);
  const int64_t c1 = S.count[hb], c0 = S.count[hb - 1];
  if (threadIdx.x == 0) {
    S.bi[2] = 0;
    S.bi[3] = 0;
  }
  int64_t total;
  const int64_t excl = block_exclusive_sum<int64_t>(c1 + c0, S.iscratch, total);
  if (excl <= t && t < excl + c1) {
    S.bi[2] = hb;
    S.bi[3] = excl;
  } else if (excl + c1 <= t && t < excl + c1 + c0) {
    S.bi[2] = hb - 1;
    S.bi[3] = excl + c1;
  }
  __syncthreads();
  d = int(S.bi[2]);
  above = S.bi[3];
  __syncthreads();
}

// Sorts cand[0 .. n) descending (bitonic over the next power of two, padded with 0, which sorts last).
__device__ void sort_cand(Shared& S, int n) {
  int p = 1;
  while (p < n) p <<= 1;
  for (int i = n + int(threadIdx.x); i < p; i += kThreads) S.cand[i] = 0;
  __syncthreads();
  for (int k = 2; k <= p; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < p; i += kThreads) {
        const int l = i ^ j;
        if (l > i) {
          const uint64_t a = S.cand[i], b = S.cand[l];
          if (((i & k) == 0) ? a < b : a > b) {
            S.cand[i] = b;
            S.cand[l] = a;
          }
        }
      }
      __syncthreads();
    }
}

// Inclusive prefix sums of wbuf[0 .. n) in place: each thread sums its contiguous chunk in order,
// then the chunks are offset by a block scan.
__device__ void prefix_sums(Shared& S, int n) {
  const int per = (n + kThreads - 1) / kThreads;
  const int b = int(threadIdx.x) * per, e = min(n, b + per);
  double run = 0;
  for (int j = b; j < e; ++j) {
    run += S.w.wbuf[j];
    S.w.wbuf[j] = run;
  }
  double total;
  const double off = block_exclusive_sum<double>(run, S.dscratch, total);
  if (threadIdx.x > 0)
    for (int j = b; j < e; ++j) S.w.wbuf[j] = off + S.w.wbuf[j];
  __syncthreads();
}

// The first j < n with base + wbuf[j] >= thr (wbuf holds non-decreasing prefix sums), or -1.
__device__ __forceinline__ int first_reaching(const Shared& S, int n, double base, double thr) {
  int lo = 0, hi = n;  // answer in [lo, hi]; hi = n: none
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (base + S.w.wbuf[mid] >= thr) hi = mid;
    else lo = mid + 1;
  }
  return lo < n ? lo : -1;
}

// w_i of kernels/sampling_rule.h step 4. exp underflows to exactly 0 below -746 (in either library), so the
// call is skipped there.
__device__ __forceinline__ double weight_of(float s, double top) {
  if (isnan(s)) return 0.0;
  const double x = double(s) - top;
  return x < -746.0 ? 0.0 : exp(x);
}

// The CPU's min_p test "not (w < min_p)" for a token of value v.
__device__ __forceinline__ bool min_p_keeps(float v, double top, float min_p) {
  return !(exp(double(v) - top) < double(min_p));
}

// An fp32 estimate of g = -log(-log(u)), u = ((h >> 11) + 1) 2^-53, within 1e-4 of the exact double
// value (MUFU log2 is within 2^-21 absolute on [0.5, 2] and 3 ulp elsewhere; 1 - u is formed exactly
// before rounding, so u near 1 keeps its precision); +inf when u == 1.
__device__ __forceinline__ float gumbel_estimate(uint64_t h) {
  const uint64_t m = h >> 11;  // u = (m + 1) 2^-53
  float e;                     // -log(u)
  if (m < (uint64_t(1) << 52)) {
    e = -__logf(float(m + 1) * 0x1p-53f);
  } else {
    const uint64_t t = (uint64_t(1) << 53) - 1 - m;  // (1 - u) 2^53
    if (t == 0) return INFINITY;
    e = -log1pf(-float(t) * 0x1p-53f);
  }
  return -__logf(e);
}

// Offers token i (value s, not NaN) to the thread's running best (bk, bid) with the CPU's exact key
// double(s) - log(-log(u_i)), skipping the exact logs when the estimate cannot reach bk.
__device__ __forceinline__ void gumbel_offer(float s, int32_t i, uint64_t key, double& bk, int32_t& bid) {
  const uint64_t h = mix64_dev(key ^ mix64_dev(uint64_t(int64_t(i))));
  if (isfinite(s)) {
    const float g = gumbel_estimate(h);
    if (g < INFINITY) {
      // |estimate - exact| < 1e-4 (g) + 2^-24 |s + g| (the fp32 sum): 1e-3 + 1e-6 |s| bounds both.
      const double bound = double(s + g) + (1e-3 + 1e-6 * fabs(double(s)));
      if (bound < bk) return;
    }
  }
  const double u = double((h >> 11) + 1) * 0x1p-53;
  const double k = double(s) - log(-log(u));
  if (key_better(k, i, bk, bid)) {
    bk = k;
    bid = i;
  }
}

struct DrawParams {
  const float* logits;
  int64_t vocab;
  int64_t ld;
  int idbits;
  const TokenDraw* draws;
  int32_t* tokens;
};

// Draws over cand[0 .. n) (sorted) and writes the token: the CPU's running maximum from (a, -inf).
__device__ void draw_from_cand(Shared& S, const RowCtx& r, int n, uint64_t key, int32_t a, int32_t* out) {
  double bk = -INFINITY;
  int32_t bid = INT_MAX;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const uint64_t c = S.cand[j];
    const float s = r.s(c);
    if (!isnan(s)) gumbel_offer(s, r.id(c), key, bk, bid);
  }
  block_best(S, bk, bid);
  if (threadIdx.x == 0) *out = key_better(-INFINITY, a, bk, bid) ? a : bid;
}

// Finishes the draw in shared memory from the prefix {c >= Lf} of O, which must hold the first
// n1 = max(1, min(K, C_m)) tokens and at most kCap tokens: compaction, sort, then steps 4-6 on the list.
__device__ void finish_prefix(Shared& S, const RowCtx& r, const TokenDraw& d, uint64_t Lf, int64_t K, uint64_t Tm,
                              double top, int32_t a, int32_t* out) {
  const int tid = threadIdx.x;
  const bool use_top_p = d.top_p < 1.0f, use_min_p = d.min_p > 0.0f;
  __syncthreads();
  if (tid == 0) S.ncand = 0;
  __syncthreads();
  scan_row(r, [&](bool valid, float, uint64_t c, int32_t) { compact_add(S, valid && c >= Lf, c); });
  __syncthreads();
  const int nc = int(S.ncand < kCap ? S.ncand : kCap);
  sort_cand(S, nc);
  // cand = the first nc tokens of O (from a). n1 = max(1, min(K, #{c >= Tm})).
  if (tid == 0) {
    int cm = nc;
    if (use_min_p) {
      int lo = 0, hi = nc;  // first index with cand < Tm
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (S.cand[mid] >= Tm) lo = mid + 1;
        else hi = mid;
      }
      cm = lo;
    }
    int64_t n1 = K < cm ? K : cm;
    if (n1 < 1) n1 = 1;
    if (n1 > nc) n1 = nc;
    S.bi[1] = n1;
  }
  __syncthreads();
  int n = int(S.bi[1]);
  if (use_top_p) {
    const int n1 = n;
    for (int j = tid; j < n1; j += kThreads) S.w.wbuf[j] = weight_of(r.s(S.cand[j]), top);
    __syncthreads();
    prefix_sums(S, n1);
    if (tid == 0) {
      const double thr = __dmul_rn(double(d.top_p), S.w.wbuf[n1 - 1]);
      const int j = isnan(thr) ? -1 : first_reaching(S, n1, 0.0, thr);
      S.bi[1] = j >= 0 ? j + 1 : n1;
    }
    __syncthreads();
    n = int(S.bi[1]);
  }
  draw_from_cand(S, r, n, d.key, a, out);
}

__global__ void __launch_bounds__(kThreads, 1) draw_kernel(DrawParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared& S = *reinterpret_cast<Shared*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const TokenDraw d = p.draws[row];
  int32_t* out = p.tokens + row;
  const int64_t V = p.vocab;

  RowCtx r;
  r.x = p.logits + row * p.ld;
  r.V = V;
  r.temperature = d.temperature;
  r.idbits = p.idbits;
  const bool greedy = d.temperature < kGreedyTemperature;
  r.divide = !greedy;

  // 1. Greedy: the largest logit, ties to the smaller id, NaN last = the largest composite.
  if (greedy) {
    uint64_t best = 0;
    scan_row(r, [&](bool valid, float, uint64_t c, int32_t) {
      if (valid && c > best) best = c;
    });
    best = block_max_u64(S, best);
    if (tid == 0) *out = r.id(best);
    return;
  }

  const bool use_top_p = d.top_p < 1.0f, use_min_p = d.min_p > 0.0f;
  const bool cut = d.top_k > 0 || use_top_p || use_min_p;
  const int64_t K = d.top_k > 0 ? (int64_t(d.top_k) < V ? int64_t(d.top_k) : V) : V;

  // No cut (or a top_k that keeps everything and nothing else): every token is a candidate, one pass.
  // The CPU's running maximum starts from (order[0], -inf): token 0 without a cut, a with one.
  if (!cut || (K == V && !use_top_p && !use_min_p)) {
    double bk = -INFINITY;
    int32_t bid = INT_MAX;
    uint64_t best = 0;
    scan_row(r, [&](bool valid, float s, uint64_t c, int32_t i) {
      if (!valid) return;
      if (c > best) best = c;
      if (!isnan(s)) gumbel_offer(s, i, d.key, bk, bid);
    });
    block_best(S, bk, bid);
    best = block_max_u64(S, best);
    const int32_t first = cut ? r.id(best) : 0;
    if (tid == 0) *out = key_better(-INFINITY, first, bk, bid) ? first : bid;
    return;
  }

  // Pass A: the argmax a (largest composite) and the histogram of the top 11 key bits.
  const int shift0 = 32 + r.idbits - kCountBits;
  for (int b = tid; b < kCountBins; b += kThreads) S.count[b] = 0;
  __syncthreads();
  uint64_t cmax = 0;
  scan_row(r, [&](bool valid, float, uint64_t c, int32_t) {
    if (valid && c > cmax) cmax = c;
    count_add(S.count, valid, uint32_t(c >> shift0));
  });
  cmax = block_max_u64(S, cmax);  // (its barriers also complete the histogram)
  const int32_t a = r.id(cmax);
  const double top = double(r.s(cmax));  // s_max (NaN when every s is)

  // min_p: the smallest key Km whose value passes the CPU's test (the test is monotone in the value),
  // by a 32-way search in warp 0; Tm = Km << idbits, kNone when no value passes.
  uint64_t Tm = 0;
  if (use_min_p) {
    if (warp == 0) {
      uint64_t lo = kKeyNegInf, hi = kKeyPosInf;  // the answer, if any, is in [lo, hi]
      bool found = false;
      for (;;) {
        const uint64_t step = (hi - lo + 1 + 31) / 32;
        uint64_t q = lo + (lane + 1) * step - 1;
        if (q > hi) q = hi;
        const unsigned keep = __ballot_sync(kFull, min_p_keeps(key_float(uint32_t(q)), top, d.min_p));
        if (!keep) break;  // only in the first round: keep(hi) holds afterwards
        found = true;
        const int f = __ffs(keep) - 1;
        const uint64_t nlo = lo + uint64_t(f) * step;
        uint64_t nhi = lo + uint64_t(f + 1) * step - 1;
        if (nhi > hi) nhi = hi;
        lo = nlo;
        hi = nhi;
        if (lo == hi) break;
      }
      if (lane == 0) S.bu[2] = found ? lo << r.idbits : kNone;
    }
    __syncthreads();
    Tm = S.bu[2];
    __syncthreads();
  }
  // The min_p set as a threshold: {c >= Lm}; just a when it holds no token.
  const uint64_t Lm = use_min_p ? (Tm < cmax ? Tm : cmax) : 0;

  // Where the first n1 = max(1, min(K, C_m)) tokens of O can lie: bins >= max(bin of rank K-1, bin of
  // Lm). When those bins hold <= kCap tokens, finish in shared memory.
  int dK = -1;
  int64_t aboveK = 0;
  if (K < V) find_count_bin(S, K - 1, dK, aboveK);
  const int dm = int(Lm >> shift0);
  const int dstar = dK > dm ? dK : dm;
  int64_t nsuper;
  {
    const int hb = 2 * tid;
    const int64_t v = (hb >= dstar ? int64_t(S.count[hb]) : 0) + (hb + 1 >= dstar ? int64_t(S.count[hb + 1]) : 0);
    block_exclusive_sum<int64_t>(v, S.iscratch, nsuper);
  }

  if (nsuper <= kCap) {
    finish_prefix(S, r, d, (uint64_t(dstar) << shift0) > Lm ? uint64_t(dstar) << shift0 : Lm, K, Tm, top, a, out);
    return;
  }

  // General path. T_K (the K-th composite) by a count descent from the level-0 bin, unless the min_p
  // set is already shorter.
  uint64_t TK = 0;
  if (K < V && dK >= dm) {
    uint64_t lo = uint64_t(dK) << shift0, hi = lo + ((uint64_t(1) << shift0) - 1);
    int64_t above = aboveK, cnt = S.count[dK];
    while (cnt > kCap && lo < hi) {
      const int bl = bit_length(hi - lo);
      const int shift = bl > kCountBits ? bl - kCountBits : 0;
      __syncthreads();
      for (int b = tid; b < kCountBins; b += kThreads) S.count[b] = 0;
      __syncthreads();
      scan_row(r, [&](bool valid, float, uint64_t c, int32_t) {
        const bool in = valid && c >= lo && c <= hi;
        count_add(S.count, in, in ? uint32_t((c - lo) >> shift) : 0u);
      });
      __syncthreads();
      int db;
      int64_t ab;
      find_count_bin(S, K - 1 - above, db, ab);
      above += ab;
      cnt = S.count[db];
      const uint64_t nlo = lo + (uint64_t(db) << shift);
      const uint64_t nhi = nlo + ((uint64_t(1) << shift) - 1);
      lo = nlo;
      hi = nhi < hi ? nhi : hi;
    }
    __syncthreads();
    if (tid == 0) S.ncand = 0;
    __syncthreads();
    scan_row(r, [&](bool valid, float, uint64_t c, int32_t) { compact_add(S, valid && c >= lo && c <= hi, c); });
    __syncthreads();
    sort_cand(S, int(S.ncand < kCap ? S.ncand : kCap));
    TK = S.cand[K - 1 - above];
    __syncthreads();
  }
  uint64_t T1 = TK > Lm ? TK : Lm;
  if (T1 > cmax) T1 = cmax;
  // When the first n1 tokens are known to be few (the top-k cut is the shorter one and K fits, or
  // only a is left), they are all the candidates: finish in shared memory.
  if (T1 == cmax || (T1 == TK && K <= kCap)) {
    finish_prefix(S, r, d, T1, K, Tm, top, a, out);
    return;
  }

  // top_p: a weight descent over [T1, cmax] with 256 bins per level; the bin where the running sum
  // (from the top) reaches top_p * total is kept, until it fits in shared memory.
  uint64_t T2 = T1;
  if (use_top_p) {
    uint64_t lo = T1, hi = cmax;
    double above_w = 0, thr = 0;
    for (int level = 0;; ++level) {
      const int bl = bit_length(hi - lo);
      const int shift = bl > kWeightBits ? bl - kWeightBits : 0;
      __syncthreads();
      for (int b = tid; b < kCountBins; b += kThreads) S.count[b] = 0;
      for (int b = tid; b < kWarps * kWeightBins; b += kThreads) (&S.w.whist[0][0])[b] = 0;
      __syncthreads();
      scan_row(r, [&](bool valid, float s, uint64_t c, int32_t) {
        const bool in = valid && c >= lo && c <= hi;
        weight_add(S, in, in ? uint32_t((c - lo) >> shift) : 0u, in ? weight_of(s, top) : 0.0);
      });
      __syncthreads();
      if (tid < kWeightBins) {  // bin sums over the warps, in warp order
        double sum = 0;
        for (int w = 0; w < kWarps; ++w) sum += S.w.whist[w][tid];
        S.w.whist[0][tid] = sum;
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l owns bins 255 - 8l down to 248 - 8l (descending order of O).
        const int hb = kWeightBins - 1 - 8 * lane;
        double local = 0;
        for (int j = 0; j < 8; ++j) local += S.w.whist[0][hb - j];
        double x = local;
        for (int o = 1; o < 32; o <<= 1) {
          const double y = __shfl_up_sync(kFull, x, o);
          if (lane >= o) x += y;
        }
        double ex = __shfl_up_sync(kFull, x, 1);
        if (lane == 0) ex = 0;
        double t = thr;
        bool stop = false;
        if (level == 0) {
          const double total = __shfl_sync(kFull, x, 31);
          t = __dmul_rn(double(d.top_p), total);
          stop = isnan(t);  // NaN weights (s_max infinite): the CPU's test never passes, nothing is cut
        }
        int fb = -1, lb = -1;
        double fabove = 0, labove = 0, acc = ex;
        for (int j = 0; j < 8; ++j) {
          const int b = hb - j;
          const double wb = S.w.whist[0][b];
          if (S.count[b] > 0) {
            if (fb < 0 && above_w + (acc + wb) >= t) {
              fb = b;
              fabove = above_w + acc;
            }
            lb = b;
            labove = above_w + acc;
          }
          acc += wb;
        }
        const unsigned hit = __ballot_sync(kFull, fb >= 0);
        int src;
        if (hit) {
          src = __ffs(hit) - 1;
        } else {  // not reached (rounding between levels): the lowest non-empty bin
          fb = lb;
          fabove = labove;
          src = 31 - __clz(__ballot_sync(kFull, lb >= 0));
        }
        const int b = __shfl_sync(kFull, fb, src);
        const double ab = __shfl_sync(kFull, fabove, src);
        if (lane == 0) {
          S.bi[1] = stop ? -1 : b;
          S.bd[1] = ab;
          S.bd[2] = t;
        }
      }
      __syncthreads();
      const int db = int(S.bi[1]);
      if (db < 0) break;  // T2 stays T1
      above_w = S.bd[1];
      thr = S.bd[2];
      const int64_t cnt = S.count[db];
      const uint64_t nlo = lo + (uint64_t(db) << shift);
      uint64_t nhi = nlo + ((uint64_t(1) << shift) - 1);
      if (nhi > hi) nhi = hi;
      lo = nlo;
      hi = nhi;
      if (cnt <= kCap || lo == hi) {
        __syncthreads();
        if (tid == 0) S.ncand = 0;
        __syncthreads();
        scan_row(r, [&](bool valid, float, uint64_t c, int32_t) { compact_add(S, valid && c >= lo && c <= hi, c); });
        __syncthreads();
        const int nc = int(S.ncand < kCap ? S.ncand : kCap);
        sort_cand(S, nc);
        for (int j = tid; j < nc; j += kThreads) S.w.wbuf[j] = weight_of(r.s(S.cand[j]), top);
        __syncthreads();
        prefix_sums(S, nc);
        if (tid == 0) {
          const int j = first_reaching(S, nc, above_w, thr);
          S.bu[3] = S.cand[j >= 0 ? j : nc - 1];
        }
        __syncthreads();
        T2 = S.bu[3];
        break;
      }
    }
  }

  // The draw over {c >= T2}.
  double bk = -INFINITY;
  int32_t bid = INT_MAX;
  scan_row(r, [&](bool valid, float s, uint64_t c, int32_t i) {
    if (valid && c >= T2 && !isnan(s)) gumbel_offer(s, i, d.key, bk, bid);
  });
  block_best(S, bk, bid);
  if (tid == 0) *out = key_better(-INFINITY, a, bk, bid) ? a : bid;
}

}  // namespace

void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && vocab > 0 && vocab <= 0x7fffffff, "argmax_rows: bad sizes rows=", rows,
                " vocab=", vocab);
  SPARROW_CHECK(rows <= 0x7fffffff, "argmax_rows: too many rows");
  if (rows == 0) return;
  argmax_kernel<<<unsigned(rows), kThreads, 0, stream>>>(logits, vocab, ids);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void adjust_logits(float* logits, int64_t ld, const LogitAdjustment* adjustments, int64_t count, int64_t vocab,
                   cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && vocab > 0 && ld >= vocab, "adjust_logits: bad sizes count=", count, " vocab=", vocab,
                " ld=", ld);
  if (count == 0) return;
  SPARROW_CHECK(logits && adjustments, "adjust_logits: null pointer");
  const int64_t blocks = (count + 255) / 256;
  adjust_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(logits, ld, adjustments, count, vocab);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void draw_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t ld, const TokenDraw* draws,
                 int32_t* tokens, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && rows <= 0x7fffffff && vocab > 0 && vocab <= 0x7fffffff,
                "draw_tokens: bad sizes rows=", rows, " vocab=", vocab);
  SPARROW_CHECK(ld >= vocab, "draw_tokens: ld ", ld, " < vocab ", vocab);
  if (rows == 0) return;
  SPARROW_CHECK(logits && draws && tokens, "draw_tokens: null pointer");
  const int smem = int(sizeof(Shared));
  static bool attr_set = false;
  if (!attr_set) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(draw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    attr_set = true;
  }
  int idbits = 0;
  while ((int64_t(1) << idbits) < vocab) ++idbits;  // bit length of vocab - 1
  draw_kernel<<<unsigned(rows), kThreads, smem, stream>>>(DrawParams{logits, vocab, ld, idbits, draws, tokens});
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
