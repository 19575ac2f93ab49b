// Mixture-of-experts routing and experts, the CPU reference (transformers 5.17 DeepseekV32TopkRouter,
// KimiLinearTopkRouter, MiniMaxM3VLTopKRouter and their experts; model/feed_forward.h says what the block
// does). kernels/ops.h runs these for host tensors; kernels/cuda/moe is the GPU form and is tested against
// them.
#pragma once
#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "kernels/expert_adapters.h"
#include "kernels/glu.h"

namespace sparrow::cpu {

// Grouped sigmoid routing of router logits [T, E] (fp32) with the correction bias [E]: per token the
// scores s = sigmoid(logit); choice = s + bias; with n_group > 1 each group scores the sum of its two best
// choices and only the topk_group best groups stay; the top_k choices win (ties to the smaller expert id);
// their weights are the unbiased scores, divided by (their sum + normalize_eps) when normalize, times
// scaling. Writes experts [T, top_k] and weights [T, top_k].
void route_grouped_sigmoid(const Tensor& logits, const Tensor& bias, int64_t n_group, int64_t topk_group,
                           int64_t top_k, bool normalize, float normalize_eps, float scaling, int32_t* experts,
                           float* weights);

// out[t] = sum_j weights[t, j] * down[e] · glu(gate_up[e] · x[t]) over e = experts[t, j]; gate_up [E, 2I, H]
// (gate rows first), down [E, H, I]; glu of the kind with its alpha and limit (kernels/glu.h). Each expert
// runs one product over the tokens routed to it; each adapter run's low-rank terms (kernels/expert_adapters.h)
// are added for its rows' slots.
Tensor moe_experts(const Tensor& x, const int32_t* experts, const float* weights, int64_t top_k,
                   const Tensor& gate_up, const Tensor& down, Glu kind, float alpha, float limit,
                   std::span<const ExpertAdapterRun> adapters = {});

}  // namespace sparrow::cpu
