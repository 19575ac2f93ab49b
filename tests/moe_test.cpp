#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/ops.h"
#include "model/moe.h"

using namespace sparrow;

namespace {
Tensor identity(int64_t n) {
  Tensor t = Tensor::zeros({n, n});
  for (int64_t i = 0; i < n; ++i) t.row(i)[i] = 1.0f;
  return t;
}
Tensor vec(std::vector<float> v) {
  Tensor t = Tensor::empty({int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.data());
  return t;
}
float sig(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

TEST(MoeRouter, GroupedSigmoidRoutingPicksTheBestGroupAndRenormalises) {
  SigmoidRouter r;
  r.weight = identity(4);  // logits = x
  r.bias = vec({0, 0, 0, 0});
  r.top_k = 2;
  r.n_group = 2;
  r.topk_group = 1;
  r.routed_scaling_factor = 2.5f;
  // Expert 2 alone is the best, but group {0, 1} has the larger sum of its two best scores.
  Tensor x = vec({1.0f, 0.9f, 1.5f, -3.0f}).reshape({1, 4});
  Routing out = r.route(x);
  ASSERT_EQ(out.experts, (std::vector<int32_t>{0, 1}));
  float s0 = sig(1.0f), s1 = sig(0.9f);
  EXPECT_NEAR(out.weights[0], s0 / (s0 + s1) * 2.5f, 1e-6);
  EXPECT_NEAR(out.weights[1], s1 / (s0 + s1) * 2.5f, 1e-6);
}

TEST(MoeRouter, BiasChoosesButDoesNotWeigh) {
  SigmoidRouter r;
  r.weight = identity(3);
  r.bias = vec({0.0f, 0.0f, 10.0f});
  r.top_k = 1;
  r.normalize = false;
  Tensor x = vec({2.0f, 1.0f, -1.0f}).reshape({1, 3});
  Routing out = r.route(x);
  ASSERT_EQ(out.experts, (std::vector<int32_t>{2}));
  EXPECT_NEAR(out.weights[0], sig(-1.0f), 1e-6);
}

TEST(MoeExperts, WeightedSumOfExpertMlps) {
  // Two experts, hidden 2, intermediate 1: expert e computes down_e * silu(gate_e·x) * (up_e·x).
  Checkpoint::Experts ex;
  ex.gate_up = Tensor::empty({2, 2, 2});
  ex.down = Tensor::empty({2, 2, 1});
  float gu[8] = {1, 0, 0, 1, /*expert 1*/ 0, 1, 1, 1};
  float dn[4] = {1, -1, 2, 0.5f};
  std::copy(gu, gu + 8, ex.gate_up.data());
  std::copy(dn, dn + 4, ex.down.data());
  Routing routing;
  routing.top_k = 2;
  routing.experts = {1, 0};
  routing.weights = {0.25f, 0.75f};
  Tensor x = vec({0.5f, -2.0f}).reshape({1, 2});
  Tensor y = run_experts(x, routing, ex, Activation{});
  float h0 = cpu::silu(0.5f) * -2.0f, h1 = cpu::silu(-2.0f) * (0.5f - 2.0f);
  EXPECT_NEAR(y.data()[0], 0.75f * h0 * 1 + 0.25f * h1 * 2, 1e-6);
  EXPECT_NEAR(y.data()[1], 0.75f * h0 * -1 + 0.25f * h1 * 0.5f, 1e-6);
}

TEST(MoeActivation, ClampedSwiglu) {
  Activation a{Activation::ClampedSwiglu, 1.702f, 7.0f};
  float gate[2] = {10.0f, -1.0f}, up[2] = {-9.0f, 0.5f}, out[2];
  a.apply(gate, up, out, 2);
  EXPECT_NEAR(out[0], (-7.0f + 1.0f) * 7.0f * sig(7.0f * 1.702f), 1e-5);
  EXPECT_NEAR(out[1], (0.5f + 1.0f) * -1.0f * sig(-1.702f), 1e-6);
}
