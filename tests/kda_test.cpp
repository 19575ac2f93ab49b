// Kimi Delta Attention: the chunked (prefill) and recurrent (decode) forms of the delta rule agree,
// a prefill may continue a saved state, and the mixer gives the same output however a sequence is
// split into steps or batched with others. Agreement with transformers is in kimi_linear_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/kda_reference.h"
#include "kernels/cpu/reference_ops.h"
#include "model/kda_mixer.h"
#include "runner/dense_sequence_cache.h"

using namespace sparrow;
using sparrow::cpu::delta_rule_chunked;
using sparrow::cpu::delta_rule_recurrent;
using sparrow::cpu::DeltaRuleInputs;

namespace {

// Random delta-rule inputs shaped like the mixer produces them: unit-norm keys, scaled unit-norm
// queries, negative log-decays (strong ones included: the cumulative decay over a 64-token chunk
// reaches exp(-300), where exp(G) * exp(-G) would overflow), beta in (0, 1).
struct RandomRule {
  int64_t T, H, D;
  std::vector<float> q, k, v, g, beta;

  RandomRule(int64_t T_, int64_t H_, int64_t D_, uint32_t seed) : T(T_), H(H_), D(D_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    q.resize(T * H * D), k.resize(T * H * D), v.resize(T * H * D), g.resize(T * H * D), beta.resize(T * H);
    for (float& x : v) x = normal(rng);
    for (float& x : g) x = uniform(rng) < 0.1f ? -5.0f * uniform(rng) : -0.2f * uniform(rng);
    for (float& x : beta) x = uniform(rng);
    for (std::vector<float>* m : {&q, &k}) {
      for (float& x : *m) x = normal(rng);
      for (int64_t r = 0; r < T * H; ++r) {
        float* x = m->data() + r * D;
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) sum += x[d] * x[d];
        const float scale = (m == &q ? 1.0f / std::sqrt(float(D)) : 1.0f) / std::sqrt(sum);
        for (int64_t d = 0; d < D; ++d) x[d] *= scale;
      }
    }
  }

  // Tokens [begin, end).
  DeltaRuleInputs slice(int64_t begin, int64_t end) const {
    DeltaRuleInputs in;
    in.length = end - begin;
    in.num_heads = H;
    in.head_dim = D;
    in.q = q.data() + begin * H * D;
    in.k = k.data() + begin * H * D;
    in.v = v.data() + begin * H * D;
    in.log_decay = g.data() + begin * H * D;
    in.beta = beta.data() + begin * H;
    return in;
  }
};

std::vector<float> random_state(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> s(n);
  for (float& x : s) x = normal(rng);
  return s;
}

// max |a - b| / max(1, max |b|)
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, scale = 1.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, double(std::abs(a[i] - b[i])));
    scale = std::max(scale, double(std::abs(b[i])));
  }
  return diff / scale;
}

}  // namespace

TEST(KdaDeltaRule, RecurrentMatchesHandComputedSteps) {
  // One head, D = 2, no decay, beta = 1: S1 = k1 v1^T, o1 = (q1·k1) v1; then
  // S2 = S1 + k2 (v2 - S1^T k2)^T with k2 ⟂ k1, so o2 = (q2·k1) v1 + (q2·k2) v2.
  const float q[] = {0.6f, 0.8f, 1.0f, 0.0f}, k[] = {1, 0, 0, 1}, v[] = {2, 3, -1, 4}, g[] = {0, 0, 0, 0};
  const float beta[] = {1, 1};
  DeltaRuleInputs in{2, 1, 2, q, k, v, g, beta};
  std::vector<float> state(4, 0.0f), out(4);
  delta_rule_recurrent(in, state.data(), out.data());
  EXPECT_FLOAT_EQ(out[0], 0.6f * 2);
  EXPECT_FLOAT_EQ(out[1], 0.6f * 3);
  EXPECT_FLOAT_EQ(out[2], 1.0f * 2);
  EXPECT_FLOAT_EQ(out[3], 1.0f * 3);
  EXPECT_EQ(state, (std::vector<float>{2, 3, -1, 4}));

  // Decay exp(g) scales the state's key rows before the new token is read in.
  const float g2[] = {std::log(0.5f), 0.0f};
  DeltaRuleInputs step{1, 1, 2, q, k + 2, v + 2, g2, beta};
  std::vector<float> decayed = {2, 3, -1, 4}, o(2);
  delta_rule_recurrent(step, decayed.data(), o.data());
  // S = [[1, 1.5], [-1, 4]] after decay; k = (0, 1) reads (-1, 4) = v, so the update is zero.
  EXPECT_NEAR(o[0], 0.6f * 1.0f + 0.8f * -1.0f, 1e-6);
  EXPECT_NEAR(o[1], 0.6f * 1.5f + 0.8f * 4.0f, 1e-6);
}

TEST(KdaDeltaRule, ChunkedMatchesRecurrent) {
  const int64_t H = 3, D = 16;
  for (int64_t T : {1, 2, 5, 63, 64, 65, 130, 200}) {
    RandomRule rule(T, H, D, uint32_t(T));
    const std::vector<float> start = random_state(H * D * D, 7);
    std::vector<float> s_rec = start, s_chunk = start, o_rec(T * H * D), o_chunk(T * H * D);
    delta_rule_recurrent(rule.slice(0, T), s_rec.data(), o_rec.data());
    delta_rule_chunked(rule.slice(0, T), s_chunk.data(), o_chunk.data());
    EXPECT_LT(max_rel_diff(o_chunk, o_rec), 1e-5) << "T = " << T;
    EXPECT_LT(max_rel_diff(s_chunk, s_rec), 1e-5) << "T = " << T;
  }
}

TEST(KdaDeltaRule, ChunkSizeDoesNotChangeTheResult) {
  const int64_t T = 150, H = 2, D = 8;
  RandomRule rule(T, H, D, 3);
  std::vector<float> s64(H * D * D, 0.0f), s7(H * D * D, 0.0f), o64(T * H * D), o7(T * H * D);
  delta_rule_chunked(rule.slice(0, T), s64.data(), o64.data(), 64);
  delta_rule_chunked(rule.slice(0, T), s7.data(), o7.data(), 7);
  EXPECT_LT(max_rel_diff(o7, o64), 1e-5);
  EXPECT_LT(max_rel_diff(s7, s64), 1e-5);
}

TEST(KdaDeltaRule, ChunkedPrefillContinuesASavedState) {
  const int64_t T = 190, H = 2, D = 32;
  RandomRule rule(T, H, D, 11);
  std::vector<float> s_whole(H * D * D, 0.0f), o_whole(T * H * D);
  delta_rule_chunked(rule.slice(0, T), s_whole.data(), o_whole.data());

  // 70 tokens, then 1 (recurrent), then 119 more through the chunked form from the saved state.
  std::vector<float> s_steps(H * D * D, 0.0f), o_steps(T * H * D);
  delta_rule_chunked(rule.slice(0, 70), s_steps.data(), o_steps.data());
  delta_rule_recurrent(rule.slice(70, 71), s_steps.data(), o_steps.data() + 70 * H * D);
  delta_rule_chunked(rule.slice(71, T), s_steps.data(), o_steps.data() + 71 * H * D);
  EXPECT_LT(max_rel_diff(o_steps, o_whole), 1e-5);
  EXPECT_LT(max_rel_diff(s_steps, s_whole), 1e-5);
}

namespace {

Tensor random_tensor(Shape shape, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = normal(rng);
  return t;
}

KdaMixer random_mixer(const KdaConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t P = c.projection_dim();
  KdaWeights w;
  w.qkv_proj = random_tensor({3 * P, c.hidden}, rng, 0.3f);
  w.conv = random_tensor({3 * P, c.conv_kernel}, rng, 0.6f);
  w.f_a_proj = random_tensor({c.head_dim, c.hidden}, rng, 0.3f);
  w.f_b_proj = random_tensor({P, c.head_dim}, rng, 0.3f);
  w.dt_bias = random_tensor({P}, rng, 1.0f);
  w.A_log = random_tensor({c.num_heads}, rng, 0.5f);
  w.b_proj = random_tensor({c.num_heads, c.hidden}, rng, 0.3f);
  w.g_a_proj = random_tensor({c.head_dim, c.hidden}, rng, 0.3f);
  w.g_b_proj = random_tensor({P, c.head_dim}, rng, 0.3f);
  w.o_norm = random_tensor({c.head_dim}, rng, 1.0f);
  w.o_proj = random_tensor({c.hidden, P}, rng, 0.3f);
  return KdaMixer(c, std::move(w));
}

std::vector<float> rows_of(const Tensor& t) { return std::vector<float>(t.data(), t.data() + t.numel()); }

}  // namespace

TEST(KdaMixer, PrefillThenDecodeEqualsOneLongPrefill) {
  const KdaConfig config{24, 2, 8, 4, 1e-5f};
  KdaMixer mixer = random_mixer(config, 5);
  const int64_t T = 140;
  std::mt19937 rng(9);
  const Tensor x = random_tensor({T, config.hidden}, rng, 1.0f);

  // One prefill of all T tokens.
  SequenceState whole = standalone_sequence({mixer.cache_spec()});
  Batch all = make_batch({{&whole, std::vector<int32_t>(T, 0)}});
  const Tensor expected = mixer.forward(x, all, 0);

  // Prefill 2 tokens (shorter than the conv kernel), a chunked prefill of 67 more, then decode.
  SequenceState steps = standalone_sequence({mixer.cache_spec()});
  std::vector<float> got;
  int64_t done = 0;
  for (int64_t count : {int64_t(2), int64_t(67)}) {
    Batch b = make_batch({{&steps, std::vector<int32_t>(count, 0)}});
    const std::vector<float> part = rows_of(mixer.forward(x.rows(done, done + count), b, 0));
    got.insert(got.end(), part.begin(), part.end());
    steps.length += count, done += count;
  }
  for (; done < T; ++done, ++steps.length) {
    Batch b = make_batch({{&steps, {0}}});
    const std::vector<float> part = rows_of(mixer.forward(x.rows(done, done + 1), b, 0));
    got.insert(got.end(), part.begin(), part.end());
  }
  EXPECT_LT(max_rel_diff(got, rows_of(expected)), 1e-5);
  auto state_of = [&](SequenceState& s, StateKind kind) {
    const float* p = s.cache->state(0, kind);
    return std::vector<float>(p, p + mixer.cache_spec().state(kind)->size);
  };
  EXPECT_LT(max_rel_diff(state_of(steps, StateKind::Recurrent), state_of(whole, StateKind::Recurrent)), 1e-5);
  // The conv tail holds the last tokens' q/k/v projections, which come out of BLAS products of 140 rows
  // in one case and of 2, 67 and 1 rows in the other: equal up to the product kernel's rounding, which
  // depends on the row count for some OpenBLAS kernels (Haswell, Zen) and not others (SkylakeX). A wrong
  // tail (another token's projections) differs by O(1), far past this bound.
  EXPECT_LT(max_rel_diff(state_of(steps, StateKind::ConvTail), state_of(whole, StateKind::ConvTail)), 1e-5);
}

TEST(KdaMixer, SequencesInOneBatchDoNotInteract) {
  const KdaConfig config{16, 2, 8, 3, 1e-5f};
  KdaMixer mixer = random_mixer(config, 21);
  std::mt19937 rng(4);
  const Tensor xa = random_tensor({70, config.hidden}, rng, 1.0f);
  const Tensor xb = random_tensor({1, config.hidden}, rng, 1.0f);

  auto alone = [&](const Tensor& x) {
    SequenceState s = standalone_sequence({mixer.cache_spec()});
    return rows_of(mixer.forward(x, make_batch({{&s, std::vector<int32_t>(x.dim(0), 0)}}), 0));
  };
  SequenceState a = standalone_sequence({mixer.cache_spec()}), b = standalone_sequence({mixer.cache_spec()});
  Tensor x = Tensor::empty({71, config.hidden});
  std::copy(xa.data(), xa.data() + xa.numel(), x.data());
  std::copy(xb.data(), xb.data() + xb.numel(), x.row(70));
  const std::vector<float> both =
      rows_of(mixer.forward(x, make_batch({{&a, std::vector<int32_t>(70, 0)}, {&b, {0}}}), 0));
  const std::vector<float> expect_a = alone(xa), expect_b = alone(xb);
  EXPECT_LT(max_rel_diff(std::vector<float>(both.begin(), both.begin() + 70 * config.hidden), expect_a), 1e-6);
  EXPECT_LT(max_rel_diff(std::vector<float>(both.begin() + 70 * config.hidden, both.end()), expect_b), 1e-6);
}
