// The decoder's small per-token kernels. Each mirrors a CPU op (src/kernels/cpu/reference_ops.cpp,
// src/model/rope.cpp) operation by operation, so fp32 inputs give
// the CPU's results up to the last bit in almost every element:
//   * reductions accumulate in double as the CPU does (norms are memory-bound; FP64 costs nothing here);
//   * products and sums that the CPU rounds separately (x86-64-v2 has no FMA) use __fmul_rn / __fadd_rn,
//     which nvcc never contracts into an FMA;
//   * cos/sin of the rotary angle are taken in double and rounded, matching the correctly rounded
//     results glibc's cosf/sinf give (CUDA's cosf may be 2 ulp off).
// bf16 values are widened to fp32 on load and rounded to nearest even on store.
#include "kernels/cuda/elementwise/elementwise.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "core/device/cuda_check.h"
#include "kernels/cuda/glu.cuh"

namespace sparrow::cuda {

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// Calls f.template operator()<T>() with T the C++ type of `t`.
template <typename F>
void dispatch(ElemType t, F&& f) {
  if (t == ElemType::F32) f(static_cast<float*>(nullptr));
  else f(static_cast<bf16*>(nullptr));
}
template <typename F>
void dispatch2(ElemType a, ElemType b, F&& f) {
  dispatch(a, [&](auto* pa) { dispatch(b, [&](auto* pb) { f(pa, pb); }); });
}

int grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65535LL * 16) blocks = 65535LL * 16;  // grid-stride loops cover the rest
  return int(blocks < 1 ? 1 : blocks);
}

// Threads of a norm block: one per 4 columns, 32 to 512.
int norm_threads(int64_t width) {
  int64_t t = (width / 4 + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > 512) t = 512;
  return int(t);
}

// ---- block reduction in double ---------------------------------------------------------------------
__device__ double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];  // same order in every thread
  return total;
}

// ---- convert, add, scale, bias ---------------------------------------------------------------------
template <typename X, typename Y>
__global__ void convert_kernel(const X* x, Y* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(y, i, load(x, i));
}

template <typename X, typename Y>
__global__ void add_kernel(const X* x, Y* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(y, i, __fadd_rn(load(y, i), load(x, i)));
}

template <typename T>
__global__ void scale_kernel(T* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(x, i, __fmul_rn(load(x, i), s));
}

template <typename Y, typename G>
__global__ void mul_sigmoid_kernel(Y* y, const G* gate, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(y, i, __fmul_rn(load(y, i), __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-load(gate, i))))));
}

template <typename T>
__global__ void add_bias_kernel(T* y, int64_t rows, int64_t width, const float* bias) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(y, i, __fadd_rn(load(y, i), bias[i % width]));
}

// ---- embedding, gather -----------------------------------------------------------------------------
// One block per output row. An id outside [0, vocab) cannot raise an error from the device; its row is
// written as zeros (the engine validates ids before they get here).
template <typename X, typename Y>
__global__ void embedding_kernel(const X* table, const int32_t* ids, int64_t width, Y* out) {
  const int64_t row = blockIdx.x;
  const int32_t id = ids[row];
  const X* src = table + int64_t(id) * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) store(out + row * width, c, id >= 0 ? load(src, c) : 0.0f);
}

// Gather of whole rows: copied as raw bytes in 4- or 2-byte words (types are equal).
template <typename W>
__global__ void gather_kernel(const W* x, const int32_t* index, int64_t width_words, W* out) {
  const int64_t row = blockIdx.x;
  const W* src = x + int64_t(index[row]) * width_words;
  W* dst = out + row * width_words;
  for (int64_t c = threadIdx.x; c < width_words; c += blockDim.x) dst[c] = src[c];
}

// v rounded to T's precision, as store() then load() would give it, without the memory round trip.
__device__ __forceinline__ float rounded_as(const float*, float v) { return v; }
__device__ __forceinline__ float rounded_as(const bf16*, float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// ---- RMSNorm, LayerNorm ----------------------------------------------------------------------------
// cpu::rms_normalize then the weight: inv = 1 / sqrt(float(ss / n) + eps); x *= inv; x *= w (or 1 + w).
// One block per (row, group); y may alias x (each thread writes only what it read).
// With `delta` (whole rows, x_stride == width): x += delta first, each sum rounded to x's type and stored
// back (add_kernel's values), and the norm is of the rounded sums: the residual add fused into the next
// layer's norm, one launch and one read of the row instead of two.
// PER_THREAD > 0: a thread holds its at most PER_THREAD values (columns threadIdx.x + j * blockDim.x) in
// registers, all loads issued before the first use, so the slice is read once and the kernel costs about one
// memory round trip. A decode step's hidden-size norm is one 6-7K row: the loop form (PER_THREAD = 0, any
// width) issued one load at a time and took ~9 us there (bench/results/kernels.md, "Small kernels at batch
// 1"). Both forms sum the squares in the same order (each thread its columns in increasing order, then
// block_sum), so they give the same bits.
template <typename X, typename Y, int PER_THREAD>
__global__ void rms_norm_kernel(const X* x, int64_t x_stride, const X* delta, X* x_sum, Y* y, int64_t y_stride,
                                int64_t first_col, int64_t groups, int64_t width, const float* w, float eps,
                                bool unit_offset) {
  __shared__ double scratch[32];
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  const int64_t at = row * x_stride + first_col + g * width;
  const X* xr = x + at;
  Y* yr = y + row * y_stride + first_col + g * width;
  double ss = 0;
  if constexpr (PER_THREAD > 0) {
    // Every load of the slice, its delta and its weights is issued before the first use, and the loop does no
    // arithmetic on what it loads: a use inside it (1 + w under a branch) made each load wait for the one
    // before, 16 round trips in a row, ~11 us for a 7K row on an H100 (kernels.md, "Small kernels at batch 1").
    float v[PER_THREAD], d[PER_THREAD], wv[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      const bool in = i < width;
      v[j] = in ? load(xr, i) : 0.0f;
      d[j] = delta != nullptr && in ? load(delta + at, i) : 0.0f;
      wv[j] = w != nullptr && in ? w[i] : 0.0f;
    }
    if (delta != nullptr) {
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
        if (i >= width) break;
        v[j] = rounded_as(x, __fadd_rn(v[j], d[j]));
        store(x_sum + at, i, v[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) ss += double(v[j]) * double(v[j]);
    ss = block_sum(ss, scratch);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(ss / double(width)), eps)));
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i >= width) break;
      float o = __fmul_rn(v[j], inv);
      if (w != nullptr) o = __fmul_rn(o, unit_offset ? __fadd_rn(1.0f, wv[j]) : wv[j]);
      store(yr, i, o);
    }
  } else {
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      float v = load(xr, i);
      if (delta != nullptr) {
        v = __fadd_rn(v, load(delta + at, i));
        store(x_sum + at, i, v);
        v = rounded_as(x, v);
      }
      ss += double(v) * double(v);
    }
    ss = block_sum(ss, scratch);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(ss / double(width)), eps)));
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      float v = __fmul_rn(load(delta != nullptr ? x_sum + at : xr, i), inv);
      if (w != nullptr) v = __fmul_rn(v, unit_offset ? __fadd_rn(1.0f, w[i]) : w[i]);
      store(yr, i, v);
    }
  }
}

// Launches rms_norm_kernel with the smallest register form that holds a thread's columns (width up to
// 32 a thread: 16K columns at 512 threads), else the loop form.
template <typename X, typename Y>
void launch_rms_norm(unsigned blocks, const X* x, int64_t x_stride, const X* delta, X* x_sum, Y* y, int64_t y_stride,
                     int64_t first_col, int64_t groups, int64_t width, const float* w, float eps, bool unit_offset,
                     cudaStream_t stream) {
  const int threads = norm_threads(width);
  const int64_t per_thread = (width + threads - 1) / threads;
  auto go = [&](auto kernel) {
    kernel<<<blocks, threads, 0, stream>>>(x, x_stride, delta, x_sum, y, y_stride, first_col, groups, width, w, eps,
                                           unit_offset);
  };
  if (per_thread <= 4) go(rms_norm_kernel<X, Y, 4>);
  else if (per_thread <= 16) go(rms_norm_kernel<X, Y, 16>);
  else if (per_thread <= 32) go(rms_norm_kernel<X, Y, 32>);
  else go(rms_norm_kernel<X, Y, 0>);
}

// cpu::attn_res_mix: one block per row; each source's logit from one pass over the row (the dot with
// norm * proj and the sum of squares, in double like rms_norm_kernel), the softmax over the sources, then
// the weighted sum of the raw rows in fp32.
template <typename T>
__global__ void attn_res_mix_kernel(AttnResSources sources, int64_t width, const float* norm, const float* proj,
                                    float eps, T* out) {
  __shared__ double scratch[32];
  __shared__ float weight[kMaxAttnResSources];
  const int64_t row = blockIdx.x;
  for (int i = 0; i < sources.count; ++i) {
    const T* v = static_cast<const T*>(sources.rows[i]) + row * width;
    double dot = 0, ss = 0;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      const double x = load(v, c);
      dot += x * double(__fmul_rn(norm[c], proj[c]));
      ss += x * x;
    }
    dot = block_sum(dot, scratch);
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) weight[i] = float(dot / sqrt(ss / double(width) + double(eps)));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float top = weight[0];
    for (int i = 1; i < sources.count; ++i) top = fmaxf(top, weight[i]);
    float sum = 0.0f;
    for (int i = 0; i < sources.count; ++i) sum += (weight[i] = expf(weight[i] - top));
    for (int i = 0; i < sources.count; ++i) weight[i] /= sum;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < sources.count; ++i)
      acc = __fadd_rn(acc, __fmul_rn(weight[i], load(static_cast<const T*>(sources.rows[i]) + row * width, c)));
    store(out + row * width, c, acc);
  }
}

// cpu::layer_norm: mean and biased variance in double; o = float(x - mean) * inv * w + b.
// PER_THREAD > 0: a thread's columns, weights and biases are loaded into registers up front, so the row is
// read once (the loop form reads it three times, one load after another: 5.4 us for the DSA indexer's
// 128-wide key at batch 1, bench/results/kernels.md "Small kernels at batch 1"); the sums keep their order.
template <typename T, int PER_THREAD>
__global__ void layer_norm_kernel(T* x, int64_t width, const float* w, const float* b, float eps) {
  __shared__ double scratch[32];
  T* xr = x + int64_t(blockIdx.x) * width;
  if constexpr (PER_THREAD > 0) {
    float v[PER_THREAD], wv[PER_THREAD], bv[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      const bool in = i < width;
      v[j] = in ? load(xr, i) : 0.0f;
      wv[j] = in ? w[i] : 0.0f;
      bv[j] = in ? b[i] : 0.0f;
    }
    double sum = 0;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j)
      if (threadIdx.x + int64_t(j) * blockDim.x < width) sum += double(v[j]);
    const double mean = block_sum(sum, scratch) / double(width);
    double var = 0;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      if (threadIdx.x + int64_t(j) * blockDim.x >= width) continue;
      const double d = double(v[j]) - mean;
      var += d * d;
    }
    var = block_sum(var, scratch) / double(width);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(var), eps)));
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i >= width) break;
      float o = float(double(v[j]) - mean);
      o = __fmul_rn(__fmul_rn(o, inv), wv[j]);
      store(xr, i, __fadd_rn(o, bv[j]));
    }
  } else {
    double sum = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) sum += double(load(xr, i));
    const double mean = block_sum(sum, scratch) / double(width);
    double var = 0;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      double d = double(load(xr, i)) - mean;
      var += d * d;
    }
    var = block_sum(var, scratch) / double(width);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(var), eps)));
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      float v = float(double(load(xr, i)) - mean);
      v = __fmul_rn(__fmul_rn(v, inv), w[i]);
      store(xr, i, __fadd_rn(v, b[i]));
    }
  }
}

// ---- the vision towers' pieces: GELU, row softmax, rotation by given angles --------------------------

template <typename T>
__global__ void gelu_kernel(T* x, int64_t n, bool tanh_form) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = load(x, i);
    const float g = tanh_form ? 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))
                              : 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    store(x, i, g);
  }
}

// One block a row: the row's max of scale * x, the sum of exponentials (in double, block_sum), then each value.
template <typename Y>
__global__ void softmax_rows_kernel(const float* x, int64_t cols, float scale, Y* y) {
  __shared__ double scratch[32];
  const float* xr = x + int64_t(blockIdx.x) * cols;
  Y* yr = y + int64_t(blockIdx.x) * cols;
  float top = -INFINITY;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) top = fmaxf(top, xr[j] * scale);
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  // The block's max: each warp's to scratch, then every thread reads them in one order.
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = double(top);
  __syncthreads();
  float block_top = -INFINITY;
  for (int w = 0; w < int(blockDim.x / 32); ++w) block_top = fmaxf(block_top, float(scratch[w]));
  double sum = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += double(expf(xr[j] * scale - block_top));
  const float total = float(block_sum(sum, scratch));
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) store(yr, j, expf(xr[j] * scale - block_top) / total);
}

// One thread a (row, head, pair): no two threads touch one value.
template <typename T>
__global__ void rotate_pairs_kernel(T* x, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
                                    const float* sin, int64_t R, bool interleaved) {
  const int64_t n = rows * heads * R;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = i % R, h = i / R % heads, r = i / (R * heads);
    T* head = x + (r * heads + h) * head_dim;
    const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + R;
    const float a = load(head, i0), b = load(head, i1), c = cos[r * R + j], s = sin[r * R + j];
    store(head, i0, a * c - b * s);
    store(head, i1, b * c + a * s);
  }
}

// ---- rotary embedding ------------------------------------------------------------------------------
// Blocks (row, slice of heads): blockIdx.y takes rounds y, y + gridDim.y, ... of the row's heads, so a
// decode step's few rows still spread over many SMs (one block a row walked MiniMax's 64 query heads in 8
// rounds: 5.4 us at batch 1). Angles (src/model/rope.cpp Rope::angles): a = inv_freq[i] * float(pos) in
// fp32, cos/sin of a (in double, rounded), each times attention_scaling. Heads are processed in rounds of
// whole heads; within a round every thread reads its pair, the block synchronises, then writes, so the
// interleaved layout's permuted write-back ([rotated evens..., rotated odds...]) never overwrites a
// value another thread has yet to read.
template <typename T>
__global__ void rope_kernel(T* x, int64_t row_stride, int64_t first_col, int64_t heads, int64_t head_stride,
                            int half, const int64_t* positions, const float* inv_freq, float attention_scaling,
                            bool interleaved) {
  extern __shared__ float cs[];  // cos[half], sin[half]
  const int64_t row = blockIdx.x;
  const float pos = float(positions[row]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = __fmul_rn(inv_freq[i], pos);
    double s, c;
    sincos(double(a), &s, &c);
    cs[i] = __fmul_rn(float(c), attention_scaling);
    cs[half + i] = __fmul_rn(float(s), attention_scaling);
  }
  __syncthreads();
  T* xr = x + row * row_stride + first_col;
  const int heads_per_round = blockDim.x / half;
  const int h_local = threadIdx.x / half, i = threadIdx.x % half;
  const int64_t round_step = int64_t(gridDim.y) * heads_per_round;
  for (int64_t h0 = int64_t(blockIdx.y) * heads_per_round; h0 < heads; h0 += round_step) {
    const int64_t h = h0 + h_local;
    const bool active = h_local < heads_per_round && h < heads;
    float a = 0, b = 0;
    T* head = xr + h * head_stride;
    if (active) {
      a = load(head, interleaved ? 2 * i : i);
      b = load(head, interleaved ? 2 * i + 1 : i + half);
    }
    __syncthreads();
    if (active) {
      const float c = cs[i], s = cs[half + i];
      store(head, i, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
      store(head, i + half, __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
    }
    __syncthreads();
  }
}

// One warp a (row, head), four heads a block. The norm is rms_norm_kernel's for a head of at most 128
// columns, which runs as one warp holding 4 columns a lane (norm_threads): the same per-lane order, the same
// butterfly sum (block_sum of one warp), the same roundings, each normed value rounded to T as the norm's
// store would. The rotation then reads those values from shared memory as rope_kernel reads them from x,
// with its angles and its write-back positions.
constexpr int kNormRopeWarps = 4;
template <typename T>
__global__ void rms_norm_rope_kernel(T* x, int64_t rows, int64_t heads, int head_dim, const float* w, float eps,
                                     bool unit_offset, int half, const int64_t* positions, const float* inv_freq,
                                     float attention_scaling, bool interleaved) {
  extern __shared__ float norm_rope_smem[];  // per warp: head_dim normed values, then cos[half], sin[half]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t unit = int64_t(blockIdx.x) * kNormRopeWarps + warp;  // (row, head)
  if (unit >= rows * heads) return;  // whole warps only: the kernel syncs warps, never the block
  const int64_t row = unit / heads;
  T* head = x + unit * head_dim;
  float* v = norm_rope_smem + warp * (head_dim + 2 * half);
  float* cs = v + head_dim;
  // Every load (the head, its weights, the position and the frequencies) is issued before the first use, as
  // in rms_norm_kernel: a load used right after it waits a memory round trip before the next one is issued.
  float vals[4], wv[4], freq[2];
  double ss = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    vals[j] = i < head_dim ? load(head, i) : 0.0f;
    wv[j] = w != nullptr && i < head_dim ? w[i] : 0.0f;
  }
  const float pos = float(positions[row]);
#pragma unroll
  for (int j = 0; j < 2; ++j) freq[j] = lane + 32 * j < half ? inv_freq[lane + 32 * j] : 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) ss += double(vals[j]) * double(vals[j]);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(ss / double(head_dim)), eps)));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    if (i >= head_dim) break;
    float o = __fmul_rn(vals[j], inv);
    if (w != nullptr) o = __fmul_rn(o, unit_offset ? __fadd_rn(1.0f, wv[j]) : wv[j]);
    v[i] = rounded_as(x, o);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    const float a = __fmul_rn(freq[j], pos);
    double sn, cn;
    sincos(double(a), &sn, &cn);
    cs[i] = __fmul_rn(float(cn), attention_scaling);
    cs[half + i] = __fmul_rn(float(sn), attention_scaling);
  }
  __syncwarp();
  float lo[2], hi[2];  // a lane's pairs i = lane, lane + 32 (half <= 64)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    const float a = v[interleaved ? 2 * i : i], b = v[interleaved ? 2 * i + 1 : i + half];
    const float c = cs[i], s = cs[half + i];
    lo[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    hi[j] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    v[i] = lo[j], v[i + half] = hi[j];
  }
  __syncwarp();
  for (int i = lane; i < head_dim; i += 32) store(head, i, v[i]);
}

// ---- gated activations (kernels/glu.h, glu_value in kernels/cuda/glu.cuh) -----------------------------
template <typename X, typename Y>
__global__ void glu_kernel(const X* gate_up, Y* out, int64_t rows, int64_t inter, Glu kind, float alpha,
                           float limit) {
  const int64_t n = rows * inter;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / inter, c = idx % inter;
    const float g = load(gate_up, r * 2 * inter + c), u = load(gate_up, r * 2 * inter + inter + c);
    store(out, idx, glu_value(g, u, kind, alpha, limit));
  }
}

}  // namespace

void convert(const void* x, ElemType xt, void* y, ElemType yt, int64_t n, cudaStream_t stream) {
  SPARROW_CHECK(n >= 0, "convert: negative count ", n);
  if (n == 0) return;
  SPARROW_CHECK(x != nullptr && y != nullptr, "convert: null pointer");
  if (xt == yt) {
    SPARROW_CUDA_CHECK(cudaMemcpyAsync(y, x, size_t(n) * (xt == ElemType::F32 ? 4 : 2), cudaMemcpyDeviceToDevice,
                                       stream));
    return;
  }
  dispatch2(xt, yt, [&](auto* px, auto* py) {
    using X = std::remove_pointer_t<decltype(px)>;
    using Y = std::remove_pointer_t<decltype(py)>;
    convert_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const X*>(x), static_cast<Y*>(y), n);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void embedding(const void* table, ElemType table_type, const int32_t* ids, int64_t count, int64_t width, void* out,
               ElemType out_type, cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && width > 0, "embedding: bad sizes count=", count, " width=", width);
  SPARROW_CHECK(count <= 0x7fffffff, "embedding: too many ids");
  if (count == 0) return;
  dispatch2(table_type, out_type, [&](auto* pt, auto* po) {
    using X = std::remove_pointer_t<decltype(pt)>;
    using Y = std::remove_pointer_t<decltype(po)>;
    embedding_kernel<<<unsigned(count), norm_threads(width), 0, stream>>>(static_cast<const X*>(table), ids, width,
                                                                        static_cast<Y*>(out));
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void rms_norm(void* x, ElemType type, int64_t rows, int64_t row_stride, int64_t first_col, int64_t groups,
              int64_t width, const float* w, float eps, bool unit_offset, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && groups > 0 && width > 0 && first_col >= 0, "rms_norm: bad sizes");
  SPARROW_CHECK(rows <= 1 || row_stride >= first_col + groups * width, "rms_norm: row stride ", row_stride,
                " < ", first_col + groups * width);
  SPARROW_CHECK(rows * groups <= 0x7fffffff, "rms_norm: too many groups");
  if (rows == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    launch_rms_norm(unsigned(rows * groups), static_cast<const T*>(x), row_stride, static_cast<const T*>(nullptr),
                    static_cast<T*>(nullptr), static_cast<T*>(x), row_stride, first_col, groups, width, w, eps,
                    unit_offset, stream);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void rms_norm_rows(const void* x, ElemType xt, void* y, ElemType yt, int64_t rows, int64_t width, const float* w,
                   float eps, bool unit_offset, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width > 0, "rms_norm_rows: bad sizes");
  SPARROW_CHECK(rows <= 0x7fffffff, "rms_norm_rows: too many rows");
  if (rows == 0) return;
  dispatch2(xt, yt, [&](auto* px, auto* py) {
    using X = std::remove_pointer_t<decltype(px)>;
    using Y = std::remove_pointer_t<decltype(py)>;
    launch_rms_norm(unsigned(rows), static_cast<const X*>(x), width, static_cast<const X*>(nullptr),
                    static_cast<X*>(nullptr), static_cast<Y*>(y), width, 0, 1, width, w, eps, unit_offset, stream);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void add_rms_norm_rows(void* x, const void* delta, ElemType xt, void* y, ElemType yt, int64_t rows, int64_t width,
                       const float* w, float eps, bool unit_offset, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width > 0, "add_rms_norm_rows: bad sizes");
  SPARROW_CHECK(rows <= 0x7fffffff, "add_rms_norm_rows: too many rows");
  SPARROW_CHECK(x != y && delta != y, "add_rms_norm_rows: y must not alias x or delta");
  if (rows == 0) return;
  dispatch2(xt, yt, [&](auto* px, auto* py) {
    using X = std::remove_pointer_t<decltype(px)>;
    using Y = std::remove_pointer_t<decltype(py)>;
    launch_rms_norm(unsigned(rows), static_cast<const X*>(x), width, static_cast<const X*>(delta), static_cast<X*>(x),
                    static_cast<Y*>(y), width, 0, 1, width, w, eps, unit_offset, stream);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void layer_norm(void* x, ElemType type, int64_t rows, int64_t width, const float* w, const float* b, float eps,
                cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width > 0, "layer_norm: bad sizes");
  SPARROW_CHECK(w != nullptr && b != nullptr, "layer_norm: weight and bias are required");
  SPARROW_CHECK(rows <= 0x7fffffff, "layer_norm: too many rows");
  if (rows == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    const int threads = norm_threads(width);
    const int64_t per_thread = (width + threads - 1) / threads;
    auto go = [&](auto kernel) { kernel<<<unsigned(rows), threads, 0, stream>>>(static_cast<T*>(x), width, w, b, eps); };
    if (per_thread <= 4) go(layer_norm_kernel<T, 4>);
    else if (per_thread <= 16) go(layer_norm_kernel<T, 16>);
    else go(layer_norm_kernel<T, 0>);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void rope(void* x, ElemType type, int64_t rows, int64_t row_stride, int64_t first_col, int64_t heads,
          int64_t head_stride, int64_t rot, const int64_t* positions, const float* inv_freq, float attention_scaling,
          bool interleaved, cudaStream_t stream) {
  SPARROW_CHECK(rot > 0 && rot % 2 == 0 && rot <= 2048, "rope: rotary dimension ", rot,
                " must be even, positive and at most 2048");
  SPARROW_CHECK(rows >= 0 && heads >= 0 && first_col >= 0, "rope: bad sizes");
  SPARROW_CHECK(heads <= 1 || head_stride >= rot, "rope: head stride ", head_stride, " < rotary dimension ", rot);
  SPARROW_CHECK(rows <= 0x7fffffff, "rope: too many rows");
  if (rows == 0 || heads == 0) return;
  const int half = int(rot / 2);
  int per_round = 256 / half;
  if (per_round < 1) per_round = 1;
  if (per_round > heads) per_round = int(heads);
  const int threads = half * per_round;
  const dim3 grid(unsigned(rows), unsigned(std::min<int64_t>((heads + per_round - 1) / per_round, 65535)));
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    rope_kernel<<<grid, threads, 2 * half * sizeof(float), stream>>>(
        static_cast<T*>(x), row_stride, first_col, heads, head_stride, half, positions, inv_freq, attention_scaling,
        interleaved);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void rms_norm_rope_heads(void* x, ElemType type, int64_t rows, int64_t heads, int64_t head_dim, const float* w,
                         float eps, bool unit_offset, int64_t rot, const int64_t* positions, const float* inv_freq,
                         float attention_scaling, bool interleaved, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && heads > 0 && head_dim > 0 && head_dim <= 128, "rms_norm_rope_heads: heads of ", head_dim,
                " (at most 128)");
  SPARROW_CHECK(rot > 0 && rot % 2 == 0 && rot <= head_dim, "rms_norm_rope_heads: rotary dimension ", rot,
                " for heads of ", head_dim);
  SPARROW_CHECK(rows * heads <= 0x7fffffffLL * kNormRopeWarps, "rms_norm_rope_heads: too many heads");
  if (rows == 0) return;
  const int half = int(rot / 2);
  const unsigned blocks = unsigned((rows * heads + kNormRopeWarps - 1) / kNormRopeWarps);
  const size_t smem = size_t(kNormRopeWarps) * (head_dim + 2 * half) * sizeof(float);
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    rms_norm_rope_kernel<<<blocks, 32 * kNormRopeWarps, smem, stream>>>(
        static_cast<T*>(x), rows, heads, int(head_dim), w, eps, unit_offset, half, positions, inv_freq,
        attention_scaling, interleaved);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void add(const void* x, ElemType xt, void* y, ElemType yt, int64_t n, cudaStream_t stream) {
  SPARROW_CHECK(n >= 0, "add: negative count");
  if (n == 0) return;
  dispatch2(xt, yt, [&](auto* px, auto* py) {
    using X = std::remove_pointer_t<decltype(px)>;
    using Y = std::remove_pointer_t<decltype(py)>;
    add_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<const X*>(x), static_cast<Y*>(y), n);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void gelu(void* x, ElemType type, int64_t n, bool tanh_form, cudaStream_t stream) {
  SPARROW_CHECK(n >= 0, "gelu: negative count");
  if (n == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    gelu_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<T*>(x), n, tanh_form);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void softmax_rows(const float* x, int64_t rows, int64_t cols, float scale, void* y, ElemType yt, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && cols > 0 && rows <= 0x7fffffff, "softmax_rows: bad sizes");
  if (rows == 0) return;
  dispatch(yt, [&](auto* p) {
    using Y = std::remove_pointer_t<decltype(p)>;
    softmax_rows_kernel<<<unsigned(rows), 256, 0, stream>>>(x, cols, scale, static_cast<Y*>(y));
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void rotate_pairs(void* x, ElemType type, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
                  const float* sin, int64_t R, bool interleaved, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && heads > 0 && R >= 0 && 2 * R <= head_dim, "rotate_pairs: bad sizes");
  if (rows == 0 || R == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    rotate_pairs_kernel<<<grid_for(rows * heads * R, 256), 256, 0, stream>>>(static_cast<T*>(x), rows, heads,
                                                                             head_dim, cos, sin, R, interleaved);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void add_bias(void* y, ElemType type, int64_t rows, int64_t width, const float* bias, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width > 0, "add_bias: bad sizes");
  if (rows == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    add_bias_kernel<<<grid_for(rows * width, 256), 256, 0, stream>>>(static_cast<T*>(y), rows, width, bias);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void scale(void* x, ElemType type, int64_t n, float s, cudaStream_t stream) {
  SPARROW_CHECK(n >= 0, "scale: negative count");
  if (n == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    scale_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<T*>(x), n, s);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void mul_sigmoid(void* y, ElemType yt, const void* gate, ElemType gate_type, int64_t n, cudaStream_t stream) {
  SPARROW_CHECK(n >= 0, "mul_sigmoid: negative count");
  if (n == 0) return;
  dispatch2(yt, gate_type, [&](auto* py, auto* pg) {
    using Y = std::remove_pointer_t<decltype(py)>;
    using G = std::remove_pointer_t<decltype(pg)>;
    mul_sigmoid_kernel<<<grid_for(n, 256), 256, 0, stream>>>(static_cast<Y*>(y), static_cast<const G*>(gate), n);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void attn_res_mix(const AttnResSources& sources, ElemType type, int64_t rows, int64_t width, const float* norm,
                  const float* proj, float eps, void* out, cudaStream_t stream) {
  SPARROW_CHECK(sources.count >= 1 && sources.count <= kMaxAttnResSources, "attn_res_mix: ", sources.count,
                " sources (1 to ", kMaxAttnResSources, ")");
  SPARROW_CHECK(rows >= 0 && rows <= 0x7fffffff && width > 0, "attn_res_mix: bad sizes");
  if (rows == 0) return;
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    attn_res_mix_kernel<<<unsigned(rows), norm_threads(width), 0, stream>>>(sources, width, norm, proj, eps,
                                                                             static_cast<T*>(out));
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void glu(const void* gate_up, ElemType in_type, void* out, ElemType out_type, int64_t rows, int64_t inter,
         Glu kind, float alpha, float limit, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && inter > 0, "glu: bad sizes");
  if (rows == 0) return;
  dispatch2(in_type, out_type, [&](auto* pi, auto* po) {
    using X = std::remove_pointer_t<decltype(pi)>;
    using Y = std::remove_pointer_t<decltype(po)>;
    glu_kernel<<<grid_for(rows * inter, 256), 256, 0, stream>>>(static_cast<const X*>(gate_up), static_cast<Y*>(out),
                                                                rows, inter, kind, alpha, limit);
  });
  SPARROW_CUDA_CHECK_LAUNCH();
}

void gather_rows(const void* x, ElemType type, const int32_t* index, int64_t count, int64_t width, void* out,
                 cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && width > 0, "gather_rows: bad sizes");
  SPARROW_CHECK(count <= 0x7fffffff, "gather_rows: too many rows");
  if (count == 0) return;
  const int64_t bytes = width * (type == ElemType::F32 ? 4 : 2);
  const bool words4 = bytes % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if (words4)
    gather_kernel<<<unsigned(count), norm_threads(bytes / 4 * 4), 0, stream>>>(
        static_cast<const uint32_t*>(x), index, bytes / 4, static_cast<uint32_t*>(out));
  else
    gather_kernel<<<unsigned(count), norm_threads(bytes / 2 * 4), 0, stream>>>(
        static_cast<const uint16_t*>(x), index, bytes / 2, static_cast<uint16_t*>(out));
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
