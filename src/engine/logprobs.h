// Log-probabilities reported to the user. As vLLM's default logprobs_mode "raw_logprobs", they are the
// log_softmax of the logits the model produced, before penalties, temperature or any cut.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace sparrow {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  int64_t rank = 0;  // 1 + how many tokens are more likely (vLLM's Logprob.rank)
  std::vector<std::pair<int32_t, float>> top;  // the `top` most likely tokens, most likely first
};

// `token`'s logprob under `logits`, with the `top` most likely tokens (ties to the smaller id).
TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int64_t top);

}  // namespace sparrow
