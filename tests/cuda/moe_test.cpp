// The GPU mixture of experts against the CPU model code: route_grouped_sigmoid against
// SigmoidRouter::route (the router's weight set to the identity so the logits pass through unchanged),
// moe_experts against run_experts on bf16-representable weights.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/tensor.h"
#include "kernels/cuda/moe/moe.h"
#include "kernels/cuda/runtime/device.h"
#include "model/moe.h"
#include "gpu_test_util.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using test::DeviceBuffer;

TEST(CudaMoe, RouteMatchesSigmoidRouter) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t experts, n_group, topk_group, top_k;
    bool normalize;
    float eps, scaling;
  };
  const Case cases[] = {
      {256, 8, 4, 8, true, 1e-20f, 2.5f},    // DeepSeek-V3.2
      {384, 1, 1, 8, true, 1e-20f, 2.827f},  // Kimi K2-style, one group
      {64, 1, 1, 6, true, 0.0f, 1.0f},       // MiniMax: no epsilon
      {16, 4, 2, 4, false, 1e-20f, 1.0f},
      {32, 32, 3, 3, true, 1e-20f, 1.0f},    // one expert per group
      {8, 2, 1, 6, true, 1e-20f, 1.0f},      // top_k larger than the kept group: -inf entries chosen
  };
  for (const Case& c : cases)
    for (bool coarse : {false, true}) {
      SCOPED_TRACE(testing::Message() << "experts=" << c.experts << " groups=" << c.n_group << "/" << c.topk_group
                                      << " top_k=" << c.top_k << (coarse ? " coarse (ties)" : ""));
      const int64_t tokens = 37;
      std::vector<float> logits = test::random_vector(rng, tokens * c.experts, -4, 4);
      std::vector<float> bias = test::random_vector(rng, c.experts, -0.5f, 0.5f);
      if (coarse) {  // few distinct values: many exact ties in scores, choices and group sums
        for (float& v : logits) v = std::round(v * 2) / 2;
        for (float& v : bias) v = std::round(v * 4) / 4;
      }
      SigmoidRouter router;
      router.weight = Tensor::zeros({c.experts, c.experts});
      for (int64_t e = 0; e < c.experts; ++e) router.weight.row(e)[e] = 1.0f;
      router.bias = Tensor::view(bias.data(), {c.experts});
      router.top_k = c.top_k;
      router.n_group = c.n_group;
      router.topk_group = c.topk_group;
      router.normalize = c.normalize;
      router.normalize_eps = c.eps;
      router.routed_scaling_factor = c.scaling;
      Routing ref = router.route(Tensor::view(logits.data(), {tokens, c.experts}));

      DeviceBuffer dl(logits), db(bias), de(tokens * c.top_k * 4), dw(tokens * c.top_k * 4);
      de.poison();
      dw.poison();
      cuda::route_grouped_sigmoid(dl.get<float>(), db.get<float>(), tokens, c.experts, c.n_group, c.topk_group,
                                  c.top_k, c.normalize, c.eps, c.scaling, de.get<int32_t>(), dw.get<float>(),
                                  cuda::stream());
      std::vector<int32_t> experts = de.download<int32_t>(tokens * c.top_k);
      std::vector<float> weights = dw.download<float>(tokens * c.top_k);
      EXPECT_EQ(experts, ref.experts);
      EXPECT_TRUE(test::all_close(weights, ref.weights, 1e-6, 0));
    }
  // The form without an explicit epsilon uses DeepSeek's 1e-20.
  {
    const int64_t tokens = 3, e = 16;
    std::vector<float> logits = test::random_vector(rng, tokens * e, -4, 4), bias(e, 0.0f);
    DeviceBuffer dl(logits), db(bias), de(tokens * 2 * 4), dw(tokens * 2 * 4), de2(tokens * 2 * 4),
        dw2(tokens * 2 * 4);
    cuda::route_grouped_sigmoid(dl.get<float>(), db.get<float>(), tokens, e, 4, 2, 2, true, 1.5f, de.get<int32_t>(),
                                dw.get<float>(), cuda::stream());
    cuda::route_grouped_sigmoid(dl.get<float>(), db.get<float>(), tokens, e, 4, 2, 2, true, 1e-20f, 1.5f,
                                de2.get<int32_t>(), dw2.get<float>(), cuda::stream());
    EXPECT_EQ(de.download<int32_t>(tokens * 2), de2.download<int32_t>(tokens * 2));
    EXPECT_EQ(dw.download<float>(tokens * 2), dw2.download<float>(tokens * 2));
  }
}

TEST(CudaMoe, ExpertsMatchRunExperts) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t tokens, hidden, inter, experts, top_k;
  };
  const Case cases[] = {
      {1, 256, 128, 8, 2},    {5, 128, 64, 16, 4},   {200, 256, 128, 4, 2},  // > 64 rows per expert
      {64, 200, 72, 8, 3},    // hidden and intermediate not multiples of the 64-wide tiles
      {300, 512, 256, 32, 8}, {3, 64, 64, 64, 8},    // most experts unused
  };
  for (const Case& c : cases)
    for (auto kind : {cuda::GluKind::SiluGlu, cuda::GluKind::ClampedSwiglu}) {
      SCOPED_TRACE(testing::Message() << "tokens=" << c.tokens << " hidden=" << c.hidden << " inter=" << c.inter
                                      << " experts=" << c.experts << " top_k=" << c.top_k << " kind=" << int(kind));
      auto rounded = [&](int64_t n, float scale) {
        std::vector<float> v = test::random_vector(rng, n, -scale, scale);
        for (float& x : v) x = test::round_bf16(x);
        return v;
      };
      std::vector<float> x = rounded(c.tokens * c.hidden, 1.0f);
      std::vector<float> gate_up = rounded(c.experts * 2 * c.inter * c.hidden, 2.0f / std::sqrt(float(c.hidden)));
      std::vector<float> down = rounded(c.experts * c.hidden * c.inter, 2.0f / std::sqrt(float(c.inter)));
      Routing routing;
      routing.top_k = c.top_k;
      std::vector<int32_t> perm(c.experts);
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t t = 0; t < c.tokens; ++t) {
        std::shuffle(perm.begin(), perm.end(), rng);  // distinct experts per token, as a router gives
        for (int64_t j = 0; j < c.top_k; ++j) {
          routing.experts.push_back(perm[j]);
          routing.weights.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
        }
      }
      Activation act;
      act.kind = kind == cuda::GluKind::SiluGlu ? Activation::SiluGlu : Activation::ClampedSwiglu;
      act.alpha = 1.702f;
      act.limit = 7.0f;
      Checkpoint::Experts ex{Tensor::view(gate_up.data(), {c.experts, 2 * c.inter, c.hidden}),
                             Tensor::view(down.data(), {c.experts, c.hidden, c.inter})};
      Tensor ref = run_experts(Tensor::view(x.data(), {c.tokens, c.hidden}), routing, ex, act);

      DeviceBuffer dx(test::to_bf16(x)), dgu(test::to_bf16(gate_up)), dd(test::to_bf16(down)),
          de(routing.experts), dw(routing.weights), out(c.tokens * c.hidden * 2),
          ws(cuda::moe_workspace_bytes(c.tokens, c.top_k, c.experts, c.hidden, c.inter));
      out.poison();
      ws.poison();
      cuda::moe_experts(dx.get(), c.tokens, c.hidden, de.get<int32_t>(), dw.get<float>(), c.top_k, dgu.get(),
                        dd.get(), c.experts, c.inter, kind, act.alpha, act.limit, out.get(), ws.get(),
                        cuda::stream());
      std::vector<float> got = test::from_bf16(out.download<uint16_t>(c.tokens * c.hidden));
      std::vector<float> r(ref.data(), ref.data() + ref.numel());
      // bf16 intermediate (h) and per-slot outputs, one final bf16 rounding: ~1e-3 relative in norm.
      const double rel = test::rel_error(got, r);
      EXPECT_LT(rel, 1e-2);
      double max_ref = 0;
      for (float v : r) max_ref = std::max(max_ref, double(std::fabs(v)));
      EXPECT_TRUE(test::all_close(got, r, 2e-2, 2e-2 * max_ref));
      // Deterministic: a second run gives the same bits.
      cuda::moe_experts(dx.get(), c.tokens, c.hidden, de.get<int32_t>(), dw.get<float>(), c.top_k, dgu.get(),
                        dd.get(), c.experts, c.inter, kind, act.alpha, act.limit, out.get(), ws.get(),
                        cuda::stream());
      EXPECT_EQ(test::from_bf16(out.download<uint16_t>(c.tokens * c.hidden)), got);
    }
}

}  // namespace
}  // namespace sparrow
