// Kimi Delta Attention (KDA), the linear-attention mixer of Kimi Linear (transformers 5.17
// KimiLinearDeltaAttention, modeling_kimi_linear.py) and Kimi K3 (vLLM 0.33 models/kimi_k3/nvidia/kda.py,
// KimiK3DeltaAttention).
//
// Per token x (already RMS-normalised by the decoder layer), with P = heads * head_dim:
//   q, k, v   = silu(causal depthwise conv_K([q_proj x, k_proj x, v_proj x]))     (no conv bias)
//   s         = f_b_proj(f_a_proj x) + dt_bias,  a = exp(A_log[h])                 per key channel
//   g         = -a * softplus(s)                  Kimi Linear, <= 0
//             = lower_bound * sigmoid(a * s)      Kimi K3 (gate_lower_bound < 0), in (lower_bound, 0)
//   beta      = sigmoid(b_proj x)                                                  per head
//   q, k      = l2norm(q), l2norm(k)  (x / sqrt(sum x^2 + 1e-6)), then q *= head_dim^-1/2
//   S         = (I - beta k k^T) Diag(exp g) S + beta k v^T,   o = S^T q            per head
//   out       = o_proj( RMSNorm_head(o) * o_norm * sigmoid(gate) )
//   gate      = g_b_proj(g_a_proj x) (Kimi Linear, low rank) or g_proj x (Kimi K3, use_full_rank_gate)
//
// Prefill (count > 1) runs the chunk-parallel form of the recurrence (transformers
// chunk_kimi_delta_attention, chunk size 64); decode (count == 1) runs it token by token
// (recurrent_kimi_delta_attention). Both start from the sequence's saved state, so a prefill may
// continue an earlier one. They agree to fp32 rounding. On the GPU a step whose longest sequence has
// 64 rows or more runs the chunk-parallel kernel (bf16/tf32 tensor-core operands, ~5e-3 relative), any
// other step the exact token-serial one.
//
// State per sequence (the states of this layer in the sequence's SequenceCache, fp32, zeros for a
// fresh sequence):
//   ConvTail:  [kernel - 1, 3P] the last kernel-1 pre-convolution inputs [q | k | v], oldest first.
//   Recurrent: [heads, head_dim (key), head_dim (value)], S[h][k][v] (key index first, as
//              transformers' last_recurrent_state and fla's default layout).
// When the cache asks for a snapshot at position p (prefix caching), the pass stops at p, copies both
// states as they stand there, and continues: the copy is exactly what a pass ending at p would leave.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "model/decoder.h"

namespace sparrow {

struct KdaConfig {
  int64_t hidden = 0;
  int64_t num_heads = 0;    // linear_num_heads
  int64_t head_dim = 0;     // linear_head_dim (key and value head size)
  int64_t conv_kernel = 4;  // linear_conv_kernel_dim
  // The gated output norm's eps: rms_norm_eps in transformers' Kimi Linear; 1e-5 in vLLM's Kimi K3, whose
  // FusedRMSNormGated keeps its default (kda.py never passes rms_norm_eps).
  float norm_eps = 1e-5f;
  float decay_lower_bound = 0.0f;  // gate_lower_bound (< 0: Kimi K3's bounded decay); 0: unbounded
  bool full_rank_gate = false;     // use_full_rank_gate: the output gate is g_proj [P, hidden]
  int64_t projection_dim() const { return num_heads * head_dim; }
};

struct KdaWeights {
  Tensor qkv_proj;  // [3P, hidden]: q_proj rows, then k_proj, then v_proj
  Tensor conv;      // [3P, kernel] depthwise taps; column kernel-1 multiplies the current token
  Tensor f_a_proj;  // [head_dim, hidden]  forget gate, low rank
  Tensor f_b_proj;  // [P, head_dim]
  Tensor dt_bias;   // [P]
  Tensor A_log;     // [heads]
  Tensor b_proj;    // [heads, hidden]     beta
  Tensor g_a_proj;  // [head_dim, hidden]  output gate, low rank (Kimi Linear)
  Tensor g_b_proj;  // [P, head_dim]
  Tensor g_proj;    // [P, hidden]         output gate, full rank (Kimi K3)
  Tensor o_norm;    // [head_dim]          gated RMSNorm weight, shared by the heads
  Tensor o_proj;    // [hidden, P]
};

class KdaMixer : public Mixer {
 public:
  KdaMixer(const KdaConfig& config, KdaWeights weights);
  // Takes the weights under `prefix` ("model.layers.3.self_attn."), in the layout transformers saves
  // (forget_gate.*, one fused conv1d) or the one Kimi's released checkpoints ship (f_a_proj, A_log,
  // dt_bias directly under self_attn; separate q_conv1d / k_conv1d / v_conv1d; A_log as [1, 1, heads, 1]
  // or, in Kimi K3's, [heads]).
  static std::unique_ptr<KdaMixer> load(Checkpoint& ckpt, const std::string& prefix, const KdaConfig& config);

  Tensor forward(const Tensor& x, const Batch& batch, int layer) override;
  LayerCacheSpec cache_spec() const override { return cache_spec_for(config_); }
  std::string name() const override { return "kda"; }
  static LayerCacheSpec cache_spec_for(const KdaConfig& config);

 private:
  // The phases after the projections, each one entry point on either device (CPU: kernels/cpu/kda_reference.h,
  // GPU: kernels/cuda/kda/kda.h). gates_: log_decay [T, P] and beta [T, H] in place from their projections.
  // mix: the conv and the delta rule over the sequences' states, returns core [T, P] fp32.
  // gated_norm: RMSNorm per head times sigmoid(out_gate), fp32 on the CPU (in place) and bf16 on the GPU.
  void gates_(Tensor& log_decay, Tensor& beta) const;
  Tensor mix(const Tensor& qkv, const Tensor& log_decay, const Tensor& beta, const Batch& batch, int layer) const;
  Tensor gated_norm(Tensor& core, const Tensor& out_gate) const;

  KdaConfig config_;  // sharded: num_heads is this rank's (model/tensor_parallel.h)
  KdaWeights w_;
  TensorParallel tp_;  // forward() sums o_proj's output over the group
  // The weights' names start with these ("model.layers.N.self_attn.", and where f_a/f_b_proj live): LoRA
  // modules (model/lora.h).
  std::string prefix_, gate_prefix_;
};

}  // namespace sparrow
