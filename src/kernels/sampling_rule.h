// One definition of how a row of logits becomes a token, shared by the CPU reference
// (kernels/cpu/reference_sampling.h) and the GPU (kernels/cuda/sampling), so that both choose the same token
// from the same logits and the same random key. Plain structs, no dependencies: both sides include it.
//
// Before the draw, a row's logits may be adjusted in place at a few tokens (LogitAdjustment: logit_bias,
// the repetition / frequency / presence penalties and the end-token mask of min_tokens, vLLM's
// LogitBiasLogitsProcessor, apply_all_penalties and MinTokensLogitsProcessor). The engine computes which
// tokens and by how much.
// Then a row may have a token bitmask (structured outputs, allowed_token_ids; ops::TokenBitmask): every
// token whose bit is clear gets logit -inf, so it is never drawn (vLLM's apply_grammar_bitmask).
//
// The draw (TokenDraw), in vLLM's order (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py):
//   1. temperature < 1e-5: greedy, the largest logit, ties to the smaller id, NaN last.
//   2. s_i = logit_i / temperature (fp32 division). Order O: s descending, ties to the smaller id, NaN last
//      (NaN never drawn: it gets weight 0).
//   3. top_k > 0 keeps the first min(top_k, V) tokens of O.
//   4. w_i = exp(double(s_i) - s_max). min_p > 0 drops tokens with w_i < min_p (the probability below
//      min_p times the top probability; the top token always stays).
//   5. top_p < 1 keeps the shortest prefix of O (among what is left) whose weight reaches
//      top_p times the weight left.
//   6. Of the kept tokens, the one with the largest  double(s_i) - log(-log(u_i))  (ties to the smaller
//      id), u_i = uniform(key, i) in (0, 1]. This is the Gumbel-max form of drawing from
//      softmax(s) restricted to the kept set (Gumbel 1954; vLLM draws the same way, as probs / Exp(1)
//      noise): it needs no sort and no prefix sum, only a maximum, so it is order-free on the GPU, and
//      u_i depends only on (key, i), so a row draws the same token alone or in any batch.
#pragma once
#include <cstdint>

namespace sparrow {

// vLLM's _SAMPLING_EPS: a temperature below it means greedy.
inline constexpr float kGreedyTemperature = 1e-5f;

struct TokenDraw {
  float temperature = 1.0f;
  float top_p = 1.0f;   // (0, 1]
  float min_p = 0.0f;   // [0, 1]
  int32_t top_k = 0;    // <= 0: off
  uint64_t key = 0;     // the row's random key for this step (from the sequence's seeded generator)
};

// logit += bias (logit_bias, first as in vLLM; 0 = none, skipped), then
// logit = logit > 0 ? logit / divide_positive : logit * divide_positive  (repetition penalty; 1 = none)
// then logit -= subtract (frequency * count + presence), then -inf when `mask` (an end token held back).
struct LogitAdjustment {
  int32_t row = 0;
  int32_t token = 0;
  float divide_positive = 1.0f;
  float subtract = 0.0f;
  int32_t mask = 0;
  float bias = 0.0f;  // last: the aggregate initialisations written before it keep their meaning
};

// Bit t of a token bitmask row (32 tokens per word, token t at bit t % 32 of word t / 32): token t allowed.
inline constexpr bool token_allowed(const uint32_t* words, int64_t t) { return (words[t >> 5] >> (t & 31)) & 1u; }

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix with full avalanche.
inline constexpr uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// u(key, i) in (0, 1]: the top 53 bits of mix64(key ^ mix64(i)), plus one, times 2^-53.
inline constexpr double uniform_at(uint64_t key, int64_t i) {
  return double((mix64(key ^ mix64(uint64_t(i))) >> 11) + 1) * 0x1p-53;
}

}  // namespace sparrow
