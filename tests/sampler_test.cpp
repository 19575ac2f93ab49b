#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "core/error.h"
#include "engine/sampler.h"

using namespace sparrow;

TEST(Sampler, GreedyTakesArgmaxWithSmallerIdOnTies) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  std::vector<float> logits = {0.1f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.sample(logits.data(), 4), 1);
}

TEST(Sampler, SameSeedSameDraws) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  std::vector<float> logits = {0.0f, 0.1f, 0.2f, 0.3f, 0.4f};
  Sampler a(p), b(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits.data(), 5), b.sample(logits.data(), 5));
}

TEST(Sampler, TopKAndTopPRestrictTheCandidates) {
  std::vector<float> logits = {5.0f, 4.9f, 0.0f, -1.0f, 4.8f};
  SamplingParams p;
  p.seed = 7;
  p.top_k = 2;
  Sampler k2(p);
  for (int i = 0; i < 200; ++i) {
    int32_t t = k2.sample(logits.data(), 5);
    EXPECT_TRUE(t == 0 || t == 1) << t;
  }
  p.top_k = 0;
  p.top_p = 0.01f;  // only the single most likely token reaches the mass
  Sampler p1(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(p1.sample(logits.data(), 5), 0);
}

TEST(Sampler, DrawsFollowTheDistribution) {
  std::vector<float> logits = {0.0f, std::log(3.0f)};  // probabilities 1/4, 3/4
  SamplingParams p;
  p.seed = 1;
  Sampler s(p);
  int ones = 0;
  for (int i = 0; i < 4000; ++i) ones += s.sample(logits.data(), 2);
  EXPECT_NEAR(ones / 4000.0, 0.75, 0.03);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THROW(validate(p), Error);
  p.temperature = 1;
  p.top_p = 0;
  EXPECT_THROW(validate(p), Error);
  p.top_p = 1;
  p.top_k = -5;
  EXPECT_THROW(validate(p), Error);
}
