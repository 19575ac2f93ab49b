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

// ---- RMSNorm, LayerNorm ----------------------------------------------------------------------------
// cpu::rms_normalize then the weight: inv = 1 / sqrt(float(ss / n) + eps); x *= inv; x *= w (or 1 + w).
// One block per (row, group); y may alias x (each thread writes only what it read).
template <typename X, typename Y>
__global__ void rms_norm_kernel(const X* x, int64_t x_stride, Y* y, int64_t y_stride, int64_t first_col,
                                int64_t groups, int64_t width, const float* w, float eps, bool unit_offset) {
  __shared__ double scratch[32];
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  const X* xr = x + row * x_stride + first_col + g * width;
  Y* yr = y + row * y_stride + first_col + g * width;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    double v = load(xr, i);
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(float(ss / double(width)), eps)));
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    float v = __fmul_rn(load(xr, i), inv);
    if (w != nullptr) v = __fmul_rn(v, unit_offset ? __fadd_rn(1.0f, w[i]) : w[i]);
    store(yr, i, v);
  }
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
template <typename T>
__global__ void layer_norm_kernel(T* x, int64_t width, const float* w, const float* b, float eps) {
  __shared__ double scratch[32];
  T* xr = x + int64_t(blockIdx.x) * width;
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

int norm_threads(int64_t width) {
  int64_t t = (width / 4 + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > 512) t = 512;
  return int(t);
}

// ---- rotary embedding ------------------------------------------------------------------------------
// One block per row. Angles (src/model/rope.cpp Rope::angles): a = inv_freq[i] * float(pos) in fp32,
// cos/sin of a (in double, rounded), each times attention_scaling. Heads are processed in rounds of
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
  for (int64_t h0 = 0; h0 < heads; h0 += heads_per_round) {
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
    rms_norm_kernel<<<unsigned(rows * groups), norm_threads(width), 0, stream>>>(
        static_cast<const T*>(x), row_stride, static_cast<T*>(x), row_stride, first_col, groups, width, w, eps,
        unit_offset);
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
    rms_norm_kernel<<<unsigned(rows), norm_threads(width), 0, stream>>>(
        static_cast<const X*>(x), width, static_cast<Y*>(y), width, 0, 1, width, w, eps, unit_offset);
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
    layer_norm_kernel<<<unsigned(rows), norm_threads(width), 0, stream>>>(static_cast<T*>(x), width, w, b, eps);
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
  dispatch(type, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    rope_kernel<<<unsigned(rows), threads, 2 * half * sizeof(float), stream>>>(
        static_cast<T*>(x), row_stride, first_col, heads, head_stride, half, positions, inv_freq, attention_scaling,
        interleaved);
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
