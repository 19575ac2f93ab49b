#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/cpu/reference_sampling.h"

namespace sparrow {

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
  for (auto [id, bias] : p.logit_bias) {
    SPARROW_CHECK(id >= 0, "logit_bias token ids must be >= 0, got ", id);
    SPARROW_CHECK(std::isfinite(bias) && std::fabs(bias) <= kMaxLogitBias, "logit_bias values must be in [-",
                  kMaxLogitBias, ", ", kMaxLogitBias, "], got ", bias, " for token ", id);
  }
  if (p.allowed_token_ids) {
    SPARROW_CHECK(!p.allowed_token_ids->empty(), "allowed_token_ids must not be empty");
    for (int32_t id : *p.allowed_token_ids) SPARROW_CHECK(id >= 0, "allowed_token_ids must be >= 0, got ", id);
  }
}

void penalty_adjustments(int32_t row, const SamplingParams& p, std::span<const int32_t> prompt,
                         std::span<const int32_t> output, std::span<const int32_t> masked,
                         std::vector<LogitAdjustment>& adjustments) {
  std::map<int32_t, LogitAdjustment> by_token;  // ordered: the same adjustments in the same order each time
  auto at = [&](int32_t id) -> LogitAdjustment& {
    LogitAdjustment& a = by_token[id];
    a.row = row;
    a.token = id;
    return a;
  };
  if (p.repetition_penalty != 1) {
    for (int32_t id : prompt) at(id).divide_positive = p.repetition_penalty;
    for (int32_t id : output) at(id).divide_positive = p.repetition_penalty;
  }
  if (p.frequency_penalty != 0 || p.presence_penalty != 0) {
    std::unordered_map<int32_t, int64_t> counts;
    for (int32_t id : output) ++counts[id];
    for (auto [id, count] : counts) at(id).subtract = p.frequency_penalty * float(count) + p.presence_penalty;
  }
  for (auto [id, bias] : p.logit_bias) at(id).bias += bias;
  for (int32_t id : masked) at(id).mask = 1;
  for (const auto& [id, a] : by_token) adjustments.push_back(a);
}

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                     std::span<const int32_t> output) {
  std::vector<LogitAdjustment> adjustments;
  penalty_adjustments(0, p, prompt, output, {}, adjustments);
  cpu::adjust_logits(logits.data(), int64_t(logits.size()), 0, adjustments);
}

int32_t argmax(std::span<const float> logits) {
  return cpu::top_k(logits.data(), int64_t(logits.size()), 1)[0];
}

namespace {
uint64_t seed_stream(const std::optional<uint64_t>& seed) {
  if (seed) return mix64(*seed);
  std::random_device device;
  return (uint64_t(device()) << 32) ^ device();
}
}  // namespace

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> end_tokens)
    : params_(params), end_tokens_(std::move(end_tokens)), stream_(seed_stream(params.seed)) {
  validate(params);
}

void Sampler::prepare(int32_t row, std::span<const int32_t> prompt, std::span<const int32_t> output,
                      std::vector<TokenDraw>& draws, std::vector<LogitAdjustment>& adjustments) {
  prepare_at(output.size(), row, prompt, output, draws, adjustments);
}

void Sampler::prepare_at(uint64_t key_index, int32_t row, std::span<const int32_t> prompt,
                         std::span<const int32_t> output, std::vector<TokenDraw>& draws,
                         std::vector<LogitAdjustment>& adjustments) const {
  TokenDraw draw;
  draw.temperature = params_.temperature;
  draw.top_p = params_.top_p;
  draw.min_p = params_.min_p;
  draw.top_k = int32_t(std::min<int64_t>(params_.top_k, INT32_MAX));
  draw.key = key_at(key_index);  // also when greedy: a sequence's keys do not depend on its params
  draws.push_back(draw);
  const bool penalised = params_.repetition_penalty != 1 || params_.frequency_penalty != 0 ||
                         params_.presence_penalty != 0;
  const bool masked = int64_t(output.size()) < params_.min_tokens && !end_tokens_.empty();
  if (penalised || masked || !params_.logit_bias.empty())
    penalty_adjustments(row, params_, penalised ? prompt : std::span<const int32_t>{},
                        penalised ? output : std::span<const int32_t>{},
                        masked ? std::span<const int32_t>(end_tokens_) : std::span<const int32_t>{}, adjustments);
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> prompt,
                        std::span<const int32_t> output) {
  std::vector<TokenDraw> draws;
  std::vector<LogitAdjustment> adjustments;
  prepare_at(calls_++, 0, prompt, output, draws, adjustments);
  if (adjustments.empty()) return cpu::draw_token(logits.data(), int64_t(logits.size()), draws[0]);
  std::vector<float> adjusted(logits.begin(), logits.end());
  cpu::adjust_logits(adjusted.data(), int64_t(adjusted.size()), 0, adjustments);
  return cpu::draw_token(adjusted.data(), int64_t(adjusted.size()), draws[0]);
}

}  // namespace sparrow
