// CPU reference ops, fp32. These are the leaves the model is built from; each has a plain loop or a
// BLAS call and no knowledge of models, caches or requests. The CUDA backend will provide the same
// operations (src/kernels/cuda) and is tested against these.
#pragma once
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "kernels/glu.h"

namespace sparrow::cpu {

// y[T, out] = x[T, in] · w[out, in]^T  (a torch Linear without bias), through OpenBLAS.
Tensor linear(const Tensor& x, const Tensor& w);
void linear_into(const Tensor& x, const Tensor& w, Tensor& y);
// Same on raw row-major pointers: y[m, n] = x[m, k] · w[n, k]^T, with leading dimensions.
void gemm_nt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
             int64_t ldy, float beta = 0.0f);
// y[m, n] = x[m, k] · w[k, n]
void gemm_nn(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
             int64_t ldy, float beta = 0.0f);

// RMSNorm over groups of w.numel() values (x may hold several heads per row):
// y = x / sqrt(mean(x^2) + eps) * (unit_offset ? 1 + w : w). unit_offset is Gemma's convention.
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool unit_offset = false);
void rms_norm_inplace(Tensor& x, const Tensor& w, float eps, bool unit_offset = false);
// RMSNorm without a weight (used by L2-style normalisations with a learned weight elsewhere).
void rms_normalize(float* x, int64_t n, float eps);
// LayerNorm over the last dim (size w.numel()), torch.nn.LayerNorm semantics (biased variance).
Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// GELU: the erf form, or torch's approximate="tanh": 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
inline float gelu(float x, bool tanh_form) {
  if (tanh_form) return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
}
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Gated activations of one row, out[i] = act(gate[i], up[i]) of the kind (kernels/glu.h): silu(gate) * up;
// MiniMax's clamped SwiGLU (MiniMaxM3VLExperts._apply_gate: the gate clamped from above only, up on both
// sides); Kimi K3's SiTU (vLLM 0.33 SituAndMul.forward_native).
void glu(Glu kind, const float* gate, const float* up, float* out, int64_t n, float alpha, float limit);

// AttnRes (Kimi K3; vLLM 0.33 models/kimi_k3/nvidia/ops/attn_res.py _attn_res_kernel): per row r, over the
// sources i (each [rows, width]),
//   logit_i = sum_c norm[c] proj[c] v_i[r, c] / sqrt(mean_c v_i[r, c]^2 + eps),  out[r] = sum_i softmax_i v_i[r]
// (the raw sources are mixed; only the logits see them normalised). Sums in double.
void attn_res_mix(std::span<const float* const> sources, const float* norm, const float* proj, float eps, float* out,
                  int64_t rows, int64_t width);

// Softmax in place over n values; entries equal to -inf get probability 0.
void softmax_inplace(float* x, int64_t n);

// Indices of the k largest scores, largest first, ties to the smaller index (a deterministic
// stand-in for torch.topk, whose tie order is unspecified). k is clamped to n.
std::vector<int32_t> top_k(const float* scores, int64_t n, int64_t k);

// Embedding lookup: out[i] = table[ids[i]].
Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids);

// Rotary embedding of one head's leading rot_dim values with precomputed cos/sin (rot_dim/2 each).
// neox pairs (x[i], x[i + d/2]); interleaved pairs (x[2i], x[2i+1]) and writes back
// [rotated evens..., rotated odds...] as transformers' apply_rotary_pos_emb_interleave (model/rope.h).
void apply_rope_neox(float* x, const float* cos, const float* sin, int rot_dim);
void apply_rope_interleaved(float* x, const float* cos, const float* sin, int rot_dim);
// transformers' apply_rotary_pos_emb with cos[..., :head_dim] of a rotary embedding wider than the head
// (MiniMaxM3VLIndexer when index_head_dim < rotary dims): the whole head is rotated half against half,
// and element j takes the angle of frequency j mod (rot_dim / 2), as the sliced cat(freqs, freqs) table
// holds it. cos / sin: rot_dim / 2 entries. A plain rotation only when head_dim = rot_dim.
void apply_rope_neox_narrow_head(float* x, const float* cos, const float* sin, int head_dim, int rot_dim);

// y += x elementwise.
void add_inplace(Tensor& y, const Tensor& x);

}  // namespace sparrow::cpu
