#include "engine/logprobs.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/reference_ops.h"

namespace sparrow {

TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int64_t top) {
  const int64_t vocab = int64_t(logits.size());
  std::vector<int32_t> best = cpu::top_k(logits.data(), vocab, std::max<int64_t>(top, 1));
  // log_softmax(x)_i = x_i - max - log(sum_j exp(x_j - max)), accumulated in double.
  const double max = logits[best[0]];
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - max);
  const double log_normaliser = max + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = float(double(logits[token]) - log_normaliser);
  out.rank = 1;
  for (float x : logits) out.rank += x > logits[token];
  for (int64_t i = 0; i < std::min<int64_t>(top, int64_t(best.size())); ++i)
    out.top.emplace_back(best[i], float(double(logits[best[i]]) - log_normaliser));
  return out;
}

}  // namespace sparrow
