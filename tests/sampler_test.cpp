#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"
#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "kernels/cpu/reference_sampling.h"
#include "kernels/ops.h"
#include "test_util.h"

using namespace sparrow;

namespace {

// How often each token is drawn in `draws` samples of `logits`.
std::map<int32_t, int> histogram(Sampler& sampler, const std::vector<float>& logits, int draws) {
  std::map<int32_t, int> counts;
  for (int i = 0; i < draws; ++i) ++counts[sampler.sample(logits)];
  return counts;
}

SamplingParams seeded(uint64_t seed) {
  SamplingParams p;
  p.seed = seed;
  return p;
}

}  // namespace

TEST(Sampler, GreedyTakesArgmaxWithSmallerIdOnTies) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  std::vector<float> logits = {0.1f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.sample(logits), 1);
}

TEST(Sampler, SameSeedSameDraws) {
  SamplingParams p = seeded(42);
  std::vector<float> logits = {0.0f, 0.1f, 0.2f, 0.3f, 0.4f};
  Sampler a(p), b(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Sampler, TopKAndTopPRestrictTheCandidates) {
  std::vector<float> logits = {5.0f, 4.9f, 0.0f, -1.0f, 4.8f};
  SamplingParams p = seeded(7);
  p.top_k = 2;
  Sampler k2(p);
  auto counts = histogram(k2, logits, 200);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts[0], 0);
  EXPECT_GT(counts[1], 0);
  p.top_k = 0;
  p.top_p = 0.01f;  // only the single most likely token reaches the mass
  Sampler p1(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(p1.sample(logits), 0);
}

TEST(Sampler, TopPKeepsTheFirstTokensThatReachTheMass) {
  // Probabilities 0.5, 0.3, 0.2: the first two reach 0.7, so the third is never drawn.
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p = seeded(3);
  p.top_p = 0.7f;
  Sampler s(p);
  auto counts = histogram(s, logits, 4000);
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_NEAR(counts[0] / 4000.0, 0.5 / 0.8, 0.03);
}

TEST(Sampler, MinPDropsTokensBelowAFractionOfTheTopProbability) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p = seeded(11);
  p.min_p = 0.25f;  // threshold 0.125: token 3 (0.05) goes, token 2 (0.15) stays
  Sampler quarter(p);
  auto counts = histogram(quarter, logits, 4000);
  EXPECT_EQ(counts.count(3), 0u);
  EXPECT_NEAR(counts[2] / 4000.0, 0.15 / 0.95, 0.03);
  p.min_p = 0.35f;  // threshold 0.175: only tokens 0 and 1
  Sampler third(p);
  counts = histogram(third, logits, 4000);
  EXPECT_EQ(counts.count(2) + counts.count(3), 0u);
  EXPECT_NEAR(counts[1] / 4000.0, 0.3 / 0.8, 0.03);
}

TEST(Sampler, DrawsFollowTheDistribution) {
  std::vector<float> logits = {0.0f, std::log(3.0f)};  // probabilities 1/4, 3/4
  SamplingParams p = seeded(1);
  Sampler s(p);
  EXPECT_NEAR(histogram(s, logits, 4000)[1] / 4000.0, 0.75, 0.03);
}

TEST(Sampler, TemperatureFlattensTheDistribution) {
  std::vector<float> logits = {0.0f, std::log(9.0f)};  // at temperature 2: 1 : 3
  SamplingParams p = seeded(5);
  p.temperature = 2.0f;
  Sampler s(p);
  EXPECT_NEAR(histogram(s, logits, 4000)[1] / 4000.0, 0.75, 0.03);
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOfSeenTokens) {
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  std::vector<int32_t> prompt = {0, 0}, output = {1};  // token 0 from the prompt, 1 from the output
  apply_penalties(logits, p, prompt, output);
  EXPECT_EQ(logits, (std::vector<float>{1.0f, -4.0f, 1.0f, 0.5f, 3.0f}));
}

TEST(Sampler, FrequencyAndPresencePenaltiesCountOnlyOutputTokens) {
  std::vector<float> logits = {2.0f, 2.0f, 2.0f, 2.0f};
  SamplingParams p;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  std::vector<int32_t> prompt = {0, 3}, output = {1, 1, 2, 1};
  apply_penalties(logits, p, prompt, output);
  // token 1: 3 times -> 2 - 1.5 - 0.25; token 2: once -> 2 - 0.5 - 0.25; prompt tokens untouched.
  EXPECT_EQ(logits, (std::vector<float>{2.0f, 0.25f, 1.25f, 2.0f}));
}

TEST(Sampler, PenaltiesChangeTheGreedyChoice) {
  std::vector<float> logits = {1.0f, 1.5f};
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  std::vector<int32_t> prompt = {1};
  EXPECT_EQ(s.sample(logits), 1);
  EXPECT_EQ(s.sample(logits, prompt), 0);  // 1.5 / 2 < 1
}

TEST(Sampler, MinTokensMasksTheEndTokens) {
  std::vector<float> logits = {0.0f, 5.0f, 1.0f};  // token 1 is the end token
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 2;
  Sampler s(p, /*end_tokens=*/{1});
  std::vector<int32_t> prompt = {0}, one = {2}, two = {2, 2};
  EXPECT_EQ(s.sample(logits, prompt, one), 2);
  EXPECT_EQ(s.sample(logits, prompt, two), 1);
}

TEST(Sampler, RejectsBadParameters) {
  auto rejected = [](auto change, const std::string& name) {
    SamplingParams p;
    change(p);
    return sparrow::testing::mentions(sparrow::testing::error_message([&] { validate(p); }), {name});
  };
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.temperature = -1; }, "temperature"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.top_p = 0; }, "top_p"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.top_k = -5; }, "top_k"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.min_p = 1.5f; }, "min_p"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.frequency_penalty = -3; }, "frequency_penalty"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.min_tokens = 17; }, "min_tokens"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.logprobs = 21; }, "logprobs"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.prompt_logprobs = -2; }, "prompt_logprobs"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.n = 0; }, "n must"));
  EXPECT_TRUE(rejected([](SamplingParams& p) { p.stop = {""}; }, "stop"));
  SamplingParams fine;
  EXPECT_NO_THROW(validate(fine));
}

TEST(SamplerLogprobs, AreTheLogSoftmaxOfTheRawLogits) {
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f};
  double normaliser = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  TokenLogprob lp = token_logprob(logits, 2, 3);
  EXPECT_EQ(lp.token, 2);
  EXPECT_NEAR(lp.logprob, 2.0 - normaliser, 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // ties to the smaller id
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 2);
  EXPECT_NEAR(lp.top[0].second, 3.0 - normaliser, 1e-6);
  EXPECT_TRUE(token_logprob(logits, 0, 0).top.empty());
  EXPECT_EQ(token_logprob(logits, 0, 10).top.size(), 4u);
}

// The draw is a function of (logits, parameters, key): the same key gives the same token in any batch,
// different keys spread over the distribution, and adjustments apply per row.
TEST(SamplerOps, SameKeySameTokenAloneOrInABatch) {
  const int64_t vocab = 50;
  Tensor logits = Tensor::empty({3, vocab});
  for (int64_t i = 0; i < logits.numel(); ++i) logits.data()[i] = float((i * 37) % 11) * 0.3f;
  std::vector<TokenDraw> draws(3);
  for (int r = 0; r < 3; ++r) draws[r] = TokenDraw{1.0f, 0.9f, 0.0f, 20, 1234567u + uint64_t(r)};
  const std::vector<LogitAdjustment> adjustments = {{1, 5, 1.0f, 0.0f, 1}};
  const std::vector<int32_t> batch = ops::sample_tokens(logits, draws, adjustments);
  for (int r = 0; r < 3; ++r) {
    Tensor row = logits.rows(r, r + 1).clone();
    std::vector<LogitAdjustment> own;
    for (LogitAdjustment a : adjustments)
      if (a.row == r) own.push_back({0, a.token, a.divide_positive, a.subtract, a.mask});
    EXPECT_EQ(ops::sample_tokens(row, {&draws[r], 1}, own)[0], batch[r]) << "row " << r;
  }
  EXPECT_THROW(ops::sample_tokens(logits, {draws.data(), 2}, {}), Error);
  EXPECT_THROW(ops::sample_tokens(logits, draws, std::vector<LogitAdjustment>{{7, 0, 1.0f, 0.0f, 1}}), Error);
}

TEST(SamplerOps, MaskedAndNanTokensAreNeverDrawn) {
  std::vector<float> logits = {5.0f, NAN, 4.9f, 1.0f};
  std::vector<LogitAdjustment> mask = {{0, 0, 1.0f, 0.0f, 1}};
  cpu::adjust_logits(logits.data(), 4, 0, mask);
  for (uint64_t key = 0; key < 300; ++key) {
    const int32_t t = cpu::draw_token(logits.data(), 4, TokenDraw{1.0f, 1.0f, 0.0f, 0, key});
    EXPECT_TRUE(t == 2 || t == 3) << t;
  }
}

TEST(SamplerOps, UniformIsInTheOpenClosedUnitInterval) {
  double lo = 1, hi = 0;
  for (int64_t i = 0; i < 100000; ++i) {
    const double u = uniform_at(99, i);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_GT(lo, 0.0);
  EXPECT_LE(hi, 1.0);
  EXPECT_LT(lo, 1e-4);
  EXPECT_GT(hi, 1 - 1e-4);
}
