#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace sparrow {

namespace {
// vLLM's _SAMPLING_EPS: a temperature below it means greedy.
constexpr float kGreedyTemperature = 1e-5f;
}  // namespace

void validate(const SamplingParams& p) {
  SPARROW_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0, got ", p.temperature);
  SPARROW_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got ", p.top_p);
  SPARROW_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1], got ", p.min_p);
  SPARROW_CHECK(p.top_k >= -1, "top_k must be -1, 0 (disabled) or positive, got ", p.top_k);
  SPARROW_CHECK(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0,
                "repetition_penalty must be > 0, got ", p.repetition_penalty);
  SPARROW_CHECK(p.presence_penalty >= -2 && p.presence_penalty <= 2, "presence_penalty must be in [-2, 2], got ",
                p.presence_penalty);
  SPARROW_CHECK(p.frequency_penalty >= -2 && p.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2], got ",
                p.frequency_penalty);
  SPARROW_CHECK(p.max_tokens >= 1, "max_tokens must be at least 1, got ", p.max_tokens);
  SPARROW_CHECK(p.min_tokens >= 0 && p.min_tokens <= p.max_tokens,
                "min_tokens must be in [0, max_tokens], got ", p.min_tokens, " with max_tokens ", p.max_tokens);
  SPARROW_CHECK(p.logprobs >= -1 && p.logprobs <= kMaxLogprobs, "logprobs must be in [0, ", kMaxLogprobs,
                "], got ", p.logprobs);
  SPARROW_CHECK(p.prompt_logprobs >= -1 && p.prompt_logprobs <= kMaxLogprobs, "prompt_logprobs must be in [0, ",
                kMaxLogprobs, "], got ", p.prompt_logprobs);
  SPARROW_CHECK(p.n >= 1, "n must be at least 1, got ", p.n);
  for (const std::string& s : p.stop) SPARROW_CHECK(!s.empty(), "stop strings must not be empty");
  for (int32_t id : p.stop_token_ids) SPARROW_CHECK(id >= 0, "stop_token_ids must be >= 0, got ", id);
}

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output) {
  if (p.repetition_penalty != 1) {
    std::unordered_set<int32_t> seen(prompt.begin(), prompt.end());
    seen.insert(output.begin(), output.end());
    for (int32_t id : seen) {
      float& x = logits[id];
      x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    }
  }
  if (p.frequency_penalty != 0 || p.presence_penalty != 0) {
    std::unordered_map<int32_t, int64_t> counts;
    for (int32_t id : output) ++counts[id];
    for (auto [id, count] : counts) logits[id] -= p.frequency_penalty * float(count) + p.presence_penalty;
  }
}

int32_t argmax(std::span<const float> logits) {
  return cpu::top_k(logits.data(), int64_t(logits.size()), 1)[0];
}

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> end_tokens)
    : params_(params), end_tokens_(std::move(end_tokens)), rng_(params.seed.value_or(std::random_device{}())) {
  validate(params);
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output) {
  const bool penalised = params_.repetition_penalty != 1 || params_.frequency_penalty != 0 ||
                         params_.presence_penalty != 0;
  const bool masked = int64_t(output.size()) < params_.min_tokens && !end_tokens_.empty();
  if (!penalised && !masked) return draw(logits);
  std::vector<float> processed(logits.begin(), logits.end());
  if (masked)
    for (int32_t id : end_tokens_)
      if (id < int64_t(processed.size())) processed[id] = -std::numeric_limits<float>::infinity();
  apply_penalties(processed, params_, prompt, output);
  return draw(processed);
}

int32_t Sampler::draw(std::span<const float> logits) {
  if (params_.temperature < kGreedyTemperature) return argmax(logits);
  const int64_t vocab = int64_t(logits.size());
  // Candidates from the most likely down (ties to the smaller id, so a seeded draw is reproducible);
  // min_p, top_k and top_p each keep a prefix of this order. Without a cut, sorting is not needed.
  const bool cut = params_.top_k > 0 || params_.top_p < 1 || params_.min_p > 0;
  const int64_t keep = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  std::vector<int32_t> order;
  if (cut) {
    order = cpu::top_k(logits.data(), vocab, keep);
  } else {
    order.resize(vocab);
    std::iota(order.begin(), order.end(), 0);
  }
  const double inv_temperature = 1.0 / params_.temperature;
  const double top = double(logits[argmax(logits)]) * inv_temperature;
  std::vector<double> weights(order.size());  // exp((logit - top) / temperature), unnormalised
  for (size_t i = 0; i < order.size(); ++i) weights[i] = std::exp(double(logits[order[i]]) * inv_temperature - top);
  // min_p (vllm/v1/sample/ops min_p): probability >= min_p * top probability, i.e. weight >= min_p.
  size_t n = order.size();
  if (params_.min_p > 0)
    while (n > 1 && weights[n - 1] < params_.min_p) --n;
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += weights[i];
  // top_p over what is left: the first token at which the cumulative mass reaches top_p is the last kept.
  if (params_.top_p < 1) {
    double cumulative = 0;
    for (size_t i = 0; i < n; ++i) {
      cumulative += weights[i];
      if (cumulative >= params_.top_p * total) {
        n = i + 1;
        total = cumulative;
        break;
      }
    }
  }
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= weights[i];
    if (r < 0) return order[i];
  }
  return order[n - 1];
}

}  // namespace sparrow
