// kda_delta_rule_chunked (kda.h): the KDA delta rule in its chunk-parallel form, for prefill.
//
// The math is delta_rule_chunked's (src/kernels/cpu/kda_reference.cpp; transformers chunk_kimi_delta_attention; the fla
// library's chunk_kda), chunks of C = 64 rows starting at each sequence's first row, the last one ragged.
// Per chunk and head, with G the running sum of g from the chunk's first row, Kb = beta K exp(G),
// A[r][i] = -beta_r sum_d k_r k_i exp(G_r - G_i) (i < r), Aqk[r][i] = sum_d q_r k_i exp(G_r - G_i) (i <= r):
//   T  = (I - A)^-1,   W = T Kb,   U = T (beta V),   Vn = U - W S,
//   O  = exp(G) Q S + Aqk Vn,      S <- exp(G_last) S + (exp(G_last - G) K)^T Vn.
// Only the last three lines involve the state, so the work splits in two kernels:
//
//  1. chunk_prepare_kernel, one block per (sequence, chunk, head), all in parallel: everything that does not
//     depend on S. It folds the output's state-free part in here as well: with M = Aqk T,
//        O = O0 + Q' S,   O0 = M (beta V) = Aqk U,   Q' = exp(G) Q - M Kb = exp(G) Q - Aqk W,
//     writes O0 straight into `out`, and leaves W, Q', Kd = exp(G_last - G) K, U and exp(G_last) in a
//     workspace record per (chunk, head).
//  2. chunk_scan_kernel, one block per (sequence, head, tile of VT value columns), walks the sequence's
//     chunks in order with its slice of S in registers: [W; Q'] S (one 128-row product), Vn = U - W S,
//     out = O0 + Q' S, S = exp(G_last) S + Kd^T Vn. Each chunk's operands are copied into shared memory one
//     chunk ahead (cp.async), so the walk waits on arithmetic, not on memory. VT (16 .. 128) is picked per
//     launch so that the blocks fill the GPU in as few waves as possible (launch_scan_for);
//     SPARROW_KDA_CHUNK_VT=16|32|64|128 forces it (tests, benchmarks).
// Why two kernels: per row and head (D = 128) kernel 1 reads q, k, v, g (2 KB) and writes its record and
// O0 (1.8 KB), kernel 2 reads them back and writes the output (2.3 KB): ~6 KB against the 2.5 KB a single
// fused walk would move. But a fused walk runs one block per (sequence, head) through all of a sequence's
// intra-chunk work, and under TP8 (12 heads) a prefill of one sequence would keep 12 of 132 SMs busy; here
// that work runs over all chunks at once and the serial part is only the three state products.
//
// Precision. Kernel 1 multiplies on the tensor cores in tf32 (mma.m16n8k8: operands rounded to 11
// significant bits, products summed in fp32) and inverts (I - A) in plain fp32 (forward substitution on the
// 16x16 diagonal blocks, then the blocks below them). Kernel 2 multiplies in bf16 (mma.m16n8k16, fp32
// sums): W, Q', Kd, and at each chunk S and Vn are rounded to bf16 (8 significant bits, relative error
// <= 2^-9) as operands only; S itself, U, O0 and every sum stay fp32. Against the exact recurrence the
// relative L2 error per output or state vector is a few 1e-3 (at most 7e-3 seen when these kernels' source
// was run on a CPU emulation of the warp instructions, sequences up to 3000 rows with decays near zero);
// tests/cuda/kda_chunk_test.cpp allows 2e-2. Errors do not pile up along a sequence: a later chunk's
// Vn = U - W S subtracts whatever S predicts, so the delta rule corrects its own state as it goes.
//
// Decays. exp(G_r - G_i) is never formed as exp(G_r) exp(-G_i) over a whole chunk (it would overflow).
// The 64 rows are four row blocks of 16; for row block b with first row n = 16 b the products use
//   exp(G_r - G_i) = exp(G_r - G_n) * exp(G_n - G_i)
// where for i < n both factors are <= 1 (safe always), and for i in block b (the diagonal block) the second
// factor is >= 1 and bounded by the block's decay span: a channel whose G falls by more than 96 (in log2)
// within the block is left out of the tensor-core product and its diagonal-block terms are added exactly,
// one product at a time (rare: it needs decays beyond e^-66 within 16 tokens).
//
// Workspace (caller-provided, kda_delta_rule_chunked_workspace_bytes): the first slot index of each
// sequence (a one-block prefix sum over the sequences' chunk counts), then one record per (chunk, head):
//   [W; Q']   bf16 128 x D, stored in the order of kernel 2's mma A fragments (16-byte loads, no shuffles)
//   Kd^T      bf16 D x 64, likewise
//   U         fp32 64 x D, row-major
//   gamma     fp32 D, exp(G_last)
// 644 D bytes per record (82 KB at D = 128): about 1.3 KB per row and head.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "kernels/cuda/kda/kda.h"
#include "kernels/cuda/ptx.cuh"
#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"

namespace sparrow::cuda {

namespace {

constexpr int kChunk = 64;
constexpr float kLog2e = 1.4426950408889634f;
// A channel whose log2-decay falls by more than this within a 16-row block takes the exact path: the
// block's factor exp2(G_n - G_i) then stays below 2^96 and exp2(G_r - G_n) above 2^-96 (fp32 and tf32 both
// reach 2^+-126), so the factored products neither overflow nor flush to zero.
constexpr float kSpanLimit = 96.0f;

// ---- workspace ---------------------------------------------------------------------------------------
constexpr int64_t kHeaderAlign = 256;

int64_t header_bytes(int num_seqs) {
  return (int64_t(num_seqs + 1) * 4 + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign;
}

template <int D>
struct Record {
  static constexpr int64_t kWq = int64_t(2 * kChunk) * D * 2;  // [W; Q'] bf16
  static constexpr int64_t kKd = int64_t(kChunk) * D * 2;      // Kd^T bf16
  static constexpr int64_t kU = int64_t(kChunk) * D * 4;       // U fp32
  static constexpr int64_t kGamma = int64_t(D) * 4;            // exp(G_last) fp32
  static constexpr int64_t kBytes = kWq + kKd + kU + kGamma;
  static_assert(kBytes % 16 == 0, "records must keep 16-byte alignment");
};

struct Workspace {
  int32_t* slot_base = nullptr;  // [num_seqs + 1]: first record slot of each sequence, then the total
  uint8_t* records = nullptr;    // [slot][head] records
};

template <int D>
__device__ __forceinline__ uint8_t* record_at(const Workspace& ws, int64_t slot, int heads, int h) {
  return ws.records + (slot * heads + h) * Record<D>::kBytes;
}

// ---- small device helpers -------------------------------------------------------------------------------
// Index of (row, col) in a [rows][W] fp32 tile in shared memory, columns XOR-swizzled within each group of
// 32 by the row's low three bits. The tf32 fragment loads read a tile two ways: 8 rows x 4 columns
// (A fragments; B fragments whose k runs along the row) and 4 rows x 8 columns (B fragments whose k runs
// down the columns); this swizzle spreads both, and the 8-byte accumulator stores, over all 32 banks, and
// keeps 4-float groups whole for 16-byte copies.
template <int W>
__device__ __forceinline__ int sw(int row, int col) {
  static_assert(W % 32 == 0, "swizzle works within 32-column groups");
  return row * W + (col ^ (((row & 3) << 3) | (row & 4)));
}

__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// D += A(16x8 tf32, row) * B(8x8 tf32, col), fp32 accumulators (PTX ISA, mma.m16n8k8). Fragments, with
// g = lane / 4, t = lane % 4: a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]}, b = {B[t][g], B[t+4][g]},
// d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&p);
}

// Rows [0, kChunk) of a [rows][D] block (row stride `stride` elements) into a swizzled tile, rows >= n
// zero-filled; 16-byte copies when every row start is 16-byte aligned, else 4-byte ones.
template <int D, int NT>
__device__ __forceinline__ void stage_rows(float* tile, const float* src, int64_t stride, int n, bool vec16,
                                           int tid) {
  constexpr int kPieces = D / 4;
  for (int e = tid; e < kChunk * kPieces; e += NT) {
    const int r = e / kPieces, c = (e % kPieces) * 4;
    const bool valid = r < n;
    const float* from = src + int64_t(valid ? r : 0) * stride + c;
    float* to = &tile[sw<D>(r, c)];
    if (vec16) {
      ptx::cp_async16(to, from, valid);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::cp_async4(to + i, from + i, valid);
    }
  }
}

// ---- chunk slots ---------------------------------------------------------------------------------------
// slot_base[s] = sum over s' < s of ceil(count_s' / 64): each sequence's chunks get consecutive records.
constexpr int kSlotThreads = 1024;

__global__ void __launch_bounds__(kSlotThreads) chunk_slots_kernel(KdaSequences seqs, int32_t* slot_base) {
  __shared__ int32_t warp_sums[kSlotThreads / 32];
  __shared__ int32_t carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int s0 = 0; s0 < seqs.num_seqs; s0 += kSlotThreads) {
    const int s = s0 + tid;
    int chunks = 0;
    if (s < seqs.num_seqs) {
      const int count = seqs.end[s] - seqs.begin[s];
      chunks = count > 0 ? (count + kChunk - 1) / kChunk : 0;
    }
    int incl = chunks;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const int excl = carry + (warp ? warp_sums[warp - 1] : 0) + incl - chunks;
    if (s < seqs.num_seqs) slot_base[s] = excl;
    __syncthreads();  // everyone has read carry and warp_sums
    if (tid == kSlotThreads - 1) carry = excl + chunks;
    __syncthreads();
  }
  if (tid == 0) slot_base[seqs.num_seqs] = carry;
}

// ---- kernel 1: per-chunk preparation ---------------------------------------------------------------------
constexpr int kPrepThreads = 256;

template <int D>
struct PrepSmem {
  float k[kChunk * D];           // K (normalised), then Kb = beta K exp(G)
  float g[kChunk * D];           // g, then log2e * G, then exp(G), then V
  float a[kChunk * kChunk];      // -beta K K^T decayed (strictly lower), then T = (I - A)^-1
  float aqk[kChunk * kChunk];    // Q K^T decayed (lower), then M = Aqk T
  float x[16 * 48];              // block inverse scratch
  float beta[kChunk];
  float qscale[kChunk];          // per row: 1 / |q| * D^-1/2 (normalize_qk), 1, or 0 past the chunk's end
  float g2last[D];               // log2e * G of the chunk's last row
  uint8_t flag[4 * D];           // (row block, channel) decays too steep for the factored products
  int any_flag;
};

// Work of the eight warps in the decayed K K^T / Q K^T products: row block, first 8-column tile, tile count.
// Row block b needs columns 0 .. 16 b + 15 (2 b + 2 tiles); the split gives each warp 2 or 3 tiles.
__constant__ int kPrepRb[8] = {3, 3, 3, 2, 2, 1, 1, 0};
__constant__ int kPrepNt0[8] = {0, 3, 6, 0, 3, 0, 2, 0};
__constant__ int kPrepCnt[8] = {3, 3, 2, 3, 3, 2, 2, 2};

template <int D>
__global__ void __launch_bounds__(kPrepThreads, 2)
    chunk_prepare_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         int64_t qkv_stride, const float* __restrict__ log_decay, const float* __restrict__ beta,
                         float* __restrict__ out, int heads, bool normalize_qk, bool vec16, KdaSequences seqs,
                         Workspace ws) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepSmem<D>& sm = *reinterpret_cast<PrepSmem<D>*>(smem_raw);

  const int chunk = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int64_t begin = seqs.begin[seq], end = seqs.end[seq];
  const int64_t row0 = begin + int64_t(chunk) * kChunk;
  if (row0 >= end) return;
  const int n = end - row0 < kChunk ? int(end - row0) : kChunk;
  const int64_t slot = int64_t(ws.slot_base[seq]) + chunk;
  uint8_t* rec = record_at<D>(ws, slot, heads, h);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  const int64_t P = int64_t(heads) * D;
  const float* qh = q + row0 * qkv_stride + int64_t(h) * D;  // row r, column d: qh[r * qkv_stride + d]

  // ---- 1. K and g into shared memory; norms; G = running sum of g; steep-decay flags -----------------
  if (tid == 0) sm.any_flag = 0;
  stage_rows<D, kPrepThreads>(sm.k, k + row0 * qkv_stride + int64_t(h) * D, qkv_stride, n, vec16, tid);
  stage_rows<D, kPrepThreads>(sm.g, log_decay + row0 * P + int64_t(h) * D, P, n, vec16, tid);
  ptx::cp_async_commit();
  if (tid < kChunk) sm.beta[tid] = tid < n ? beta[(row0 + tid) * heads + h] : 0.0f;
  ptx::cp_async_wait<0>();
  __syncthreads();

  // One warp per row: l2norm as KdaMixer (x / sqrt(sum x^2 + 1e-6), q also times D^-1/2). q stays in global
  // memory (it is only ever an A operand, read straight into fragments), so only its scale is kept.
  const float q_scale = float(1.0 / sqrt(double(D)));  // KdaMixer's q_scale, rounded once
  for (int r = warp; r < kChunk; r += kPrepThreads / 32) {
    if (normalize_qk) {
      float ss = 0.0f;
      for (int c = lane; c < D; c += 32) ss = fmaf(sm.k[sw<D>(r, c)], sm.k[sw<D>(r, c)], ss);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float inv = 1.0f / sqrtf(ss + 1e-6f);
      for (int c = lane; c < D; c += 32) sm.k[sw<D>(r, c)] *= inv;
    }
    float qs = 0.0f;
    if (r < n) {
      qs = 1.0f;
      if (normalize_qk) {
        float ss = 0.0f;
        for (int c = lane; c < D; c += 32) {
          const float x = qh[r * qkv_stride + c];
          ss = fmaf(x, x, ss);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        qs = 1.0f / sqrtf(ss + 1e-6f) * q_scale;
      }
    }
    if (lane == 0) sm.qscale[r] = qs;
  }
  // One thread per channel: G in the CPU's order (g[0] + g[1] + ...), kept as log2e * G for exp2. Rows
  // past n hold g = 0, so they repeat the last row's G.
  if (tid < D) {
    const int d = tid;
    float G = 0.0f, top[4], bottom[4];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      G += sm.g[sw<D>(r, d)];
      const float G2 = G * kLog2e;
      sm.g[sw<D>(r, d)] = G2;
      if (r % 16 == 0) top[r / 16] = G2;
      if (r % 16 == 15) bottom[r / 16] = G2;
    }
    sm.g2last[d] = G * kLog2e;
    bool any = false;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const bool steep = top[b] - bottom[b] > kSpanLimit;
      sm.flag[b * D + d] = steep;
      any = any || steep;
    }
    if (any) atomicOr(&sm.any_flag, 1);
  }
  __syncthreads();

  // ---- 2. A_kk = K K^T and A_qk = Q K^T with the pairwise decays (tf32 tensor cores) --------------------
  // Row block rb (rows nref .. nref + 15, nref = 16 rb) against columns i < nref + 16:
  //   left  rows:  K_r exp2(G2_r - G2_nref),  q_r scale_r exp2(G2_r - G2_nref)
  //   right rows:  K_i exp2(G2_nref - G2_i)   (zero for flagged channels when i >= nref)
  {
    const int rb = kPrepRb[warp], nt0 = kPrepNt0[warp], cnt = kPrepCnt[warp];
    const int nref = 16 * rb;
    float acc_kk[3][4] = {}, acc_qk[3][4] = {};
#pragma unroll 1
    for (int part = 0; part < D / 32; ++part) {  // 32 channels at a time: the left fragments fit in registers
      uint32_t kl[4][4], ql[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = nref + g8 + (x & 1) * 8;
          const int d = part * 32 + ks * 8 + t4 + (x >> 1) * 4;
          const float L = exp2f(sm.g[sw<D>(r, d)] - sm.g[sw<D>(nref, d)]);
          const float qv = r < n ? qh[r * qkv_stride + d] * sm.qscale[r] : 0.0f;
          kl[ks][x] = tf32(sm.k[sw<D>(r, d)] * L);
          ql[ks][x] = tf32(qv * L);
        }
      }
#pragma unroll
      for (int u = 0; u < 3; ++u) {
        if (u >= cnt) break;
        const int i = 8 * (nt0 + u) + g8;
        const bool diag = i >= nref;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t b[2];
#pragma unroll
          for (int y = 0; y < 2; ++y) {
            const int d = part * 32 + ks * 8 + t4 + 4 * y;
            const bool skip = diag && sm.flag[rb * D + d];
            const float R = skip ? 0.0f : sm.k[sw<D>(i, d)] * exp2f(sm.g[sw<D>(nref, d)] - sm.g[sw<D>(i, d)]);
            b[y] = tf32(R);
          }
          mma_tf32(acc_kk[u], kl[ks], b[0], b[1]);
          mma_tf32(acc_qk[u], ql[ks], b[0], b[1]);
        }
      }
    }
    // Raw sums; entries right of the diagonal are garbage here and zeroed in step 3.
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      if (u >= cnt) break;
      const int c = 8 * (nt0 + u) + 2 * t4;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = nref + g8 + 8 * hf;
        sm.a[sw<kChunk>(r, c)] = acc_kk[u][2 * hf];
        sm.a[sw<kChunk>(r, c + 1)] = acc_kk[u][2 * hf + 1];
        sm.aqk[sw<kChunk>(r, c)] = acc_qk[u][2 * hf];
        sm.aqk[sw<kChunk>(r, c + 1)] = acc_qk[u][2 * hf + 1];
      }
    }
  }
  __syncthreads();
  // Flagged channels: their diagonal-block terms, one exact decay at a time (exp2 of a difference <= 0).
  if (sm.any_flag) {
    for (int e = tid; e < 4 * D; e += kPrepThreads) {
      if (!sm.flag[e]) continue;
      const int rb = e / D, d = e % D;
      for (int i = 16 * rb; i < 16 * rb + 16; ++i) {
        const float ki = sm.k[sw<D>(i, d)], gi = sm.g[sw<D>(i, d)];
        for (int r = i; r < 16 * rb + 16; ++r) {
          const float decay = exp2f(sm.g[sw<D>(r, d)] - gi);
          const float qv = r < n ? qh[r * qkv_stride + d] * sm.qscale[r] : 0.0f;
          if (r > i) atomicAdd(&sm.a[sw<kChunk>(r, i)], sm.k[sw<D>(r, d)] * ki * decay);
          atomicAdd(&sm.aqk[sw<kChunk>(r, i)], qv * ki * decay);
        }
      }
    }
    __syncthreads();
  }

  // ---- 3. A and Aqk masked; Kd^T fragments and exp(G_last) out; then Kb, exp(G) in place; T = (I - A)^-1 --
  for (int e = tid; e < kChunk * kChunk; e += kPrepThreads) {
    const int r = e / kChunk, i = e % kChunk, at = sw<kChunk>(r, i);
    sm.a[at] = i < r ? -sm.beta[r] * sm.a[at] : 0.0f;
    if (i > r) sm.aqk[at] = 0.0f;
  }
  {
    // Kernel 2's S update takes A = Kd^T (rows d, k = token c) as bf16 m16n8k16 fragments: for d-tile dt,
    // token step s and lane (g, t): {Kd^T[d0][c0..c0+1], Kd^T[d0+8][c0..], Kd^T[d0][c0+8..], Kd^T[d0+8][c0+8..]}
    // with d0 = 16 dt + g, c0 = 16 s + 2 t. Each thread writes whole fragments (16 bytes, coalesced).
    uint4* kd = reinterpret_cast<uint4*>(rec + Record<D>::kWq);
    constexpr int kFrags = (D / 16) * (kChunk / 16) * 32;
    for (int f = tid; f < kFrags; f += kPrepThreads) {
      const int fl = f & 31, s = (f >> 5) & 3, dt = f >> 7;
      const int d0 = 16 * dt + (fl >> 2), c0 = 16 * s + 2 * (fl & 3);
      auto kdv = [&](int c, int d) { return sm.k[sw<D>(c, d)] * exp2f(sm.g2last[d] - sm.g[sw<D>(c, d)]); };
      uint4 frag;
      frag.x = pack_bf16(kdv(c0, d0), kdv(c0 + 1, d0));
      frag.y = pack_bf16(kdv(c0, d0 + 8), kdv(c0 + 1, d0 + 8));
      frag.z = pack_bf16(kdv(c0 + 8, d0), kdv(c0 + 9, d0));
      frag.w = pack_bf16(kdv(c0 + 8, d0 + 8), kdv(c0 + 9, d0 + 8));
      kd[f] = frag;
    }
    if (tid < D) reinterpret_cast<float*>(rec + Record<D>::kWq + Record<D>::kKd + Record<D>::kU)[tid] =
        exp2f(sm.g2last[tid]);
  }
  __syncthreads();
  for (int e = tid; e < kChunk * D; e += kPrepThreads) {
    const int r = e / D, at = sw<D>(r, e % D);
    const float E = exp2f(sm.g[at]);
    sm.g[at] = E;
    sm.k[at] = sm.k[at] * sm.beta[r] * E;
  }
  // (I - A)^-1 of the four 16x16 diagonal blocks, one warp each, forward substitution in the CPU's order:
  // T[r][j] = A[r][j] + sum_{j<m<r} A[r][m] T[m][j]. Lane j keeps column j of T in registers (the terms
  // m < j are exact zeros and m = j gives A[r][j] exactly, so the sum runs as the CPU's), reads only A,
  // and writes the column back at the end.
  if (warp < 4) {
    const int o = 16 * warp, j = lane & 15;
    float col[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) col[m] = m == j ? 1.0f : 0.0f;
#pragma unroll
    for (int r = 1; r < 16; ++r) {
      float sum = 0.0f;
#pragma unroll
      for (int m = 0; m < r; ++m) sum = fmaf(sm.a[sw<kChunk>(o + r, o + m)], col[m], sum);
      if (j < r) col[r] = sum;
    }
    __syncwarp();  // every lane has read its rows of A
    if (lane < 16) {
#pragma unroll
      for (int m = 0; m < 16; ++m) sm.a[sw<kChunk>(o + m, o + j)] = col[m];
    }
  }
  __syncthreads();
  // The blocks below the diagonal, block row by block row: (I - A) T = I gives
  //   T_RJ = T_RR sum_{M=J}^{R-1} A_RM T_MJ   (J < R),
  // the sum first (into x), then the product with T_RR, which then replaces A_RJ.
  for (int R = 1; R < 4; ++R) {
    for (int e = tid; e < R * 256; e += kPrepThreads) {
      const int J = e >> 8, r = (e >> 4) & 15, c = e & 15;
      float sum = 0.0f;
      for (int M = J; M < R; ++M) {
#pragma unroll 4
        for (int m = 0; m < 16; ++m)
          sum = fmaf(sm.a[sw<kChunk>(16 * R + r, 16 * M + m)], sm.a[sw<kChunk>(16 * M + m, 16 * J + c)], sum);
      }
      sm.x[r * 48 + 16 * J + c] = sum;
    }
    __syncthreads();
    for (int e = tid; e < R * 256; e += kPrepThreads) {
      const int J = e >> 8, r = (e >> 4) & 15, c = e & 15;
      float sum = sm.x[r * 48 + 16 * J + c];  // T_RR's unit diagonal
      for (int m = 0; m < r; ++m) sum = fmaf(sm.a[sw<kChunk>(16 * R + r, 16 * R + m)], sm.x[m * 48 + 16 * J + c], sum);
      sm.a[sw<kChunk>(16 * R + r, 16 * J + c)] = sum;
    }
    __syncthreads();
  }

  // M = Aqk T (lower triangular): warp = (row block R, 32-column half); tiles right of the row block stay 0.
  {
    const int R = warp >> 1, c_base = 32 * (warp & 1);
    float acc[4][4] = {};
    for (int ks = 0; ks < 2 * R + 2; ++ks) {
      uint32_t a[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) a[x] = tf32(sm.aqk[sw<kChunk>(16 * R + g8 + (x & 1) * 8, 8 * ks + t4 + (x >> 1) * 4)]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int c0 = c_base + 8 * nt;
        if (c0 > 16 * R + 15) continue;
        mma_tf32(acc[nt], a, tf32(sm.a[sw<kChunk>(8 * ks + t4, c0 + g8)]), tf32(sm.a[sw<kChunk>(8 * ks + t4 + 4, c0 + g8)]));
      }
    }
    __syncthreads();  // all of Aqk read before M replaces it
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int c0 = c_base + 8 * nt;
      if (c0 > 16 * R + 15) continue;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * R + g8 + 8 * hf;
        sm.aqk[sw<kChunk>(r, c0 + 2 * t4)] = acc[nt][2 * hf];
        sm.aqk[sw<kChunk>(r, c0 + 2 * t4 + 1)] = acc[nt][2 * hf + 1];
      }
    }
  }
  __syncthreads();

  // ---- 4. W = T Kb, Q' = exp(G) Q - M Kb (to the workspace); U = T (beta V), O0 = M (beta V) -----------
  // Warp = (column quarter, row-block pair {p, 3 - p}): every warp runs 2 R + 2 = 8 + 2 k-steps in all.
  constexpr int NT = D / 32;  // 8-column tiles per quarter
  const int quarter = warp & 3, pair = warp >> 2, col_base = quarter * (D / 4);
  const int64_t head_col = int64_t(h) * D;
  {
    float acc_w[2][NT][4] = {}, acc_q[2][NT][4];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int R = rr ? 3 - pair : pair;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = 16 * R + g8 + (x >> 1) * 8, c = col_base + 8 * nt + 2 * t4 + (x & 1);
          acc_q[rr][nt][x] = r < n ? qh[r * qkv_stride + c] * sm.qscale[r] * sm.g[sw<D>(r, c)] : 0.0f;
        }
      }
    }
    __syncthreads();  // exp(G) read by every warp: its tile now takes V, copied while the products run
    stage_rows<D, kPrepThreads>(sm.g, v + row0 * qkv_stride + head_col, qkv_stride, n, vec16, tid);
    ptx::cp_async_commit();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int R = rr ? 3 - pair : pair;
      for (int ks = 0; ks < 2 * R + 2; ++ks) {
        uint32_t at[4], am[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int idx = sw<kChunk>(16 * R + g8 + (x & 1) * 8, 8 * ks + t4 + (x >> 1) * 4);
          at[x] = tf32(sm.a[idx]);
          am[x] = tf32(-sm.aqk[idx]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = col_base + 8 * nt + g8;
          const uint32_t b0 = tf32(sm.k[sw<D>(8 * ks + t4, c)]), b1 = tf32(sm.k[sw<D>(8 * ks + t4 + 4, c)]);
          mma_tf32(acc_w[rr][nt], at, b0, b1);
          mma_tf32(acc_q[rr][nt], am, b0, b1);
        }
      }
    }
    // Kernel 2's first product takes A = [W; Q'] (128 rows x D) as bf16 m16n8k16 fragments; the m16n8
    // accumulators of two neighbouring 8-column tiles are exactly one such fragment (row tile R for W,
    // 4 + R for Q'; k-step = the 16-column group): lane (g, t) holds {rows g, g+8} x {cols 2t, 2t+1} of each.
    uint4* wq = reinterpret_cast<uint4*>(rec);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int R = rr ? 3 - pair : pair;
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        const int ks16 = col_base / 16 + np;
        uint4 fw, fq;
        fw.x = pack_bf16(acc_w[rr][2 * np][0], acc_w[rr][2 * np][1]);
        fw.y = pack_bf16(acc_w[rr][2 * np][2], acc_w[rr][2 * np][3]);
        fw.z = pack_bf16(acc_w[rr][2 * np + 1][0], acc_w[rr][2 * np + 1][1]);
        fw.w = pack_bf16(acc_w[rr][2 * np + 1][2], acc_w[rr][2 * np + 1][3]);
        fq.x = pack_bf16(acc_q[rr][2 * np][0], acc_q[rr][2 * np][1]);
        fq.y = pack_bf16(acc_q[rr][2 * np][2], acc_q[rr][2 * np][3]);
        fq.z = pack_bf16(acc_q[rr][2 * np + 1][0], acc_q[rr][2 * np + 1][1]);
        fq.w = pack_bf16(acc_q[rr][2 * np + 1][2], acc_q[rr][2 * np + 1][3]);
        wq[(R * (D / 16) + ks16) * 32 + lane] = fw;
        wq[((4 + R) * (D / 16) + ks16) * 32 + lane] = fq;
      }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();
  {
    float acc_u[2][NT][4] = {}, acc_o[2][NT][4] = {};
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int R = rr ? 3 - pair : pair;
      for (int ks = 0; ks < 2 * R + 2; ++ks) {
        uint32_t at[4], am[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int idx = sw<kChunk>(16 * R + g8 + (x & 1) * 8, 8 * ks + t4 + (x >> 1) * 4);
          at[x] = tf32(sm.a[idx]);
          am[x] = tf32(sm.aqk[idx]);
        }
        const float b_lo = sm.beta[8 * ks + t4], b_hi = sm.beta[8 * ks + t4 + 4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int c = col_base + 8 * nt + g8;
          const uint32_t b0 = tf32(b_lo * sm.g[sw<D>(8 * ks + t4, c)]);
          const uint32_t b1 = tf32(b_hi * sm.g[sw<D>(8 * ks + t4 + 4, c)]);
          mma_tf32(acc_u[rr][nt], at, b0, b1);
          mma_tf32(acc_o[rr][nt], am, b0, b1);
        }
      }
    }
    float* U = reinterpret_cast<float*>(rec + Record<D>::kWq + Record<D>::kKd);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int R = rr ? 3 - pair : pair;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = col_base + 8 * nt + 2 * t4;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 16 * R + g8 + 8 * hf;
          *reinterpret_cast<float2*>(&U[r * D + c]) = make_float2(acc_u[rr][nt][2 * hf], acc_u[rr][nt][2 * hf + 1]);
          if (r < n) {
            float* o = out + (row0 + r) * P + head_col + c;
            o[0] = acc_o[rr][nt][2 * hf];
            o[1] = acc_o[rr][nt][2 * hf + 1];
          }
        }
      }
    }
  }
}

// ---- kernel 2: the walk over chunks ---------------------------------------------------------------------
// Block = (value tile of VT columns, head, sequence). Warp w: rows 16 (w % 8) .. of the 128-row product
// [W; Q'] S (warps 0-3: W, giving Vn; 4-7: Q', giving the output), and for the S update the state rows
// 16 (w % 8) .. (while 16 (w % 8) < D); columns NW-wide slice w / 8 of the tile. The state slice lives in
// the update warps' accumulators (fp32) for the whole walk; a bf16 copy in shared memory feeds the products.
template <int D, int VT>
struct Scan {
  static constexpr int kNW = VT < 64 ? VT : 64;  // columns per warp
  static constexpr int kCG = VT / kNW;           // column groups
  static constexpr int kWarps = 8 * kCG;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kNT = kNW / 8;            // 8-column mma tiles per warp
  static constexpr int kWqVec = int(Record<D>::kWq / 16), kKdVec = int(Record<D>::kKd / 16);
  static_assert(VT % 16 == 0 && D % VT == 0 && kNT % 2 == 0, "scan tiling");
};

template <int D, int VT>
struct ScanSmem {
  uint4 wq[2][Scan<D, VT>::kWqVec];  // [W; Q'] fragments, two chunks in flight
  uint4 kd[2][Scan<D, VT>::kKdVec];  // Kd^T fragments
  __nv_bfloat16 s[D][VT + 8];        // S slice (bf16), k = d down the rows; rows padded for ldmatrix
  __nv_bfloat16 vn[kChunk][VT + 8];  // Vn slice (bf16)
};

template <int D, int VT>
__device__ __forceinline__ void stage_chunk(ScanSmem<D, VT>& sm, int stage, const uint8_t* rec, int tid) {
  using C = Scan<D, VT>;
  const uint4* wq = reinterpret_cast<const uint4*>(rec);
  const uint4* kd = reinterpret_cast<const uint4*>(rec + Record<D>::kWq);
  for (int e = tid; e < C::kWqVec; e += C::kThreads) ptx::cp_async16(&sm.wq[stage][e], wq + e, true);
  for (int e = tid; e < C::kKdVec; e += C::kThreads) ptx::cp_async16(&sm.kd[stage][e], kd + e, true);
  ptx::cp_async_commit();
}

template <int D, int VT>
__global__ void __launch_bounds__(Scan<D, VT>::kThreads, 1)
    chunk_scan_kernel(float* __restrict__ out, int heads, KdaSequences seqs, int64_t state_offset, Workspace ws) {
  using C = Scan<D, VT>;
  constexpr int NT = C::kNT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ScanSmem<D, VT>& sm = *reinterpret_cast<ScanSmem<D, VT>*>(smem_raw);

  const int tile = blockIdx.x, h = blockIdx.y, seq = blockIdx.z;
  const int64_t begin = seqs.begin[seq], end = seqs.end[seq];
  if (end <= begin) return;  // no rows: the state stays as it is
  const int nchunks = int((end - begin + kChunk - 1) / kChunk);
  const int64_t slot0 = ws.slot_base[seq];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  const int rt = warp & 7, cg = warp >> 3;
  const int ccol = cg * C::kNW;          // warp's first column within the tile
  const int vcol = tile * VT + ccol;     // ... within the head
  const bool updates = rt < D / 16;      // holds state rows 16 rt .. 16 rt + 15
  const int64_t P = int64_t(heads) * D;

  // The state slice: S[h][d][vcol ..] for the warp's rows, in accumulator layout (scalar accesses: the
  // slot offset need not be 8-byte aligned).
  float* S = reinterpret_cast<float*>(seqs.slots[seq] + state_offset) + int64_t(h) * D * D;
  float st[NT][4];
  if (updates) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int d = 16 * rt + g8 + (x >> 1) * 8, c = 8 * nt + 2 * t4 + (x & 1);
        st[nt][x] = S[int64_t(d) * D + vcol + c];
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        *reinterpret_cast<uint32_t*>(&sm.s[16 * rt + g8 + 8 * hf][ccol + 8 * nt + 2 * t4]) =
            pack_bf16(st[nt][2 * hf], st[nt][2 * hf + 1]);
    }
  }
  // U (Vn warps) or O0 (output warps) of chunk cc, and exp(G_last) of the update rows: needed only after the
  // chunk's first product. With narrow tiles (few columns, short products) they are loaded a chunk ahead;
  // at VT = 128 the registers are not there (512 threads, 128 each).
  constexpr bool kAhead = VT <= 64;
  auto load_ext = [&](int cc, float (&ext)[NT][4], float (&gamma)[2]) {
    const uint8_t* rec = record_at<D>(ws, slot0 + cc, heads, h);
    const int64_t row0 = begin + int64_t(cc) * kChunk;
    const int n = end - row0 < kChunk ? int(end - row0) : kChunk;
    if (rt < 4) {
      const float* U = reinterpret_cast<const float*>(rec + Record<D>::kWq + Record<D>::kKd);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 u = *reinterpret_cast<const float2*>(&U[(16 * rt + g8 + 8 * hf) * D + vcol + 8 * nt + 2 * t4]);
          ext[nt][2 * hf] = u.x;
          ext[nt][2 * hf + 1] = u.y;
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = 16 * (rt - 4) + g8 + (x >> 1) * 8;
          ext[nt][x] = r < n ? out[(row0 + r) * P + int64_t(h) * D + vcol + 8 * nt + 2 * t4 + (x & 1)] : 0.0f;
        }
    }
    if (updates) {
      const float* gm = reinterpret_cast<const float*>(rec + Record<D>::kWq + Record<D>::kKd + Record<D>::kU);
      gamma[0] = gm[16 * rt + g8];
      gamma[1] = gm[16 * rt + g8 + 8];
    }
  };
  float ext[NT][4], gamma[2] = {0.0f, 0.0f}, ext_next[NT][4], gamma_next[2] = {0.0f, 0.0f};
  if constexpr (kAhead) load_ext(0, ext_next, gamma_next);
  stage_chunk<D, VT>(sm, 0, record_at<D>(ws, slot0, heads, h), tid);

  for (int c = 0; c < nchunks; ++c) {
    const int stage = c & 1;
    const int64_t row0 = begin + int64_t(c) * kChunk;
    const int n = end - row0 < kChunk ? int(end - row0) : kChunk;
    ptx::cp_async_wait<0>();
    __syncthreads();  // chunk c staged; S (bf16) from the previous update visible; stage ^ 1 free
    if (c + 1 < nchunks) stage_chunk<D, VT>(sm, stage ^ 1, record_at<D>(ws, slot0 + c + 1, heads, h), tid);
    if constexpr (kAhead) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) ext[nt][x] = ext_next[nt][x];
      gamma[0] = gamma_next[0];
      gamma[1] = gamma_next[1];
      if (c + 1 < nchunks) load_ext(c + 1, ext_next, gamma_next);
    } else {
      load_ext(c, ext, gamma);
    }

    // [W; Q'] S for the warp's 16 rows.
    float acc[NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint4 a4 = sm.wq[stage][(rt * (D / 16) + ks) * 32 + lane];
      const uint32_t a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, &sm.s[16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8][ccol + 16 * np + (lane >> 4) * 8]);
        ptx::mma_bf16(acc[2 * np], a, b[0], b[1]);
        ptx::mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    if (rt < 4) {
      // Vn = U - W S (rows past the chunk's end are 0 - 0: U and W are zero there).
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(&sm.vn[16 * rt + g8 + 8 * hf][ccol + 8 * nt + 2 * t4]) =
              pack_bf16(ext[nt][2 * hf] - acc[nt][2 * hf], ext[nt][2 * hf + 1] - acc[nt][2 * hf + 1]);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = 16 * (rt - 4) + g8 + (x >> 1) * 8;
          if (r < n) out[(row0 + r) * P + int64_t(h) * D + vcol + 8 * nt + 2 * t4 + (x & 1)] = ext[nt][x] + acc[nt][x];
        }
    }
    __syncthreads();  // Vn complete; every read of S (bf16) for this chunk done

    // S = exp(G_last) S + Kd^T Vn.
    if (updates) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        st[nt][0] *= gamma[0];
        st[nt][1] *= gamma[0];
        st[nt][2] *= gamma[1];
        st[nt][3] *= gamma[1];
      }
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks) {
        const uint4 a4 = sm.kd[stage][(rt * (kChunk / 16) + ks) * 32 + lane];
        const uint32_t a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, &sm.vn[16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8][ccol + 16 * np + (lane >> 4) * 8]);
          ptx::mma_bf16(st[2 * np], a, b[0], b[1]);
          ptx::mma_bf16(st[2 * np + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          *reinterpret_cast<uint32_t*>(&sm.s[16 * rt + g8 + 8 * hf][ccol + 8 * nt + 2 * t4]) =
              pack_bf16(st[nt][2 * hf], st[nt][2 * hf + 1]);
    }
  }

  if (updates) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int d = 16 * rt + g8 + (x >> 1) * 8, c = 8 * nt + 2 * t4 + (x & 1);
        S[int64_t(d) * D + vcol + c] = st[nt][x];
      }
  }
}

// ---- launch ---------------------------------------------------------------------------------------------
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

template <int D, int VT>
void launch_scan(float* out, int heads, const KdaSequences& seqs, int64_t state_offset, const Workspace& ws,
                 cudaStream_t stream) {
  allow_smem(chunk_scan_kernel<D, VT>, sizeof(ScanSmem<D, VT>));
  const dim3 grid(D / VT, unsigned(heads), unsigned(seqs.num_seqs));
  chunk_scan_kernel<D, VT><<<grid, Scan<D, VT>::kThreads, sizeof(ScanSmem<D, VT>), stream>>>(out, heads, seqs,
                                                                                           state_offset, ws);
  SPARROW_CUDA_CHECK_LAUNCH();
}

template <int D, int VT>
int scan_blocks_per_sm() {
  static int per_sm = 0;  // the same on every device of a machine (one kind of GPU)
  if (per_sm == 0) {
    allow_smem(chunk_scan_kernel<D, VT>, sizeof(ScanSmem<D, VT>));
    SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, chunk_scan_kernel<D, VT>, Scan<D, VT>::kThreads, sizeof(ScanSmem<D, VT>)));
    if (per_sm < 1) per_sm = 1;
  }
  return per_sm;
}

// The walk's blocks each take a whole sequence, so a second wave of them doubles the time: pick the value
// tile whose waves x per-chunk cost is least. Narrower tiles mean more blocks (more of the machine busy
// when there are few sequences and heads) but each re-reads the chunk's [W; Q'] and Kd; the per-chunk
// costs below are estimates of the relative time of one chunk at each width (more columns per warp,
// longer chains), to be replaced by measurements.
template <int D>
void launch_scan_for(float* out, int heads, const KdaSequences& seqs, int64_t state_offset, const Workspace& ws,
                     cudaStream_t stream) {
  const int sms = sm_count();
  const int64_t pairs = int64_t(seqs.num_seqs) * heads;
  struct Option {
    int vt;
    double chunk_cost;
    int per_sm;
  };
  Option options[] = {{16, 1.0, scan_blocks_per_sm<D, 16>()},
                      {32, 1.15, scan_blocks_per_sm<D, 32>()},
                      {64, 1.4, scan_blocks_per_sm<D, 64>()},
                      {D, D == 128 ? 2.0 : 1.4, 0}};
  options[3].per_sm = D == 128 ? scan_blocks_per_sm<D, D>() : options[2].per_sm;
  int best = D;
  double best_cost = 1e300;
  for (const Option& o : options) {
    if (o.vt > D) continue;
    const int64_t blocks = pairs * (D / o.vt), resident = int64_t(sms) * o.per_sm;
    const double cost = double((blocks + resident - 1) / resident) * o.chunk_cost;
    if (cost < best_cost - 1e-9 || (cost < best_cost + 1e-9 && o.vt > best)) best = o.vt, best_cost = cost;
  }
  // SPARROW_KDA_CHUNK_VT=16|32|64|128 forces the width (tests cover every one; benchmarks compare them).
  if (const char* forced = std::getenv("SPARROW_KDA_CHUNK_VT")) {
    const int vt = std::atoi(forced);
    if ((vt == 16 || vt == 32 || vt == 64 || vt == 128) && vt <= D) best = vt;
  }
  switch (best) {
    case 16: launch_scan<D, 16>(out, heads, seqs, state_offset, ws, stream); break;
    case 32: launch_scan<D, 32>(out, heads, seqs, state_offset, ws, stream); break;
    case 64: launch_scan<D, 64>(out, heads, seqs, state_offset, ws, stream); break;
    default:
      if constexpr (D == 128) launch_scan<D, 128>(out, heads, seqs, state_offset, ws, stream);
      else launch_scan<D, 64>(out, heads, seqs, state_offset, ws, stream);
  }
}

template <int D>
void launch_chunked(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* log_decay,
                    const float* beta, float* out, int heads, bool normalize_qk, const KdaSequences& seqs,
                    int64_t state_offset, const Workspace& ws, cudaStream_t stream) {
  allow_smem(chunk_prepare_kernel<D>, sizeof(PrepSmem<D>));
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec16 = qkv_stride % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(log_decay);
  const int64_t max_chunks = (seqs.max_count + kChunk - 1) / kChunk;
  const dim3 grid(unsigned(max_chunks), unsigned(heads), unsigned(seqs.num_seqs));
  chunk_prepare_kernel<D><<<grid, kPrepThreads, sizeof(PrepSmem<D>), stream>>>(
      q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, vec16, seqs, ws);
  SPARROW_CUDA_CHECK_LAUNCH();
  launch_scan_for<D>(out, heads, seqs, state_offset, ws, stream);
}

int64_t record_bytes(int head_dim) { return head_dim == 64 ? Record<64>::kBytes : Record<128>::kBytes; }

void check_head_dim(int head_dim) {
  SPARROW_CHECK(head_dim == 64 || head_dim == 128, "kda_delta_rule_chunked: head_dim ", head_dim,
                " not supported (64 or 128; kda_delta_rule takes 16 and 32)");
}

}  // namespace

size_t kda_delta_rule_chunked_workspace_bytes(int64_t total_rows, int num_seqs, int heads, int head_dim) {
  check_head_dim(head_dim);
  SPARROW_CHECK(total_rows >= 0 && num_seqs >= 0 && heads > 0, "kda_delta_rule_chunked_workspace_bytes: bad sizes");
  // Sequence s takes ceil(count_s / 64) <= (count_s + 63) / 64 records; summed, at most this many.
  const int64_t slots = (total_rows + int64_t(kChunk - 1) * num_seqs) / kChunk;
  return size_t(header_bytes(num_seqs) + slots * heads * record_bytes(head_dim));
}

void kda_delta_rule_chunked(const float* q, const float* k, const float* v, int64_t qkv_stride,
                            const float* log_decay, const float* beta, float* out, int heads, int head_dim,
                            bool normalize_qk, const KdaSequences& seqs, int64_t state_offset, void* workspace,
                            cudaStream_t stream) {
  check_head_dim(head_dim);
  const int num_seqs = seqs.num_seqs;
  SPARROW_CHECK(heads > 0 && heads <= 65535 && num_seqs >= 0 && num_seqs <= 65535, "kda_delta_rule_chunked: ",
                heads, " heads, ", num_seqs, " sequences");
  SPARROW_CHECK(qkv_stride >= int64_t(heads) * head_dim, "kda_delta_rule_chunked: row stride ", qkv_stride,
                " below heads * head_dim");
  SPARROW_CHECK(state_offset % 4 == 0, "kda_delta_rule_chunked: state offset ", state_offset,
                " not a multiple of 4 bytes");
  SPARROW_CHECK(seqs.max_count >= 0 && (seqs.max_count + kChunk - 1) / kChunk <= 0x7fffffff,
                "kda_delta_rule_chunked: max_count ", seqs.max_count);
  if (num_seqs == 0 || seqs.max_count == 0) return;
  SPARROW_CHECK(workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                "kda_delta_rule_chunked: workspace missing or not 16-byte aligned");
  Workspace ws;
  ws.slot_base = static_cast<int32_t*>(workspace);
  ws.records = static_cast<uint8_t*>(workspace) + header_bytes(num_seqs);
  chunk_slots_kernel<<<1, kSlotThreads, 0, stream>>>(seqs, ws.slot_base);
  SPARROW_CUDA_CHECK_LAUNCH();
  if (head_dim == 64)
    launch_chunked<64>(q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, seqs, state_offset, ws, stream);
  else
    launch_chunked<128>(q, k, v, qkv_stride, log_decay, beta, out, heads, normalize_qk, seqs, state_offset, ws,
                        stream);
}

}  // namespace sparrow::cuda
