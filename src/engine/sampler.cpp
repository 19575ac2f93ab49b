#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace sparrow {

void validate(const SamplingParams& p) {
  SPARROW_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0, got ", p.temperature);
  SPARROW_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got ", p.top_p);
  SPARROW_CHECK(p.top_k >= -1, "top_k must be -1, 0 (disabled) or positive, got ", p.top_k);
}

int32_t argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return int32_t(best);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed.value_or(std::random_device{}())) {
  validate(params);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0) return argmax(logits, vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  // Candidates sorted by logit, largest first (ties to the smaller id, so the draw is reproducible).
  int64_t keep = vocab;
  if (params_.top_k > 0) keep = std::min<int64_t>(keep, params_.top_k);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  if (keep < vocab) {
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
    order.resize(keep);
  } else {
    std::sort(order.begin(), order.end(), by_logit);
  }
  std::vector<double> probs(order.size());
  const double top = logits[order[0]] / params_.temperature;
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += probs[i] = std::exp(logits[order[i]] / params_.temperature - top);
  size_t n = order.size();
  if (params_.top_p < 1) {
    double cumulative = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      cumulative += probs[i] / sum;
      if (cumulative >= params_.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  double total = std::accumulate(probs.begin(), probs.begin() + n, 0.0);
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= probs[i];
    if (r < 0) return order[i];
  }
  return order[n - 1];
}

}  // namespace sparrow
