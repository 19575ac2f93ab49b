// LoRA adapters on the GPU (model/lora.h, issue 29): the same ops as on the CPU, in bf16, and the routed experts'
// terms inside the expert kernels (moe.h ExpertLora). The adapters target every projection: attention, indexers,
// dense MLPs, shared and routed experts. On the GPU fixtures
// of the families that run there, an adapter answers as its merged checkpoint and requests of two adapters and
// the base model in one batch answer as they do alone, both up to bf16 rounding: greedy tokens equal until the
// first near tie (within kTieMargin of the other run's choice), prompt logprobs within kLogprobTolerance, or
// against the merged checkpoint within twice the fixture's own bf16 noise (its merged run against the CPU's
// fp32) where that is larger. A LoRA that were not applied, or applied to the wrong rows, is off by far more
// (checked: the adapters move the prompt logprobs by more than kAdapterEffect and twice that tolerance).
// Prompts stay within the fixtures' top-k budgets: past them a bf16 difference flips the indexers' selections
// of these random-weight models, and logits move by far more than rounding (the whole-model GPU tests print
// the same against transformers).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../lora_test_util.h"
#include "engine/engine_core.h"
#include "gpu_test_util.h"
#include "model/model.h"

using namespace sparrow;
using namespace sparrow::testing;

namespace {

constexpr float kTieMargin = 0.1f, kLogprobTolerance = 0.15f, kAdapterEffect = 0.3f;

using Choice = Gathered;
using Outputs = GatheredOutputs;

Outputs run(Model& model, const std::vector<Request>& requests, bool together) {
  EngineConfig config;
  config.max_model_len = 512;
  config.max_num_seqs = 16;
  config.max_num_batched_tokens = 4096;
  config.cache.block_size = 64;
  config.cache.max_num_seqs = 16;
  config.cache.memory_bytes = int64_t(256) << 20;
  config.cache.enable_prefix_caching = false;
  EngineCore engine(model, nullptr, config);
  Outputs out;
  for (const Request& r : requests) {
    add_gathering(engine, r, out);
    if (!together)
      while (engine.step()) {
      }
  }
  while (engine.step()) {
  }
  return out;
}

// Within the fixtures' sparse budgets (see above).
std::vector<Request> prompts(int64_t vocab) { return greedy_requests(vocab, {7, 20, 33}, 9, 5, 0); }

// The largest difference of two runs' prompt logprobs.
float prompt_logprob_gap(const Choice& a, const Choice& b) {
  float worst = 0;
  for (size_t i = 0; i < std::min(a.prompt_logprobs.size(), b.prompt_logprobs.size()); ++i)
    if (a.prompt_logprobs[i] && b.prompt_logprobs[i])
      worst = std::max(worst, std::fabs(a.prompt_logprobs[i]->logprob - b.prompt_logprobs[i]->logprob));
  return worst;
}

// got against want: tokens equal until a near tie (the other run's choice within kTieMargin, or within
// `tolerance` where that is larger: logprobs that may move that far may swap a pair that close); prompt
// logprobs within `tolerance`. Returns the largest prompt logprob difference.
float expect_close(const Choice& got, const Choice& want, const std::string& what,
                   float tolerance = kLogprobTolerance) {
  for (size_t i = 0; i < std::min(got.tokens.size(), want.tokens.size()); ++i) {
    if (got.tokens[i] == want.tokens[i]) continue;
    float chosen = -INFINITY;
    for (const auto& [token, logprob] : want.logprobs[i].top)
      if (token == got.tokens[i]) chosen = logprob;
    EXPECT_GE(chosen, want.logprobs[i].logprob - std::max(kTieMargin, tolerance))
        << what << ": token " << i << " is not a near tie (" << chosen << " against " << want.logprobs[i].logprob
        << ")";
    break;
  }
  EXPECT_EQ(got.prompt_logprobs.size(), want.prompt_logprobs.size()) << what;
  const float worst = prompt_logprob_gap(got, want);
  EXPECT_LE(worst, tolerance) << what;
  return worst;
}

class CudaLora : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Adapters over `which` targets answer as their merged checkpoint, alone and mixed in one batch.
static void check_adapters(const std::string& fixture, Targets which, float b_scale) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / fixture;
  const Adapter a = make_adapter(dir, 8, 51, which, b_scale), b = make_adapter(dir, 4, 52, which, b_scale);
  const auto merged_a = merged_model(dir, a);
  auto model = load_model(dir.string(), Device::Cuda);
  auto lora_a = load_lora_adapter("a", a.dir(), dir.string(), Device::Cuda, 16);
  auto lora_b = load_lora_adapter("b", b.dir(), dir.string(), Device::Cuda, 16);
  const std::vector<Request> plain = prompts(model->vocab_size());
  std::vector<Request> mixed;
  for (const Request& r : plain) {
    mixed.push_back(r);
    Request ra = r, rb = r;
    ra.id += "+a", ra.lora = lora_a;
    rb.id += "+b", rb.lora = lora_b;
    mixed.push_back(ra);
    mixed.push_back(rb);
  }
  const Outputs together = run(*model, mixed, true);
  const Outputs alone = run(*model, mixed, false);
  Outputs want, exact;
  {
    auto merged = load_model(merged_a->path(), Device::Cuda);
    want = run(*merged, plain, false);
    auto merged_cpu = load_model(merged_a->path(), Device::Cpu);
    exact = run(*merged_cpu, plain, false);
  }
  // The fixture's own bf16 noise: the merged checkpoint on the GPU against the CPU's fp32. The adapter's run and
  // the merged one round differently (W x + B (A x) against (W + B A) x), each about that far from fp32.
  float noise = 0;
  for (const Request& r : plain) noise = std::max(noise, prompt_logprob_gap(want.at(r.id), exact.at(r.id)));
  const float tolerance = std::max(kLogprobTolerance, 2 * noise + 0.05f);
  float effect = 0, worst = 0;
  for (const Request& r : plain) {
    worst = std::max(worst, expect_close(alone.at(r.id + "+a"), want.at(r.id),
                                         fixture + " " + r.id + " adapter against merged", tolerance));
    for (const std::string& tag : {"", "+a", "+b"})
      expect_close(together.at(r.id + tag), alone.at(r.id + tag),
                   fixture + " " + r.id + tag + " batched against alone");
    const Choice &base = alone.at(r.id), &adapted = alone.at(r.id + "+a");
    for (size_t i = 0; i < base.prompt_logprobs.size(); ++i)
      if (base.prompt_logprobs[i] && adapted.prompt_logprobs[i])
        effect = std::max(effect, std::fabs(base.prompt_logprobs[i]->logprob - adapted.prompt_logprobs[i]->logprob));
  }
  std::printf("[ note ] %s: bf16 noise %.3f, adapter against merged %.3f (tolerance %.3f), adapter effect %.3f\n",
              fixture.c_str(), noise, worst, tolerance, effect);
  EXPECT_GT(effect, std::max(kAdapterEffect, 2 * tolerance))
      << "the adapter hardly moves the model next to the rounding: the test could not see it ignored";
}

TEST_P(CudaLora, AdaptersAnswerAsTheirMergedCheckpointsAloneAndInOneBatch) {
  SPARROW_REQUIRE_GPU();
  check_adapters(GetParam(), Targets::All, 0.15f);
}

// The routed experts alone: their terms inside the expert kernels must move the model by themselves (larger
// terms than above, so that they do next to the bf16 tolerance).
TEST_P(CudaLora, RoutedExpertAdaptersAnswerAsTheirMergedCheckpoints) {
  SPARROW_REQUIRE_GPU();
  check_adapters(GetParam(), Targets::RoutedExpertsOnly, 0.6f);
}

INSTANTIATE_TEST_SUITE_P(GpuFixtures, CudaLora,
                         ::testing::Values("deepseek_v32_gpu", "kimi_linear_gpu", "kimi_k3_1_pro_gpu"));
