// Kimi Delta Attention's token-mixing core, the CPU reference (transformers 5.17 KimiLinearDeltaAttention;
// model/kda_mixer.h says what the block does). kernels/cuda/kda is the GPU form and is tested against this.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace sparrow::cpu {

// The gates (kernels/cuda/kda/kda.h kda_gates is the same contract), in place allowed, with
// s = f[t, c] + dt_bias[c] and a = exp(A_log[c / head_dim]) (c < heads * head_dim):
//   g[t, c]    = -a * softplus(s)                  lower_bound == 0: Kimi Linear (KimiLinearForgetGate)
//   g[t, c]    = lower_bound * sigmoid(a * s)      lower_bound < 0:  Kimi K3's bounded decay (vLLM 0.33
//                kimi_k3/nvidia/ops/third_party/kda/chunk.py kda_gate_chunk_cumsum_vector_kernel)
//   beta[t, h] = sigmoid(b[t, h])
void kda_gates(const float* f, const float* dt_bias, const float* A_log, const float* b, float* g, float* beta,
               int64_t rows, int64_t heads, int64_t head_dim, float lower_bound);

// The causal depthwise conv + SiLU of `count` new tokens of one sequence (transformers causal_conv1d_fn with
// the cached left context), then the l2norm of q and k per head and q *= head_dim^-1/2. history holds
// [kernel - 1 + count, 3P] pre-conv inputs [q | k | v] (the saved tail, oldest first, then the new tokens);
// weight [3P, kernel] (column kernel - 1 multiplies the current token). Writes rows of q, k, v (ld apart).
void kda_short_conv(const float* history, const float* weight, int64_t kernel, int64_t count, int64_t heads,
                    int64_t head_dim, float* q, float* k, float* v, int64_t ld);

// The delta-rule core for one sequence, all heads. q and k are L2-normalised, q also scaled.
struct DeltaRuleInputs {
  int64_t length = 0;      // tokens T
  int64_t num_heads = 0;   // H
  int64_t head_dim = 0;    // D (keys and values)
  const float* q = nullptr;          // [T, H, D]
  const float* k = nullptr;          // [T, H, D]
  const float* v = nullptr;          // [T, H, D]
  const float* log_decay = nullptr;  // [T, H, D] g, per key channel
  const float* beta = nullptr;       // [T, H]
};

// Token by token: state [H, D, D] (S[h][k][v]) is read and updated, out is [T, H, D].
void delta_rule_recurrent(const DeltaRuleInputs& in, float* state, float* out);
// The same result through the chunk-parallel form (chunks of `chunk_size` tokens).
void delta_rule_chunked(const DeltaRuleInputs& in, float* state, float* out, int64_t chunk_size = 64);

// KimiLinearRMSNormGated: per-head RMSNorm of o [T, P] with `weight` [head_dim], then times sigmoid(gate).
void kda_gated_rms_norm(Tensor& o, const Tensor& gate, const Tensor& weight, float eps);

}  // namespace sparrow::cpu
