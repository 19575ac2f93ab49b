// The CPU reference of kernels/sampling_rule.h: what the GPU sampler is tested against, and what the
// engine runs when the model is on the CPU.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/sampling_rule.h"

namespace sparrow::cpu {

// Applies the adjustments whose row is `row` to that row's logits.
void adjust_logits(float* logits, int64_t vocab, int32_t row, std::span<const LogitAdjustment> adjustments);

// Sets the logit of every token whose bit in `words` (ceil(vocab / 32) words) is clear to -inf.
void apply_token_bitmask(float* logits, int64_t vocab, const uint32_t* words);

// The token drawn from one row of logits (kernels/sampling_rule.h, steps 1-6).
int32_t draw_token(const float* logits, int64_t vocab, const TokenDraw& draw);
// The distribution draw_token samples from: each token's probability (0 outside the kept candidates; greedy:
// one at the argmax). Speculative decoding's verification of probabilistic drafts reads it.
std::vector<double> token_probabilities(const float* logits, int64_t vocab, const TokenDraw& draw);

}  // namespace sparrow::cpu
