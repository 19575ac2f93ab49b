#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "kernels/cpu/reference_ops.h"
#include "kernels/uniform_routing.h"
#include "model/feed_forward.h"

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
std::vector<int32_t> ints(const Tensor& t) { return std::vector<int32_t>(t.as<int32_t>(), t.as<int32_t>() + t.numel()); }
std::vector<float> floats(const Tensor& t) { return std::vector<float>(t.as<float>(), t.as<float>() + t.numel()); }
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
  ops::Routing out = r.route(x);
  ASSERT_EQ(ints(out.experts), (std::vector<int32_t>{0, 1}));
  float s0 = sig(1.0f), s1 = sig(0.9f);
  EXPECT_NEAR(floats(out.weights)[0], s0 / (s0 + s1) * 2.5f, 1e-6);
  EXPECT_NEAR(floats(out.weights)[1], s1 / (s0 + s1) * 2.5f, 1e-6);
}

TEST(MoeRouter, BiasChoosesButDoesNotWeigh) {
  SigmoidRouter r;
  r.weight = identity(3);
  r.bias = vec({0.0f, 0.0f, 10.0f});
  r.top_k = 1;
  r.normalize = false;
  Tensor x = vec({2.0f, 1.0f, -1.0f}).reshape({1, 3});
  ops::Routing out = r.route(x);
  ASSERT_EQ(ints(out.experts), (std::vector<int32_t>{2}));
  EXPECT_NEAR(floats(out.weights)[0], sig(-1.0f), 1e-6);
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
  ops::Routing routing{Tensor::empty({1, 2}, ScalarType::I32), Tensor::empty({1, 2}, ScalarType::F32)};
  routing.experts.as<int32_t>()[0] = 1, routing.experts.as<int32_t>()[1] = 0;
  routing.weights.as<float>()[0] = 0.25f, routing.weights.as<float>()[1] = 0.75f;
  Tensor x = vec({0.5f, -2.0f}).reshape({1, 2});
  Tensor y = ops::moe_experts(x, routing, ex.gate_up, ex.down, Glu::SiluGlu, 1.0f, 0.0f);
  float h0 = cpu::silu(0.5f) * -2.0f, h1 = cpu::silu(-2.0f) * (0.5f - 2.0f);
  EXPECT_NEAR(y.data()[0], 0.75f * h0 * 1 + 0.25f * h1 * 2, 1e-6);
  EXPECT_NEAR(y.data()[1], 0.75f * h0 * -1 + 0.25f * h1 * 0.5f, 1e-6);
}

TEST(MoeActivation, ClampedSwiglu) {
  float gate[2] = {10.0f, -1.0f}, up[2] = {-9.0f, 0.5f}, out[2];
  cpu::glu(Glu::ClampedSwiglu, gate, up, out, 2, 1.702f, 7.0f);
  EXPECT_NEAR(out[0], (-7.0f + 1.0f) * 7.0f * sig(7.0f * 1.702f), 1e-5);
  EXPECT_NEAR(out[1], (0.5f + 1.0f) * -1.0f * sig(-1.702f), 1e-6);
}

// Kimi K3's SiTU (vLLM 0.33 SituAndMul.forward_native): beta tanh(g / beta) sigmoid(g) lambda tanh(u / lambda),
// and u itself without a linear bound.
TEST(MoeActivation, Situ) {
  float gate[3] = {10.0f, -1.0f, 0.25f}, up[3] = {-30.0f, 0.5f, 2.0f}, out[3];
  cpu::glu(Glu::Situ, gate, up, out, 3, 4.0f, 25.0f);
  EXPECT_NEAR(out[0], 4.0 * std::tanh(2.5) * sig(10.0f) * 25.0 * std::tanh(-1.2), 1e-4);
  EXPECT_NEAR(out[1], 4.0 * std::tanh(-0.25) * sig(-1.0f) * 25.0 * std::tanh(0.02), 1e-6);
  cpu::glu(Glu::Situ, gate, up, out, 3, 1.0f, 0.0f);
  EXPECT_NEAR(out[2], std::tanh(0.25) * sig(0.25f) * 2.0, 1e-6);
}

// The simulated routing of benchmarks (kernels/uniform_routing.h): distinct experts in range, each expert
// drawn equally often, and a batch touching E (1 - (1 - k/E)^B) experts as the roofline assumes.
TEST(UniformRouting, DrawsDistinctExpertsUniformly) {
  struct Case { int64_t experts, top_k, batch; };
  for (const Case& c : {Case{128, 4, 16}, Case{256, 8, 16}, Case{256, 8, 64}, Case{8, 8, 4}}) {
    SCOPED_TRACE(testing::Message() << c.experts << " experts, top " << c.top_k << ", batch " << c.batch);
    std::vector<int64_t> hits(c.experts, 0);
    double distinct_sum = 0;
    const int batches = 400;
    uint64_t key = 1;
    for (int b = 0; b < batches; ++b) {
      std::set<int32_t> touched;
      for (int64_t t = 0; t < c.batch; ++t) {
        std::vector<int32_t> chosen(c.top_k);
        uniform_routing::draw_experts(uniform_routing::mix64(key++), c.experts, c.top_k, chosen.data());
        std::set<int32_t> mine(chosen.begin(), chosen.end());
        ASSERT_EQ(int64_t(mine.size()), c.top_k) << "a token got the same expert twice";
        for (int32_t e : chosen) {
          ASSERT_GE(e, 0);
          ASSERT_LT(e, c.experts);
          ++hits[e];
          touched.insert(e);
        }
      }
      distinct_sum += double(touched.size());
    }
    const double expected = c.experts * (1 - std::pow(1 - double(c.top_k) / c.experts, c.batch));
    EXPECT_NEAR(distinct_sum / batches, expected, 0.02 * expected);
    const double mean_hits = double(batches * c.batch * c.top_k) / c.experts;
    for (int64_t e = 0; e < c.experts; ++e) EXPECT_NEAR(double(hits[e]), mean_hits, 0.25 * mean_hits) << "expert " << e;
  }
}

// --moe-routing-simulation uniform_random on the CPU router: a router whose bias sends every token to the
// same experts (as vLLM's dummy weights do, bench/peers/vllm/dummy_routing.py) spreads them instead; the
// draw is keyed by the token's bf16 hidden state and the layer's salt, so it repeats, does not depend on
// the batch, and differs between layers.
TEST(MoeRouter, SimulatedUniformRoutingReplacesTheChoice) {
  const int64_t hidden = 96, experts = 128, tokens = 64;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  SigmoidRouter r;
  r.weight = Tensor::empty({experts, hidden});
  for (int64_t i = 0; i < r.weight.numel(); ++i) r.weight.data()[i] = 1e-3f * u(rng);
  r.bias = Tensor::zeros({experts});
  for (int64_t e = 0; e < 4; ++e) r.bias.data()[e] = 1.0f;  // experts 0-3 win every token
  r.top_k = 4;
  r.routed_scaling_factor = 2.0f;
  Tensor x = Tensor::empty({tokens, hidden});
  for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = u(rng);

  const std::vector<int32_t> own = ints(r.route(x).experts);
  EXPECT_EQ(std::set<int32_t>(own.begin(), own.end()), (std::set<int32_t>{0, 1, 2, 3}));

  r.simulate_uniform = true;
  r.simulation_salt = 5;
  const ops::Routing sim_routing = r.route(x);
  const std::vector<int32_t> sim = ints(sim_routing.experts);
  const std::set<int32_t> touched(sim.begin(), sim.end());
  EXPECT_GT(int64_t(touched.size()), 80);  // uniform: 111 expected of 128 for 64 tokens x 4; the bias: 4
  for (float w : floats(sim_routing.weights)) EXPECT_FLOAT_EQ(w, 2.0f / 4);
  EXPECT_EQ(ints(r.route(x).experts), sim);  // the same tokens, the same experts
  // One token alone gets what it got in the batch.
  const std::vector<int32_t> third = ints(r.route(Tensor::view(x.row(3), {1, hidden})).experts);
  EXPECT_EQ(third, std::vector<int32_t>(sim.begin() + 12, sim.begin() + 16));
  r.simulation_salt = 6;  // another layer
  EXPECT_NE(ints(r.route(x).experts), sim);
}
