// The small per-token kernels the decoder is built from, each the GPU twin of a CPU op in
// src/kernels/cpu/reference_ops.h and tested against it. Activations are bf16 or fp32 (ElemType); internal math
// is fp32. All pointers are device pointers; rows are contiguous with the given row stride (elements).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/gemm/gemm.h"  // ElemType
#include "kernels/glu.h"

namespace sparrow::cuda {

// Converts n elements between types (same type: a copy).
void convert(const void* x, ElemType xt, void* y, ElemType yt, int64_t n, cudaStream_t stream);

// out[i, :] = table[ids[i], :] (table bf16 or fp32 [vocab, width]; ids device int32 [count]).
void embedding(const void* table, ElemType table_type, const int32_t* ids, int64_t count, int64_t width, void* out,
               ElemType out_type, cudaStream_t stream);

// In place over `rows` rows of stride `row_stride`: for g in [0, groups), the `width` values starting at
// column first_col + g * width are RMS-normalised and scaled by w (fp32 [width]; 1 + w when
// unit_offset). w may be null (no weight).
void rms_norm(void* x, ElemType type, int64_t rows, int64_t row_stride, int64_t first_col, int64_t groups,
              int64_t width, const float* w, float eps, bool unit_offset, cudaStream_t stream);
// Out of place, whole rows: y[r, :] = rmsnorm(x[r, :]) (x and y may differ in type).
void rms_norm_rows(const void* x, ElemType xt, void* y, ElemType yt, int64_t rows, int64_t width, const float* w,
                   float eps, bool unit_offset, cudaStream_t stream);
// The residual add fused into the norm after it: x[r, :] += delta[r, :] (each sum rounded to x's type,
// add()'s values), then y[r, :] = rmsnorm of the rounded x[r, :], as add() then rms_norm_rows() give, in
// one launch. x and delta share one type; y aliases neither.
void add_rms_norm_rows(void* x, const void* delta, ElemType xt, void* y, ElemType yt, int64_t rows, int64_t width,
                       const float* w, float eps, bool unit_offset, cudaStream_t stream);
// torch LayerNorm over rows of `width` (biased variance), in place.
void layer_norm(void* x, ElemType type, int64_t rows, int64_t width, const float* w, const float* b, float eps,
                cudaStream_t stream);

// Rotary embedding in place: for each row r (token at positions[r]) and head h < heads, the `rot` values
// at column first_col + h * head_stride are rotated by angles positions[r] * inv_freq[i] (fp32, rot/2
// frequencies), cos/sin multiplied by attention_scaling. Pairing as src/model/rope.h: neox pairs
// (i, i + rot/2); interleaved pairs (2i, 2i+1) and writes [evens..., odds...] back.
void rope(void* x, ElemType type, int64_t rows, int64_t row_stride, int64_t first_col, int64_t heads,
          int64_t head_stride, int64_t rot, const int64_t* positions, const float* inv_freq, float attention_scaling,
          bool interleaved, cudaStream_t stream);
// A per-head norm and the rotation after it in one launch: x [rows, heads * head_dim] contiguous, each head
// RMS-normalised by rms_norm's rule (w [head_dim], 1 + w when unit_offset), then its first `rot` values
// rotated by rope's rule; the same values as rms_norm(x, ..., groups = heads, width = head_dim) then
// rope(x, ..., head_stride = head_dim), each head's norm rounded to x's type before its rotation as the two
// launches store it. head_dim <= 128 (one warp a head, as rms_norm runs such a head), rot <= head_dim.
void rms_norm_rope_heads(void* x, ElemType type, int64_t rows, int64_t heads, int64_t head_dim, const float* w,
                         float eps, bool unit_offset, int64_t rot, const int64_t* positions, const float* inv_freq,
                         float attention_scaling, bool interleaved, cudaStream_t stream);

// y = x + y elementwise (n values); y += bias per row (bias fp32 [width]); x *= s.
void add(const void* x, ElemType xt, void* y, ElemType yt, int64_t n, cudaStream_t stream);
void add_bias(void* y, ElemType type, int64_t rows, int64_t width, const float* bias, cudaStream_t stream);
void scale(void* x, ElemType type, int64_t n, float s, cudaStream_t stream);
// y *= sigmoid(gate) elementwise (n values; an attention output gate).
void mul_sigmoid(void* y, ElemType yt, const void* gate, ElemType gate_type, int64_t n, cudaStream_t stream);

// AttnRes (Kimi K3), cpu::attn_res_mix: per row r, over the sources i < count (each [rows, width], one type),
//   logit_i = sum_c norm[c] proj[c] v_i[r, c] / sqrt(mean_c v_i[r, c]^2 + eps),  out[r] = sum_i softmax_i v_i[r]
// norm and proj fp32 [width]. At most kMaxAttnResSources sources.
constexpr int kMaxAttnResSources = 32;
struct AttnResSources {
  const void* rows[kMaxAttnResSources];
  int count = 0;
};
void attn_res_mix(const AttnResSources& sources, ElemType type, int64_t rows, int64_t width, const float* norm,
                  const float* proj, float eps, void* out, cudaStream_t stream);

// Gated activations over rows of [gate (inter) | up (inter)]: out[r, :inter] = act(gate, up), of the kind
// (kernels/glu.h) with its alpha and limit.
void glu(const void* gate_up, ElemType in_type, void* out, ElemType out_type, int64_t rows, int64_t inter,
         Glu kind, float alpha, float limit, cudaStream_t stream);

// GELU in place over n values (cpu::gelu: erf, or torch's tanh form).
void gelu(void* x, ElemType type, int64_t n, bool tanh_form, cudaStream_t stream);
// y[r, :] = softmax(scale * x[r, :]) over rows of `cols` (x fp32; y of its type), ops::softmax_rows.
void softmax_rows(const float* x, int64_t rows, int64_t cols, float scale, void* y, ElemType yt, cudaStream_t stream);
// ops::rotate_pairs_: x [rows, heads * head_dim]; in each head pair j < R (interleaved: 2j, 2j + 1; else j, j + R)
// turns by cos/sin[r, j] (fp32 [rows, R]).
void rotate_pairs(void* x, ElemType type, int64_t rows, int64_t heads, int64_t head_dim, const float* cos,
                  const float* sin, int64_t R, bool interleaved, cudaStream_t stream);

// Copies rows: out[i, :] = x[index[i], :] (width values; index device int32 [count]).
void gather_rows(const void* x, ElemType type, const int32_t* index, int64_t count, int64_t width, void* out,
                 cudaStream_t stream);

}  // namespace sparrow::cuda
