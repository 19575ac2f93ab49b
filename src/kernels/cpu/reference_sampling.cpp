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

namespace {

// Steps 2-5 of the rule: the scaled logits s, and the candidates order[0 .. n) the draw keeps (by s when cut).
struct Candidates {
  std::vector<float> s;
  std::vector<int32_t> order;
  size_t n = 0;
  double top = 0;  // the largest s
  double weight(int32_t i) const { return std::isnan(s[i]) ? 0.0 : std::exp(double(s[i]) - top); }
};

Candidates candidates(const float* logits, int64_t vocab, const TokenDraw& draw) {
  Candidates c;
  c.s.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) c.s[i] = logits[i] / draw.temperature;
  const bool cut = draw.top_k > 0 || draw.top_p < 1 || draw.min_p > 0;
  // Without a cut every token is a candidate and no order is needed.
  if (cut) {
    c.order = top_k(c.s.data(), vocab, draw.top_k > 0 ? draw.top_k : vocab);
  } else {
    c.order.resize(vocab);
    std::iota(c.order.begin(), c.order.end(), 0);
  }
  c.top = c.s[top_k(c.s.data(), vocab, 1)[0]];
  c.n = c.order.size();
  if (draw.min_p > 0)  // order is by s, so the tokens below min_p are a suffix
    while (c.n > 1 && c.weight(c.order[c.n - 1]) < draw.min_p) --c.n;
  if (draw.top_p < 1) {
    double total = 0;
    for (size_t j = 0; j < c.n; ++j) total += c.weight(c.order[j]);
    double cumulative = 0;
    for (size_t j = 0; j < c.n; ++j) {
      cumulative += c.weight(c.order[j]);
      if (cumulative >= double(draw.top_p) * total) {
        c.n = j + 1;
        break;
      }
    }
  }
  return c;
}

}  // namespace

int32_t draw_token(const float* logits, int64_t vocab, const TokenDraw& draw) {
  if (draw.temperature < kGreedyTemperature) return top_k(logits, vocab, 1)[0];
  const Candidates c = candidates(logits, vocab, draw);
  int32_t best = c.order[0];
  double best_key = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < c.n; ++j) {
    const int32_t i = c.order[j];
    if (std::isnan(c.s[i])) continue;
    const double key = double(c.s[i]) - std::log(-std::log(uniform_at(draw.key, i)));
    if (key > best_key || (key == best_key && i < best)) {
      best_key = key;
      best = i;
    }
  }
  return best;
}

std::vector<double> token_probabilities(const float* logits, int64_t vocab, const TokenDraw& draw) {
  std::vector<double> p(size_t(vocab), 0.0);
  if (draw.temperature < kGreedyTemperature) {
    p[size_t(top_k(logits, vocab, 1)[0])] = 1;
    return p;
  }
  const Candidates c = candidates(logits, vocab, draw);
  double total = 0;
  for (size_t j = 0; j < c.n; ++j) total += p[size_t(c.order[j])] = c.weight(c.order[j]);
  for (double& x : p) x /= total;
  return p;
}

}  // namespace sparrow::cpu
