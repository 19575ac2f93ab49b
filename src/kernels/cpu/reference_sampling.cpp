#include "kernels/cpu/reference_sampling.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

void adjust_logits(float* logits, int64_t vocab, int32_t row, std::span<const LogitAdjustment> adjustments) {
  for (const LogitAdjustment& a : adjustments) {
    if (a.row != row || a.token < 0 || a.token >= vocab) continue;
    float& x = logits[a.token];
    if (a.bias != 0.0f) x += a.bias;
    if (a.divide_positive != 1.0f) x = x > 0 ? x / a.divide_positive : x * a.divide_positive;
    x -= a.subtract;
    if (a.mask) x = -std::numeric_limits<float>::infinity();
  }
}

void apply_token_bitmask(float* logits, int64_t vocab, const uint32_t* words) {
  for (int64_t t = 0; t < vocab; ++t)
    if (!token_allowed(words, t)) logits[t] = -std::numeric_limits<float>::infinity();
}

int32_t draw_token(const float* logits, int64_t vocab, const TokenDraw& draw) {
  if (draw.temperature < kGreedyTemperature) return top_k(logits, vocab, 1)[0];
  std::vector<float> s(vocab);
  for (int64_t i = 0; i < vocab; ++i) s[i] = logits[i] / draw.temperature;
  const bool cut = draw.top_k > 0 || draw.top_p < 1 || draw.min_p > 0;
  // Without a cut every token is a candidate and no order is needed.
  std::vector<int32_t> order;
  if (cut) {
    order = top_k(s.data(), vocab, draw.top_k > 0 ? draw.top_k : vocab);
  } else {
    order.resize(vocab);
    std::iota(order.begin(), order.end(), 0);
  }
  const double top = s[top_k(s.data(), vocab, 1)[0]];
  auto weight = [&](int32_t i) { return std::isnan(s[i]) ? 0.0 : std::exp(double(s[i]) - top); };
  size_t n = order.size();
  if (draw.min_p > 0)  // order is by s, so the tokens below min_p are a suffix
    while (n > 1 && weight(order[n - 1]) < draw.min_p) --n;
  if (draw.top_p < 1) {
    double total = 0;
    for (size_t j = 0; j < n; ++j) total += weight(order[j]);
    double cumulative = 0;
    for (size_t j = 0; j < n; ++j) {
      cumulative += weight(order[j]);
      if (cumulative >= double(draw.top_p) * total) {
        n = j + 1;
        break;
      }
    }
  }
  int32_t best = order[0];
  double best_key = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < n; ++j) {
    const int32_t i = order[j];
    if (std::isnan(s[i])) continue;
    const double key = double(s[i]) - std::log(-std::log(uniform_at(draw.key, i)));
    if (key > best_key || (key == best_key && i < best)) {
      best_key = key;
      best = i;
    }
  }
  return best;
}

}  // namespace sparrow::cpu
