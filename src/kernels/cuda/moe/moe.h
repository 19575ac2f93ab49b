// Mixture-of-experts on the GPU: routing, and the routed experts of a whole step in one pass.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/elementwise/elementwise.h"

namespace sparrow::cuda {

// DeepSeek-V3's grouped sigmoid routing (transformers DeepseekV3TopkRouter / MoE.route_tokens_to_experts),
// per token: s = sigmoid(logits) (fp32 [tokens, experts]); choice = s + bias; groups scored by the sum of
// their two best choices, the topk_group best groups kept; the top_k best choices among them (ties to the
// smaller index); weights s[chosen] (normalised by their sum + 1e-20 when `normalize`) * scaling.
// experts: int32 [tokens, top_k]; weights fp32 [tokens, top_k].
void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float scaling,
                           int32_t* experts, float* weights, cudaStream_t stream);
// The same with the normalisation's epsilon explicit (SigmoidRouter::normalize_eps: DeepSeek 1e-20,
// MiniMax 0); the form above uses 1e-20.
void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float normalize_eps,
                           float scaling, int32_t* experts, float* weights, cudaStream_t stream);

// Routed experts over all tokens of a step:
//   out[t] = sum_j weights[t, j] * down[e] · act(gate_up[e] · x[t]),  e = experts[t, j]
// x bf16 [tokens, hidden]; gate_up bf16 [E, 2*inter, hidden]; down bf16 [E, hidden, inter]; out bf16
// [tokens, hidden] (overwritten). Tokens are grouped by expert on the device (no host round trip) and
// each expert's tokens go through one product; `workspace` is from moe_workspace_bytes.
size_t moe_workspace_bytes(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter);
void moe_experts(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                 int64_t top_k, const void* gate_up, const void* down, int64_t num_experts, int64_t inter,
                 GluKind glu_kind, float alpha, float limit, void* out, void* workspace, cudaStream_t stream);

}  // namespace sparrow::cuda
