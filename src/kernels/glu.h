// The gated activations of the feed-forward blocks, one list for the CPU reference (cpu::glu in
// kernels/cpu/reference_ops.h), kernels/ops.h and the CUDA kernels (elementwise glu, the MoE experts).
// Each maps a gate g and an up value u to one value; `alpha` and `limit` are the kind's two parameters.
//   SiluGlu        silu(g) * u                                                  (DeepSeek, Kimi Linear)
//   ClampedSwiglu  g' = min(g, limit), u' = clamp(u, -limit, limit):
//                  (u' + 1) * g' * sigmoid(alpha * g')                           (MiniMax-M3)
//   Situ           alpha * tanh(g / alpha) * sigmoid(g) * u'', u'' = limit * tanh(u / limit) when
//                  limit > 0, else u                                             (Kimi K3: alpha is
//                  activation_situ_beta, limit activation_situ_linear_beta; vLLM 0.33
//                  model_executor/layers/activation.py SituAndMul.forward_native)
#pragma once

namespace sparrow {

enum class Glu { SiluGlu, ClampedSwiglu, Situ };

}  // namespace sparrow
