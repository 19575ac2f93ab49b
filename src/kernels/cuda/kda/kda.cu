// Kimi Delta Attention kernels (kda.h). Each follows src/kernels/cpu/kda_reference.cpp operation by operation:
//   * the conv and the gated norm round the CPU's separate products and sums the same way
//     (__fmul_rn / __fadd_rn, never contracted into an FMA; the norm's sum of squares in double);
//   * the delta rule keeps the recurrence's order of operations per token but sums its dot products in
//     a different order (and with FMAs), so it agrees with the CPU to fp32 rounding, not bit for bit.
#include <cuda_bf16.h>

#include "core/error.h"
#include "kernels/cuda/kda/kda.h"
#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"

namespace sparrow::cuda {

namespace {

// ---- short causal conv ---------------------------------------------------------------------------
// One thread per (channel, chunk of kConvChunk rows, sequence). The thread keeps the last K-1 inputs of
// its channel in registers; a chunk after the first reads its left context from x itself, so only the
// first chunk reads the saved tail, and that same thread writes the new tail afterwards: no other thread
// touches the channel's tail, so reading the old and writing the new needs no ordering across blocks.
constexpr int kConvChunk = 64;
constexpr int kConvThreads = 128;

template <int K>
__global__ void __launch_bounds__(kConvThreads)
    short_conv_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t C, const float* __restrict__ weight,
                      KdaSequences seqs, int64_t tail_offset) {
  const int64_t c = int64_t(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int seq = blockIdx.z;
  const int64_t begin = seqs.begin[seq], n = int64_t(seqs.end[seq]) - begin;
  const int64_t t0 = int64_t(blockIdx.y) * kConvChunk;
  if (t0 >= n) return;
  float* tail = reinterpret_cast<float*>(seqs.slots[seq] + tail_offset);

  float w[K];
#pragma unroll
  for (int j = 0; j < K; ++j) w[j] = weight[c * K + j];
  // h[p] for p = t0 - (K-1) .. t0 - 1; p < 0 is tail row K-1+p.
  float win[K - 1];
#pragma unroll
  for (int m = 0; m < K - 1; ++m) {
    const int64_t p = t0 - (K - 1) + m;
    win[m] = p >= 0 ? x[(begin + p) * C + c] : tail[(K - 1 + p) * C + c];
  }
  if (blockIdx.y == 0) {
    // New tail: rows n .. n+K-2 of h = [old tail | x]; all read before any is written.
    float next[K - 1];
#pragma unroll
    for (int m = 0; m < K - 1; ++m) {
      const int64_t p = n + m;  // index into h
      next[m] = p < K - 1 ? tail[p * C + c] : x[(begin + p - (K - 1)) * C + c];
    }
#pragma unroll
    for (int m = 0; m < K - 1; ++m) tail[m * C + c] = next[m];
  }

  const int64_t t1 = t0 + kConvChunk < n ? t0 + kConvChunk : n;
  for (int64_t t = t0; t < t1; ++t) {
    const float xt = x[(begin + t) * C + c];
    // The CPU's order: sum = 0, then += taps[j] * h[t + j] for j ascending, each rounded.
    float sum = 0.0f;
#pragma unroll
    for (int m = 0; m < K - 1; ++m) sum = __fadd_rn(sum, __fmul_rn(w[m], win[m]));
    sum = __fadd_rn(sum, __fmul_rn(w[K - 1], xt));
    y[(begin + t) * C + c] = sum / (1.0f + expf(-sum));  // cpu::silu
#pragma unroll
    for (int m = 0; m + 1 < K - 1; ++m) win[m] = win[m + 1];
    win[K - 2] = xt;
  }
}

// ---- gates ---------------------------------------------------------------------------------------
__global__ void gates_kernel(const float* f, const float* __restrict__ dt_bias, const float* __restrict__ A_log,
                             const float* b, float* g, float* beta, int64_t rows, int heads, int head_dim,
                             float lower_bound) {
  const int64_t P = int64_t(heads) * head_dim, n = rows * P, nb = rows * heads;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const int64_t c = e % P;
    const float xv = __fadd_rn(f[e], dt_bias[c]), a = expf(A_log[c / head_dim]);
    if (lower_bound < 0.0f) {
      g[e] = __fmul_rn(lower_bound, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(a, xv)))));
    } else {
      const float sp = xv > 20.0f ? xv : logf(1.0f + expf(xv));
      g[e] = __fmul_rn(-a, sp);
    }
  }
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < nb; e += stride)
    beta[e] = 1.0f / (1.0f + expf(-b[e]));
}

// ---- delta rule ----------------------------------------------------------------------------------
// Block = (value slice of VS columns, head, sequence), W warps. The state slice S[:, j0 .. j0+VS) lives in
// registers: lane l holds column j = l % VS, and the D key rows are dealt out over the RSUB = 32/VS lane
// groups and the W warps, R = D / (W * RSUB) rows per thread (row i = row0 + r * RSTEP).
// Tokens are staged TT at a time in shared memory (q, k, exp g of the whole head, v of the slice, beta,
// and q.k). Per token, one block-wide reduction gives both S_d^T k and S_d^T q (S_d = decayed state):
//   u = beta (v - S_d^T k),   S = S_d + k u^T,   o = S^T q = S_d^T q + (q.k) u,
// so a token costs one barrier; the reduction scratch alternates between two buffers so that the next
// token's writes cannot race this token's reads. Launch bounds ask for 24 resident warps per SM (80
// registers, no spills at D = 128): decode of a large batch streams the states and wants blocks in flight.
template <int D, int VS, int W, int TT>
__global__ void __launch_bounds__(32 * W, 24 / W)
    delta_rule_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      int64_t qkv_stride, const float* __restrict__ log_decay, const float* __restrict__ beta,
                      float* __restrict__ out, int heads, bool normalize_qk, KdaSequences seqs,
                      int64_t state_offset) {
  constexpr int NT = 32 * W, RSUB = 32 / VS, RSTEP = W * RSUB, R = D / RSTEP;
  static_assert(VS <= 32 && 32 % VS == 0 && D % VS == 0 && D % RSTEP == 0 && R >= 1, "delta rule tiling");
  __shared__ float sq[TT][D], sk[TT][D], seg[TT][D], sv[TT][VS], sb[TT], sqk[TT];
  __shared__ float red[2][2][W][VS];

  const int seq = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * VS;
  const int64_t begin = seqs.begin[seq], end = seqs.end[seq];
  if (end <= begin) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, j = lane % VS, rsub = lane / VS;
  const int row0 = warp * RSUB + rsub;
  const int64_t P = int64_t(heads) * D;

  float* S = reinterpret_cast<float*>(seqs.slots[seq] + state_offset) + int64_t(h) * D * D + j0 + j;
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = S[int64_t(row0 + r * RSTEP) * D];

  int par = 0;
  for (int64_t t0 = begin; t0 < end; t0 += TT) {
    const int n = end - t0 < TT ? int(end - t0) : TT;
    __syncthreads();  // the previous tile is no longer read
    for (int e = tid; e < n * D; e += NT) {
      const int tt = e / D, d = e % D;
      const int64_t row = t0 + tt;
      sq[tt][d] = q[row * qkv_stride + h * D + d];
      sk[tt][d] = k[row * qkv_stride + h * D + d];
      seg[tt][d] = expf(log_decay[row * P + h * D + d]);
    }
    for (int e = tid; e < n * VS; e += NT) {
      const int tt = e / VS, jj = e % VS;
      sv[tt][jj] = v[(t0 + tt) * qkv_stride + h * D + j0 + jj];
    }
    for (int e = tid; e < n; e += NT) sb[e] = beta[(t0 + e) * heads + h];
    __syncthreads();
    // One warp per staged token: the optional L2 norms (kda.cpp l2_normalize: x / sqrt(sum x^2 + 1e-6),
    // q also times D^-1/2), then q.k. Each lane reads back only the elements it wrote itself.
    for (int tt = warp; tt < n; tt += W) {
      if (normalize_qk) {
        float qq = 0.0f, kk = 0.0f;
        for (int d = lane; d < D; d += 32) {
          qq = fmaf(sq[tt][d], sq[tt][d], qq);
          kk = fmaf(sk[tt][d], sk[tt][d], kk);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          qq += __shfl_xor_sync(0xffffffffu, qq, o);
          kk += __shfl_xor_sync(0xffffffffu, kk, o);
        }
        const float q_inv = 1.0f / sqrtf(qq + 1e-6f), k_inv = 1.0f / sqrtf(kk + 1e-6f);
        const float q_scale = float(1.0 / sqrt(double(D)));  // as KdaMixer's q_scale, rounded once
        for (int d = lane; d < D; d += 32) {
          sq[tt][d] = sq[tt][d] * q_inv * q_scale;
          sk[tt][d] = sk[tt][d] * k_inv;
        }
      }
      float acc = 0.0f;
      for (int d = lane; d < D; d += 32) acc = fmaf(sq[tt][d], sk[tt][d], acc);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) sqk[tt] = acc;
    }
    __syncthreads();

    for (int tt = 0; tt < n; ++tt) {
      float ks = 0.0f, qs = 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = row0 + r * RSTEP;
        s[r] *= seg[tt][i];
        ks = fmaf(sk[tt][i], s[r], ks);
        qs = fmaf(sq[tt][i], s[r], qs);
      }
#pragma unroll
      for (int o = VS; o < 32; o <<= 1) {
        ks += __shfl_xor_sync(0xffffffffu, ks, o);
        qs += __shfl_xor_sync(0xffffffffu, qs, o);
      }
      if (rsub == 0) {
        red[par][0][warp][j] = ks;
        red[par][1][warp][j] = qs;
      }
      __syncthreads();
      float KS = 0.0f, QS = 0.0f;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        KS += red[par][0][w][j];
        QS += red[par][1][w][j];
      }
      const float u = sb[tt] * (sv[tt][j] - KS);
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = fmaf(sk[tt][row0 + r * RSTEP], u, s[r]);
      if (warp == 0 && rsub == 0) out[(t0 + tt) * P + h * D + j0 + j] = fmaf(sqk[tt], u, QS);
      par ^= 1;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) S[int64_t(row0 + r * RSTEP) * D] = s[r];
}

template <int D, int VS, int W, int TT>
void launch_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* log_decay,
                       const float* beta, float* out, int heads, bool normalize_qk, const KdaSequences& seqs,
                       int64_t state_offset, cudaStream_t stream) {
  const dim3 grid(D / VS, heads, seqs.num_seqs);
  delta_rule_kernel<D, VS, W, TT><<<grid, 32 * W, 0, stream>>>(q, k, v, qkv_stride, log_decay, beta, out, heads,
                                                               normalize_qk, seqs, state_offset);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// ---- delta rule, decode --------------------------------------------------------------------------
// A launch where no sequence has more than one row (decode). Per (sequence, head) the step is then one
// pass over the state: read once, decayed, reduced, updated, written once. That is a copy with a
// reduction in the middle, and it runs at HBM speed only if most of the time many state bytes are in
// flight on every SM, which the token-serial kernel above does not arrange (at D = 128 it keeps 48 KB of
// state per SM in flight, in 4-byte loads issued behind two dependent pointer loads: 57-61% of HBM).
// Here the state loads come first: block = (VC value columns, head, sequence), W warps; lane c4 = lane % LC
// (LC = VC / 4) holds the 4 columns j0 + 4 c4 .. +3 of rows row0 + r * ROWSTEP, r < R, so each thread
// issues R independent 16-byte loads (a warp's load covers RG = 32 / LC row segments of 16 LC contiguous
// bytes) before anything that waits. Meanwhile warp 0 stages the token's normalised q, k and exp(g) in
// shared memory; one barrier, the decay and both dot products over the thread's rows, a shuffle over the
// warp's row groups, a second barrier to sum the warps' partial sums, then the rank-1 update, the output
// and the write-back. The order of operations per element is delta_rule_kernel's.
// The state loads are 16 bytes wide when the state is 16-byte aligned (slots and state offsets in the
// cache are: planner.h); otherwise (the header promises nothing) each is four 4-byte loads, the same
// arithmetic. The branch is uniform over the block.
template <int D, int VC, int W, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * W, MIN_BLOCKS)
    delta_rule_decode_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                             int64_t qkv_stride, const float* __restrict__ log_decay, const float* __restrict__ beta,
                             float* __restrict__ out, int heads, bool normalize_qk, KdaSequences seqs,
                             int64_t state_offset) {
  constexpr int LC = VC / 4, RG = 32 / LC, ROWSTEP = W * RG, R = D / ROWSTEP, PER = (D + 31) / 32;
  static_assert(VC % 4 == 0 && 32 % LC == 0 && D % VC == 0 && D % ROWSTEP == 0 && R >= 1, "decode tiling");
  __shared__ float sq[D], sk[D], seg[D];
  __shared__ float sqk;
  __shared__ float4 red[2][W][LC];  // per warp: partial S_d^T k and S_d^T q of the slice's columns

  const int seq = blockIdx.z, h = blockIdx.y, j0 = blockIdx.x * VC;
  // Three independent loads (one latency), not begin -> slot -> state one after the other.
  const int32_t row32 = seqs.begin[seq], end32 = seqs.end[seq];
  uint8_t* const slot = seqs.slots[seq];
  if (end32 <= row32) return;  // no row this launch: the state stays as it is
  const int64_t row = row32, P = int64_t(heads) * D;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, c4 = lane % LC, rsub = lane / LC;
  const int row0 = warp * RG + rsub;

  float* const S = reinterpret_cast<float*>(slot + state_offset) + int64_t(h) * D * D + j0 + 4 * c4;
  const bool vec = (reinterpret_cast<uintptr_t>(S) & 15) == 0;  // j0 + 4 c4 is a multiple of 4: uniform
  float4 s[R];
  if (vec) {
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = *reinterpret_cast<const float4*>(S + (row0 + r * ROWSTEP) * D);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float* p = S + (row0 + r * ROWSTEP) * D;
      s[r] = make_float4(p[0], p[1], p[2], p[3]);
    }
  }
  const float* vp = v + row * qkv_stride + h * D + j0 + 4 * c4;
  const float v0 = vp[0], v1 = vp[1], v2 = vp[2], v3 = vp[3];
  const float b = beta[row * heads + h];

  if (warp == 0) {
    // The token's q and k (lane holds d = lane + 32 i), the optional L2 norms (kda.cpp l2_normalize:
    // x / sqrt(sum x^2 + 1e-6), q also times D^-1/2), then q.k, as delta_rule_kernel stages them.
    float qv[PER], kv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      const bool in = d < D;
      qv[i] = in ? q[row * qkv_stride + h * D + d] : 0.0f;
      kv[i] = in ? k[row * qkv_stride + h * D + d] : 0.0f;
      if (in) seg[d] = expf(log_decay[row * P + h * D + d]);
    }
    if (normalize_qk) {
      float qq = 0.0f, kk = 0.0f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        qq = fmaf(qv[i], qv[i], qq);
        kk = fmaf(kv[i], kv[i], kk);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        qq += __shfl_xor_sync(0xffffffffu, qq, o);
        kk += __shfl_xor_sync(0xffffffffu, kk, o);
      }
      const float q_inv = 1.0f / sqrtf(qq + 1e-6f), k_inv = 1.0f / sqrtf(kk + 1e-6f);
      const float q_scale = float(1.0 / sqrt(double(D)));  // as KdaMixer's q_scale, rounded once
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        qv[i] = qv[i] * q_inv * q_scale;
        kv[i] = kv[i] * k_inv;
      }
    }
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      if (d < D) {
        sq[d] = qv[i];
        sk[d] = kv[i];
      }
      acc = fmaf(qv[i], kv[i], acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) sqk = acc;
  }
  __syncthreads();

  float4 ks = make_float4(0.0f, 0.0f, 0.0f, 0.0f), qs = ks;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = row0 + r * ROWSTEP;
    const float e = seg[i], ki = sk[i], qi = sq[i];
    s[r].x *= e, s[r].y *= e, s[r].z *= e, s[r].w *= e;
    ks.x = fmaf(ki, s[r].x, ks.x), ks.y = fmaf(ki, s[r].y, ks.y), ks.z = fmaf(ki, s[r].z, ks.z);
    ks.w = fmaf(ki, s[r].w, ks.w);
    qs.x = fmaf(qi, s[r].x, qs.x), qs.y = fmaf(qi, s[r].y, qs.y), qs.z = fmaf(qi, s[r].z, qs.z);
    qs.w = fmaf(qi, s[r].w, qs.w);
  }
#pragma unroll
  for (int o = LC; o < 32; o <<= 1) {
    ks.x += __shfl_xor_sync(0xffffffffu, ks.x, o), ks.y += __shfl_xor_sync(0xffffffffu, ks.y, o);
    ks.z += __shfl_xor_sync(0xffffffffu, ks.z, o), ks.w += __shfl_xor_sync(0xffffffffu, ks.w, o);
    qs.x += __shfl_xor_sync(0xffffffffu, qs.x, o), qs.y += __shfl_xor_sync(0xffffffffu, qs.y, o);
    qs.z += __shfl_xor_sync(0xffffffffu, qs.z, o), qs.w += __shfl_xor_sync(0xffffffffu, qs.w, o);
  }
  if (rsub == 0) {
    red[0][warp][c4] = ks;
    red[1][warp][c4] = qs;
  }
  __syncthreads();
  float4 KS = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float4 x = red[0][w][c4];
    KS.x += x.x, KS.y += x.y, KS.z += x.z, KS.w += x.w;
  }
  const float u0 = b * (v0 - KS.x), u1 = b * (v1 - KS.y), u2 = b * (v2 - KS.z), u3 = b * (v3 - KS.w);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float ki = sk[row0 + r * ROWSTEP];
    s[r].x = fmaf(ki, u0, s[r].x), s[r].y = fmaf(ki, u1, s[r].y);
    s[r].z = fmaf(ki, u2, s[r].z), s[r].w = fmaf(ki, u3, s[r].w);
  }
  if (vec) {
#pragma unroll
    for (int r = 0; r < R; ++r) *reinterpret_cast<float4*>(S + (row0 + r * ROWSTEP) * D) = s[r];
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float* p = S + (row0 + r * ROWSTEP) * D;
      p[0] = s[r].x, p[1] = s[r].y, p[2] = s[r].z, p[3] = s[r].w;
    }
  }
  if (warp == 0 && rsub == 0) {
    float4 QS = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float4 x = red[1][w][c4];
      QS.x += x.x, QS.y += x.y, QS.z += x.z, QS.w += x.w;
    }
    float* o = out + row * P + h * D + j0 + 4 * c4;
    o[0] = fmaf(sqk, u0, QS.x), o[1] = fmaf(sqk, u1, QS.y), o[2] = fmaf(sqk, u2, QS.z), o[3] = fmaf(sqk, u3, QS.w);
  }
}

template <int D, int VC, int W, int MIN_BLOCKS>
void launch_delta_rule_decode(const float* q, const float* k, const float* v, int64_t qkv_stride,
                              const float* log_decay, const float* beta, float* out, int heads, bool normalize_qk,
                              const KdaSequences& seqs, int64_t state_offset, cudaStream_t stream) {
  const dim3 grid(D / VC, heads, seqs.num_seqs);
  delta_rule_decode_kernel<D, VC, W, MIN_BLOCKS><<<grid, 32 * W, 0, stream>>>(
      q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, seqs, state_offset);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// ---- gated output norm ---------------------------------------------------------------------------
// One warp per (row, head); the sum of squares in double as cpu::rms_normalize, then x * inv * w * gate,
// each product rounded as the CPU rounds it.
__device__ __forceinline__ void store_out(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }

template <typename Out>
__global__ void gated_rms_norm_kernel(const float* o, const float* __restrict__ gate, const float* __restrict__ weight,
                                      Out* out, int64_t groups, int head_dim, float eps) {
  const int64_t gi = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gi >= groups) return;
  const float* x = o + gi * head_dim;
  double ss = 0;
  for (int d = lane; d < head_dim; d += 32) ss += double(x[d]) * x[d];
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float inv = 1.0f / sqrtf(float(ss / head_dim) + eps);
  for (int d = lane; d < head_dim; d += 32) {
    const float sig = 1.0f / (1.0f + expf(-gate[gi * head_dim + d]));
    store_out(out, gi * head_dim + d, __fmul_rn(__fmul_rn(__fmul_rn(x[d], inv), weight[d]), sig));
  }
}

// ---- snapshot copies ------------------------------------------------------------------------------
// One block per sequence, 16-byte words (slots and state offsets are 16-byte aligned: planner.h).
__global__ void copy_states_kernel(KdaSequences seqs, uint8_t* const* __restrict__ snapshots, int64_t offset,
                                   int64_t words) {
  uint8_t* dst = snapshots[blockIdx.x];
  if (dst == nullptr) return;
  const int4* from = reinterpret_cast<const int4*>(seqs.slots[blockIdx.x] + offset);
  int4* to = reinterpret_cast<int4*>(dst + offset);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

}  // namespace

void kda_copy_states(const KdaSequences& seqs, uint8_t* const* snapshots, int64_t offset, int64_t bytes,
                     cudaStream_t stream) {
  SPARROW_CHECK(offset % 16 == 0 && bytes % 16 == 0 && bytes >= 0, "kda_copy_states: offset ", offset, " and size ",
                bytes, " must be multiples of 16 bytes");
  if (seqs.num_seqs == 0 || bytes == 0) return;
  copy_states_kernel<<<unsigned(seqs.num_seqs), 256, 0, stream>>>(seqs, snapshots, offset, bytes / 16);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void kda_short_conv(const float* x, float* y, int64_t channels, const float* weight, int kernel,
                    const KdaSequences& seqs, int64_t tail_offset, cudaStream_t stream) {
  SPARROW_CHECK(channels > 0 && seqs.num_seqs >= 0 && seqs.max_count >= 0, "kda_short_conv: bad sizes");
  SPARROW_CHECK(kernel >= 2 && kernel <= 8, "kda_short_conv: kernel ", kernel, " outside 2..8");
  SPARROW_CHECK(seqs.num_seqs <= 65535, "kda_short_conv: ", seqs.num_seqs, " sequences (at most 65535)");
  if (seqs.num_seqs == 0 || seqs.max_count == 0) return;
  const int64_t chunks = (seqs.max_count + kConvChunk - 1) / kConvChunk;
  SPARROW_CHECK(chunks <= 65535, "kda_short_conv: max_count ", seqs.max_count, " too large");
  const dim3 grid(unsigned((channels + kConvThreads - 1) / kConvThreads), unsigned(chunks), unsigned(seqs.num_seqs));
  switch (kernel) {
#define SPARROW_KDA_CONV(K)                                                                             \
  case K:                                                                                               \
    short_conv_kernel<K><<<grid, kConvThreads, 0, stream>>>(x, y, channels, weight, seqs, tail_offset); \
    break;
    SPARROW_KDA_CONV(2)
    SPARROW_KDA_CONV(3)
    SPARROW_KDA_CONV(4)
    SPARROW_KDA_CONV(5)
    SPARROW_KDA_CONV(6)
    SPARROW_KDA_CONV(7)
    SPARROW_KDA_CONV(8)
#undef SPARROW_KDA_CONV
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

void kda_gates(const float* f, const float* dt_bias, const float* A_log, const float* b, float* g, float* beta,
               int64_t rows, int heads, int head_dim, float lower_bound, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && heads > 0 && head_dim > 0, "kda_gates: bad sizes");
  if (rows == 0) return;
  const int64_t n = rows * heads * head_dim;
  int64_t blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;  // grid-stride loops cover the rest
  gates_kernel<<<unsigned(blocks), 256, 0, stream>>>(f, dt_bias, A_log, b, g, beta, rows, heads, head_dim,
                                                     lower_bound);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void kda_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* log_decay,
                    const float* beta, float* out, int heads, int head_dim, bool normalize_qk,
                    const KdaSequences& seqs, int64_t state_offset, cudaStream_t stream) {
  const int num_seqs = seqs.num_seqs;
  SPARROW_CHECK(heads > 0 && heads <= 65535 && num_seqs >= 0 && num_seqs <= 65535, "kda_delta_rule: ", heads,
                " heads, ", num_seqs, " sequences");
  SPARROW_CHECK(qkv_stride >= int64_t(heads) * head_dim, "kda_delta_rule: row stride ", qkv_stride,
                " below heads * head_dim");
  if (num_seqs == 0 || seqs.max_count == 0) return;  // max_count bounds every count: no rows at all
  if (seqs.max_count == 1) {
    // Decode (no sequence has more than one row): the state-streaming kernel. At D = 128, 64 value columns
    // and 8 warps: 8 rows x 4 columns of state per thread, 80 registers, 3 blocks (24 warps, 96 KB of
    // state) per SM. Measured on the H200 (bench/results/kernels.md) against 128 x 128 and 128 x 32
    // slices and 16 rows per thread, which ran the same or slower; capping registers at 64 for 32 warps
    // per SM spilled and ran 10-30% slower.
#define SPARROW_KDA_DECODE(D, VC, W, MINB)                                                                           \
  launch_delta_rule_decode<D, VC, W, MINB>(q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, seqs, \
                                           state_offset, stream)
    switch (head_dim) {
      case 16:
        SPARROW_KDA_DECODE(16, 16, 2, 8);
        break;
      case 32:
        SPARROW_KDA_DECODE(32, 32, 2, 8);
        break;
      case 64:
        SPARROW_KDA_DECODE(64, 64, 4, 6);
        break;
      case 128:
        SPARROW_KDA_DECODE(128, 64, 8, 3);
        break;
      default:
        fail("kda_delta_rule: head_dim ", head_dim, " not one of 16, 32, 64, 128");
    }
#undef SPARROW_KDA_DECODE
    return;
  }
  // Value slices of 32 columns; when the (sequence, head) pairs alone leave most of the 132 SMs idle,
  // slices of 16 (twice the blocks, half the state per thread: a shorter per-token chain).
  const int sms = sm_count();
  const bool narrow = int64_t(num_seqs) * heads * (head_dim / 32) < 2 * sms;
#define SPARROW_KDA_DELTA(D, VS, W, TT)                                                                       \
  launch_delta_rule<D, VS, W, TT>(q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, seqs, \
                                  state_offset, stream)
  switch (head_dim) {
    case 16:
      SPARROW_KDA_DELTA(16, 16, 2, 32);
      break;
    case 32:
      narrow ? SPARROW_KDA_DELTA(32, 16, 4, 32) : SPARROW_KDA_DELTA(32, 32, 4, 32);
      break;
    case 64:
      narrow ? SPARROW_KDA_DELTA(64, 16, 4, 32) : SPARROW_KDA_DELTA(64, 32, 4, 32);
      break;
    case 128:
      narrow ? SPARROW_KDA_DELTA(128, 16, 8, 16) : SPARROW_KDA_DELTA(128, 32, 8, 16);
      break;
    default:
      fail("kda_delta_rule: head_dim ", head_dim, " not one of 16, 32, 64, 128");
  }
#undef SPARROW_KDA_DELTA
}

void kda_gated_rms_norm(const float* o, const float* gate, const float* weight, void* out, bool out_bf16, int64_t rows,
                        int heads, int head_dim, float eps, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && heads > 0 && head_dim > 0, "kda_gated_rms_norm: bad sizes");
  const int64_t groups = rows * heads;
  if (groups == 0) return;
  const int threads = 256;
  const int64_t blocks = (groups * 32 + threads - 1) / threads;
  SPARROW_CHECK(blocks <= 0x7fffffff, "kda_gated_rms_norm: too many rows");
  if (out_bf16)
    gated_rms_norm_kernel<<<unsigned(blocks), threads, 0, stream>>>(o, gate, weight, static_cast<__nv_bfloat16*>(out),
                                                                    groups, head_dim, eps);
  else
    gated_rms_norm_kernel<<<unsigned(blocks), threads, 0, stream>>>(o, gate, weight, static_cast<float*>(out), groups,
                                                                    head_dim, eps);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
