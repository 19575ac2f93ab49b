// GPU sampling (kernels/cuda/sampling) against the CPU reference (kernels/cpu/reference_sampling.h): the same
// token for every row of random batches (each row its own temperature / top-k / top-p / min-p / key),
// rows with ties, -inf, NaN, +inf and signed zeros, rows alone and in a batch, adjust_logits bit for
// bit, and the draw's distribution against softmax.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/cpu/reference_sampling.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "kernels/cuda/sampling/sampling.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using test::DeviceBuffer;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

enum class Fill { Normal, Rounded, FewValues, AllEqual, SomeNegInf, SomeNaN, Specials, AllNegInf, AllNaN };
constexpr int kFills = 9;

const char* fill_name(Fill f) {
  static const char* names[] = {"normal", "rounded", "few-values", "all-equal", "some -inf",
                                "some NaN", "specials", "all -inf", "all NaN"};
  return names[int(f)];
}

void fill_row(float* x, int64_t vocab, Fill fill, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, sigma);
  for (int64_t i = 0; i < vocab; ++i) {
    float v = nd(rng);
    switch (fill) {
      case Fill::Normal: break;
      case Fill::Rounded: v = std::round(v); break;  // ties between neighbours in value
      case Fill::FewValues: v = float(rng() % 3) * sigma * 0.5f; break;  // huge ties: the cuts fall inside them
      case Fill::AllEqual: v = 1.25f; break;
      case Fill::SomeNegInf: if (rng() % 8 == 0) v = -kInf; break;
      case Fill::SomeNaN: if (rng() % 64 == 0) v = kNaN; break;
      case Fill::Specials: {
        const int t = int(rng() % 40);
        v = t == 0 ? kNaN : t == 1 ? -kInf : t == 2 ? -0.0f : t == 3 ? 0.0f : t == 4 && rng() % 50 == 0 ? kInf : v;
        break;
      }
      case Fill::AllNegInf: v = -kInf; break;
      case Fill::AllNaN: v = kNaN; break;
    }
    x[i] = v;
  }
}

TokenDraw random_draw(int64_t vocab, std::mt19937_64& rng) {
  static const float temps[] = {0.0f, 1e-6f, 0.3f, 1.0f, 1.7f};
  static const float top_ps[] = {1.0f, 0.95f, 0.5f, 1e-3f};
  static const float min_ps[] = {0.0f, 0.05f, 0.5f};
  const int64_t top_ks[] = {0, 1, 5, 50, 1000, vocab, vocab + 3};
  TokenDraw d;
  d.temperature = temps[rng() % 5];
  d.top_k = int32_t(top_ks[rng() % 7]);
  d.top_p = top_ps[rng() % 4];
  d.min_p = min_ps[rng() % 3];
  d.key = rng();
  return d;
}

std::string describe(const TokenDraw& d) {
  return "temperature " + std::to_string(d.temperature) + " top_k " + std::to_string(d.top_k) + " top_p " +
         std::to_string(d.top_p) + " min_p " + std::to_string(d.min_p) + " key " + std::to_string(d.key);
}

// Draws every row on the GPU (twice: the launch must be deterministic) and compares with cpu::draw_token.
void check_batch(const std::vector<float>& logits, int64_t rows, int64_t vocab, int64_t ld,
                 const std::vector<TokenDraw>& draws, const std::vector<std::string>& what) {
  DeviceBuffer dl(logits), dd(draws), dt(rows * sizeof(int32_t));
  std::vector<int32_t> got;
  for (int rep = 0; rep < 2; ++rep) {
    dt.poison();
    cuda::draw_tokens(dl.get<float>(), rows, vocab, ld, dd.get<TokenDraw>(), dt.get<int32_t>(), cuda::stream());
    std::vector<int32_t> again = dt.download<int32_t>(rows);
    if (rep == 1) ASSERT_EQ(again, got) << "draw_tokens is not deterministic (vocab " << vocab << ")";
    got = std::move(again);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t want = cpu::draw_token(logits.data() + r * ld, vocab, draws[r]);
    EXPECT_EQ(got[r], want) << "vocab " << vocab << " row " << r << " of " << rows << ": " << what[r] << ", "
                            << describe(draws[r]);
  }
  // A row draws the same token alone as in the batch.
  for (int64_t r : {int64_t(0), rows / 2, rows - 1}) {
    dt.poison();
    cuda::draw_tokens(dl.get<float>() + r * ld, 1, vocab, ld, dd.get<TokenDraw>() + r, dt.get<int32_t>(),
                      cuda::stream());
    EXPECT_EQ(dt.download<int32_t>(1)[0], got[r]) << "vocab " << vocab << " row " << r << " alone";
  }
}

TEST(CudaSampling, DrawMatchesCpuOnRandomBatches) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  static const float sigmas[] = {0.5f, 3.0f, 20.0f};
  for (int64_t vocab : {1, 2, 7, 1000, 32000, 151936, 400000}) {
    const int64_t rows = vocab >= 400000 ? 20 : vocab >= 100000 ? 32 : 64;
    const int64_t ld = vocab + int64_t(rng() % 4);  // rows at every alignment mod 16 B
    std::vector<float> logits(rows * ld, 7.0f);    // the padding must be ignored
    std::vector<TokenDraw> draws(rows);
    std::vector<std::string> what(rows);
    for (int64_t r = 0; r < rows; ++r) {
      // Mostly normal rows; the others cover ties, -inf, NaN and the special values.
      const Fill fill = rng() % 2 ? Fill::Normal : Fill(rng() % kFills);
      const float sigma = sigmas[rng() % 3];
      fill_row(logits.data() + r * ld, vocab, fill, sigma, rng);
      draws[r] = random_draw(vocab, rng);
      what[r] = std::string(fill_name(fill)) + " sigma " + std::to_string(sigma);
    }
    check_batch(logits, rows, vocab, ld, draws, what);
  }
}

// Rows aimed at each path of the kernel: sets far larger than its shared-memory buffer (top-p over a
// flat vocabulary, min-p keeping most tokens, a top-k cut inside a tie of a hundred thousand tokens),
// cuts that keep everything, and rows with nothing drawable.
TEST(CudaSampling, DrawMatchesCpuOnLargeSetsAndEdges) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    Fill fill;
    float sigma, temperature, top_p, min_p;
    int32_t top_k;
  };
  const std::vector<Case> cases = {
      {Fill::Normal, 0.5f, 1.0f, 0.95f, 0.0f, 0},        // top-p over most of a flat row
      {Fill::Normal, 0.5f, 1.7f, 0.5f, 0.0f, 0},
      {Fill::Normal, 0.5f, 1.0f, 0.999f, 0.0f, 0},
      {Fill::Normal, 3.0f, 1.0f, 0.9f, 0.0f, 50},        // the usual serving settings
      {Fill::Normal, 0.5f, 1.0f, 1.0f, 0.05f, 0},        // min-p keeping most tokens
      {Fill::Normal, 0.5f, 1.0f, 0.9f, 0.05f, 0},
      {Fill::Normal, 0.5f, 1.0f, 0.9f, 0.05f, 30000},    // top-k beyond the buffer, then min-p, top-p
      {Fill::Normal, 0.5f, 1.0f, 1.0f, 0.0f, 30000},
      {Fill::FewValues, 3.0f, 1.0f, 1.0f, 0.0f, 1000},   // the k-th token inside a huge tie
      {Fill::FewValues, 3.0f, 1.0f, 0.5f, 0.0f, 0},      // the top-p boundary inside a huge tie
      {Fill::FewValues, 3.0f, 0.3f, 0.7f, 0.0f, 70000},
      {Fill::AllEqual, 1.0f, 1.0f, 0.5f, 0.0f, 0},
      {Fill::AllEqual, 1.0f, 1.0f, 1.0f, 0.0f, 777},
      {Fill::AllEqual, 1.0f, 1.0f, 0.3f, 0.5f, 5000},
      {Fill::Rounded, 3.0f, 1.0f, 0.8f, 0.0f, 0},
      {Fill::SomeNegInf, 3.0f, 1.0f, 0.95f, 0.01f, 0},
      {Fill::SomeNaN, 3.0f, 1.0f, 0.95f, 0.0f, 100000},
      {Fill::Specials, 3.0f, 1.0f, 0.9f, 0.0f, 0},
      {Fill::Specials, 3.0f, 1.0f, 1.0f, 0.1f, 0},
      {Fill::AllNegInf, 1.0f, 1.0f, 0.9f, 0.0f, 0},
      {Fill::AllNegInf, 1.0f, 1.0f, 1.0f, 0.0f, 0},
      {Fill::AllNegInf, 1.0f, 1.0f, 1.0f, 0.0f, 10},
      {Fill::AllNaN, 1.0f, 1.0f, 0.9f, 0.1f, 10},
      {Fill::AllNaN, 1.0f, 1.0f, 1.0f, 0.0f, 0},
      {Fill::AllNaN, 1.0f, 0.0f, 1.0f, 0.0f, 0},
      {Fill::Normal, 20.0f, 1.0f, 1.0f, 0.0f, 200000},   // top_k >= vocab: no cut at all
      {Fill::Normal, 20.0f, 1e-5f, 0.5f, 0.5f, 3},       // just above the greedy limit
      {Fill::Normal, 3.0f, 1.0f, 1e-9f, 0.0f, 0},        // top-p keeps one token
      {Fill::Normal, 3.0f, 1.0f, 1.0f, 1.0f, 0},         // min-p keeps the maximum (and its ties)
  };
  for (int64_t vocab : {int64_t(5000), int64_t(151936)}) {
    const int64_t rows = int64_t(cases.size()) * 2;
    const int64_t ld = vocab;
    std::vector<float> logits(rows * ld);
    std::vector<TokenDraw> draws(rows);
    std::vector<std::string> what(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const Case& c = cases[r % cases.size()];
      fill_row(logits.data() + r * ld, vocab, c.fill, c.sigma, rng);
      draws[r].temperature = c.temperature;
      draws[r].top_p = c.top_p;
      draws[r].min_p = c.min_p;
      draws[r].top_k = c.top_k;
      draws[r].key = rng();
      what[r] = std::string(fill_name(c.fill)) + " sigma " + std::to_string(c.sigma);
    }
    check_batch(logits, rows, vocab, ld, draws, what);
  }
}

TEST(CudaSampling, DrawFollowsSoftmax) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<float> row = {1.0f, 0.2f, -0.5f, 2.0f};
  constexpr int64_t kDraws = 20000;
  struct Setting {
    float temperature;
    int32_t top_k;
  };
  for (const Setting set : {Setting{1.0f, 0}, Setting{0.7f, 3}}) {
    std::vector<float> logits;
    for (int64_t r = 0; r < kDraws; ++r) logits.insert(logits.end(), row.begin(), row.end());
    std::vector<TokenDraw> draws(kDraws);
    for (TokenDraw& d : draws) {
      d.temperature = set.temperature;
      d.top_k = set.top_k;
      d.key = rng();
    }
    DeviceBuffer dl(logits), dd(draws), dt(kDraws * sizeof(int32_t));
    dt.poison();
    cuda::draw_tokens(dl.get<float>(), kDraws, 4, 4, dd.get<TokenDraw>(), dt.get<int32_t>(), cuda::stream());
    const std::vector<int32_t> got = dt.download<int32_t>(kDraws);
    // softmax(row / temperature) over the top_k largest (token 2, the smallest, drops out for top_k 3).
    std::vector<double> p(4);
    double sum = 0;
    for (int i = 0; i < 4; ++i) {
      p[i] = set.top_k == 3 && i == 2 ? 0.0 : std::exp(double(row[i]) / set.temperature);
      sum += p[i];
    }
    std::vector<double> freq(4, 0.0);
    for (int32_t t : got) {
      ASSERT_TRUE(t >= 0 && t < 4) << "token " << t;
      freq[t] += 1.0 / kDraws;
    }
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(freq[i], p[i] / sum, 0.02) << "token " << i << " temperature " << set.temperature << " top_k "
                                             << set.top_k;
  }
}

TEST(CudaSampling, AdjustLogitsMatchesCpuBitForBit) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t vocab : {1, 37, 1000, 151936}) {
    const int64_t rows = 9, ld = vocab + 3;
    std::vector<float> logits = test::random_vector(rng, rows * ld, -8.0f, 8.0f);
    for (int64_t i = 0; i < rows * ld; i += 17) logits[i] = rng() % 2 ? 0.0f : -0.0f;
    // Distinct (row, token) pairs, some outside the vocabulary or with a negative row (ignored).
    std::set<std::pair<int32_t, int32_t>> seen;
    std::vector<LogitAdjustment> adj;
    const int64_t count = std::min<int64_t>(rows * vocab / 2 + 3, 5000);
    while (int64_t(adj.size()) < count) {
      LogitAdjustment a;
      a.row = int32_t(rng() % 50 == 0 ? -1 : int64_t(rng() % rows));
      const int t = int(rng() % 40);
      a.token = t == 0 ? -1 : t == 1 ? int32_t(vocab) : t == 2 ? int32_t(vocab + 2) : int32_t(rng() % vocab);
      if (!seen.insert({a.row, a.token}).second) {
        if (seen.size() >= size_t(rows * vocab)) break;
        continue;
      }
      static const float divs[] = {1.0f, 1.3f, 0.7f, 2.0f};
      a.divide_positive = divs[rng() % 4];
      a.subtract = rng() % 2 ? 0.0f : float(rng() % 1000) / 997.0f;
      a.mask = rng() % 10 == 0;
      a.bias = rng() % 3 ? 0.0f : float(int(rng() % 20001) - 10000) / 100.0f;  // logit_bias in [-100, 100]
      adj.push_back(a);
    }
    std::vector<float> want = logits;
    for (int64_t r = 0; r < rows; ++r) cpu::adjust_logits(want.data() + r * ld, vocab, int32_t(r), adj);
    DeviceBuffer dl(logits), da(adj);
    cuda::adjust_logits(dl.get<float>(), ld, da.get<LogitAdjustment>(), int64_t(adj.size()), vocab, cuda::stream());
    const std::vector<float> got = dl.download<float>(rows * ld);
    for (int64_t i = 0; i < rows * ld; ++i)
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
          << "vocab " << vocab << " element " << i << ": got " << got[i] << ", expected " << want[i];
  }
}

// Structured outputs' token bitmasks (token_bitmask.cu) against cpu::apply_token_bitmask, bit for bit, on some
// rows of a batch (rows not listed untouched), and sample_tokens with masks draws what the CPU draws.
TEST(CudaSampling, TokenBitmaskMatchesCpu) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t vocab : {1, 31, 32, 33, 1000, 151936, 163840}) {
    const int64_t rows = 7, ld = vocab + 5, words_per_row = (vocab + 31) / 32 + 1;
    std::vector<float> logits = test::random_vector(rng, rows * ld, -8.0f, 8.0f);
    const std::vector<int32_t> masked = {1, 4, 6};
    std::vector<uint32_t> words(masked.size() * size_t(words_per_row));
    for (size_t k = 0; k < masked.size(); ++k)
      for (int64_t w = 0; w < words_per_row; ++w) {
        const int kind = int(rng() % 4);  // all allowed, none, sparse, random
        words[k * size_t(words_per_row) + size_t(w)] =
            kind == 0 ? 0xFFFFFFFFu : kind == 1 ? 0u : kind == 2 ? uint32_t(1u << (rng() % 32)) : uint32_t(rng());
      }
    std::vector<float> want = logits;
    for (size_t k = 0; k < masked.size(); ++k)
      cpu::apply_token_bitmask(want.data() + masked[k] * ld, vocab, words.data() + k * size_t(words_per_row));
    DeviceBuffer dl(logits), dr(masked), dw(words);
    cuda::apply_token_bitmask(dl.get<float>(), ld, vocab, dr.get<int32_t>(), int64_t(masked.size()), dw.get<uint32_t>(),
                              words_per_row, cuda::stream());
    const std::vector<float> got = dl.download<float>(rows * ld);
    for (int64_t i = 0; i < rows * ld; ++i)
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
          << "vocab " << vocab << " element " << i << ": got " << got[i] << ", expected " << want[i];
  }
}

TEST(CudaSampling, RejectsBadArguments) {
  SPARROW_REQUIRE_GPU();
  DeviceBuffer dl(size_t(64) * sizeof(float)), dd(sizeof(TokenDraw)), dt(sizeof(int32_t));
  const float* l = dl.get<float>();
  const TokenDraw* d = dd.get<TokenDraw>();
  int32_t* t = dt.get<int32_t>();
  EXPECT_THROW(cuda::draw_tokens(l, 1, 16, 8, d, t, cuda::stream()), Error);  // ld < vocab
  EXPECT_THROW(cuda::draw_tokens(l, 1, 0, 8, d, t, cuda::stream()), Error);
  EXPECT_THROW(cuda::draw_tokens(l, -1, 16, 16, d, t, cuda::stream()), Error);
  EXPECT_THROW(cuda::draw_tokens(nullptr, 1, 16, 16, d, t, cuda::stream()), Error);
  EXPECT_THROW(cuda::draw_tokens(l, 1, 16, 16, nullptr, t, cuda::stream()), Error);
  EXPECT_THROW(cuda::draw_tokens(l, 1, 16, 16, d, nullptr, cuda::stream()), Error);
  EXPECT_THROW(cuda::adjust_logits(dl.get<float>(), 8, nullptr, 1, 16, cuda::stream()), Error);  // ld < vocab
  EXPECT_THROW(cuda::adjust_logits(dl.get<float>(), 16, nullptr, 1, 16, cuda::stream()), Error);
  EXPECT_NO_THROW(cuda::adjust_logits(dl.get<float>(), 16, nullptr, 0, 16, cuda::stream()));
  EXPECT_NO_THROW(cuda::draw_tokens(nullptr, 0, 16, 16, nullptr, nullptr, cuda::stream()));  // no rows: no work
  EXPECT_THROW(cuda::apply_token_bitmask(dl.get<float>(), 16, 40, nullptr, 1, nullptr, 2, cuda::stream()), Error);  // ld < vocab
  EXPECT_THROW(cuda::apply_token_bitmask(dl.get<float>(), 64, 64, nullptr, 1, nullptr, 1, cuda::stream()), Error);  // too few words
  EXPECT_NO_THROW(cuda::apply_token_bitmask(dl.get<float>(), 64, 64, nullptr, 0, nullptr, 2, cuda::stream()));
}

}  // namespace
}  // namespace sparrow
