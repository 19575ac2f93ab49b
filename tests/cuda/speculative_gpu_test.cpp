// Speculative decoding on the GPU (docs/speculative.md), on the GPU fixtures of the three families that run
// there: MLA + DSA (deepseek_v32_gpu), MLA + KDA (kimi_linear_gpu) and MLA + DSA + KDA (kimi_k3_1_pro_gpu).
// Prompts that repeat themselves give prompt lookup (ngram) drafts, some accepted and some not, so verify
// steps run several query rows a sequence through the sparse indexer, top-k and MLA kernels, and rejected
// drafts roll the KDA states back in device memory.
//
// Greedy output with speculation is the target's own, as on the CPU (speculative_test.cpp); but here a
// verify step computes a row in another batch shape than a decode step does, so bf16 rounding may differ
// and a near tie may go the other way. So each request is compared token by token with the run without
// speculation until the first difference, where the token speculation chose must be one the plain run
// ranked within kTieMargin of its own choice (wrong verification or a wrong rollback gives tokens far off).
// Verify steps replayed from CUDA graphs are held to the same, and must actually replay.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <fstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "../drafter_test_util.h"
#include "engine/engine_core.h"
#include "engine/speculative.h"
#include "gpu_test_util.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "model/dspark.h"
#include "model/mtp.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

// Log-probability gap below which two GPU runs of different batch shapes may choose differently (the
// whole-model GPU tests' margin: bf16 activations through the layers).
constexpr float kTieMargin = 0.1f;

struct EngineRun {
  std::map<std::string, Tokens> tokens;
  std::map<std::string, std::vector<TokenLogprob>> logprobs;
  EngineStats stats;
};

std::vector<Request> repetitive_requests(int64_t vocab) {
  std::mt19937 rng(5);
  std::vector<Request> requests;
  for (int64_t length : {4, 11, 25, 40}) {
    Tokens unit(length), prompt;
    for (int32_t& id : unit) id = int32_t(2 + rng() % uint32_t(vocab - 2));
    for (int r = 0; r < 3; ++r) prompt.insert(prompt.end(), unit.begin(), unit.end());
    Request request{"r" + std::to_string(requests.size()), prompt, {}};
    request.params.temperature = 0;
    request.params.max_tokens = 32;
    request.params.ignore_eos = true;
    request.params.logprobs = 5;
    requests.push_back(request);
  }
  return requests;
}

EngineRun run(Model& model, const std::vector<Request>& requests, const std::string& speculative, bool eager,
              Model* drafter = nullptr) {
  EngineConfig config;
  config.max_model_len = 256;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 2048;
  config.cache.memory_bytes = int64_t(256) << 20;
  config.runner.enforce_eager = eager;
  if (!speculative.empty()) config.speculative = parse_speculative_config(speculative);
  config.draft_model = drafter;
  EngineCore engine(model, nullptr, config);
  EngineRun out;
  for (const Request& r : requests)
    engine.add(r, [&](const RequestOutput& e) {
      Tokens& t = out.tokens[e.request_id];
      t.insert(t.end(), e.new_tokens.begin(), e.new_tokens.end());
      std::vector<TokenLogprob>& l = out.logprobs[e.request_id];
      l.insert(l.end(), e.logprobs.begin(), e.logprobs.end());
    });
  for (int step = 0; engine.has_work(); ++step) {
    if (step > 10000) {
      ADD_FAILURE() << "the engine does not finish";
      break;
    }
    engine.step();
  }
  EXPECT_EQ(engine.cache().num_free_blocks(), engine.cache().plan().num_blocks) << "blocks left held";
  out.stats = engine.stats();
  return out;
}

// Token by token against `plain` up to the first difference, which must be a near tie in `plain`.
void expect_the_targets_tokens(const EngineRun& got, const EngineRun& plain) {
  for (const auto& [id, want] : plain.tokens) {
    const Tokens& tokens = got.tokens.at(id);
    ASSERT_EQ(tokens.size(), want.size()) << id;
    size_t i = 0;
    while (i < want.size() && tokens[i] == want[i]) ++i;
    if (i == want.size()) continue;
    const TokenLogprob& chosen = plain.logprobs.at(id)[i];
    float other = -INFINITY;
    for (const auto& [token, logprob] : chosen.top)
      if (token == tokens[i]) other = logprob;
    EXPECT_GE(other, chosen.logprob - kTieMargin)
        << id << ": token " << i << " is " << tokens[i] << ", the target chose " << want[i]
        << " and ranked it far below (or not in its top 5)";
    std::printf("[ note ] %s: first difference at token %zu of %zu, a near tie (%.3f vs %.3f)\n", id.c_str(), i,
                want.size(), other, chosen.logprob);
  }
}

class CudaSpeculative : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SPARROW_REQUIRE_GPU();
    model_ = load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam()).string(), Device::Cuda);
  }
  std::unique_ptr<Model> model_;
};

}  // namespace

TEST_P(CudaSpeculative, GreedyOutputIsTheTargetsWithAndWithoutGraphs) {
  const std::vector<Request> requests = repetitive_requests(model_->vocab_size());
  const EngineRun plain = run(*model_, requests, "", false);
  const std::string ngram =
      R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4})";
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "CUDA graphs");
    const EngineRun got = run(*model_, requests, ngram, eager);
    expect_the_targets_tokens(got, plain);
    const SpecDecodeStats& spec = got.stats.spec_decode;
    // The random checkpoints of the KDA fixtures do not repeat their prompts, so their prompt-lookup drafts
    // are all rejected (each step rolls the states back; partial acceptance runs on the CPU, the same engine
    // code, and under synthetic acceptance below); deepseek_v32_gpu accepts some (1.35 tokens a step on the
    // H200).
    if (GetParam() == "deepseek_v32_gpu") EXPECT_GT(spec.accepted_tokens, 0);
    EXPECT_GT(spec.drafts, 0);
    EXPECT_LT(spec.accepted_tokens, spec.draft_tokens) << "some drafts should be rejected (rows dropped, states rolled back)";
    if (eager) EXPECT_EQ(got.stats.graph_replays, 0);
    else EXPECT_GT(got.stats.graph_replays, 0) << "even verify steps should replay CUDA graphs";
    std::printf("[ note ] %s %s: %lld drafts, acceptance length %.2f, %lld graph replays\n", GetParam().c_str(),
                eager ? "eager" : "graphs", static_cast<long long>(spec.drafts), spec.acceptance_length(),
                static_cast<long long>(got.stats.graph_replays));
  }
}

// Synthetic acceptance (benchmarks): every proposal is filled up to k drafts, so decoding steps are even
// verify steps that graphs replay once their shape was seen (a short run changes shape often: sequences
// finish, contexts cross 128-key buckets); the acceptance length is near the one asked for. With KDA layers a
// rejection makes the next step run the accepted tokens again beside its drafts, so that step is uneven and
// runs eagerly; those fixtures only have to run partial acceptance and rollbacks to completion here.
TEST_P(CudaSpeculative, SyntheticAcceptanceReplaysVerifySteps) {
  const std::vector<Request> requests = repetitive_requests(model_->vocab_size());
  const EngineRun got = run(*model_, requests,
                      R"({"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "synthetic",
                          "synthetic_acceptance_length": 3})",
                      false);
  const SpecDecodeStats& spec = got.stats.spec_decode;
  EXPECT_GT(spec.drafts, 0);
  EXPECT_NEAR(spec.acceptance_length(), 3.0, 0.6);
  if (GetParam() == "deepseek_v32_gpu") EXPECT_GT(got.stats.graph_replays, 0);
  std::printf("[ note ] %s synthetic: %lld drafts, acceptance length %.2f, %lld graph replays\n", GetParam().c_str(),
              static_cast<long long>(spec.drafts), spec.acceptance_length(), static_cast<long long>(got.stats.graph_replays));
}

// The mtp method on the GPU: deepseek_v32_gpu's target with an MTP layer of dummy weights (the fixture has
// none; its config with num_nextn_predict_layers = 1 in a folder of its own). Its drafts are noise, so
// nearly all are rejected and the output must be the target's; the layer's one-token steps replay CUDA
// graphs (hidden states copied into the graph's buffer) or run eagerly, to the same tokens. With synthetic
// acceptance the same drafts are verified k at a time.
TEST(CudaSpeculativeMtp, DummyLayerDraftsAndTheTargetDecides) {
  SPARROW_REQUIRE_GPU();
  const fs::path fixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/deepseek_v32_gpu";
  const fs::path folder = fs::temp_directory_path() / ("sparrow_mtp_gpu_" + std::to_string(::getpid()));
  fs::create_directories(folder);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fixture / "config.json"));
  config["num_nextn_predict_layers"] = 1;
  std::ofstream(folder / "config.json") << config.dump();
  LoadOptions dummy;
  dummy.load_format = "dummy";
  std::unique_ptr<MtpDrafter> drafter = load_mtp_drafter(folder.string(), Device::Cuda, dummy);
  fs::remove_all(folder);
  std::unique_ptr<Model> target = load_model(fixture.string(), Device::Cuda);

  const std::vector<Request> requests = repetitive_requests(target->vocab_size());
  const EngineRun plain = run(*target, requests, "", false);
  const std::string mtp = R"({"method": "mtp", "num_speculative_tokens": 3})";
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "CUDA graphs");
    const EngineRun got = run(*target, requests, mtp, eager, drafter.get());
    expect_the_targets_tokens(got, plain);
    EXPECT_GT(got.stats.spec_decode.drafts, 0);
    std::printf("[ note ] mtp %s: %lld drafts, acceptance length %.2f\n", eager ? "eager" : "graphs",
                static_cast<long long>(got.stats.spec_decode.drafts), got.stats.spec_decode.acceptance_length());
  }
  const EngineRun synthetic = run(*target, requests,
                                  R"({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                                      "synthetic_acceptance_length": 2.5})",
                                  false, drafter.get());
  EXPECT_NEAR(synthetic.stats.spec_decode.acceptance_length(), 2.5, 0.5);
  EXPECT_GT(synthetic.stats.graph_replays, 0);
}

// The dspark method on the GPU: kimi_k3_1_pro_gpu's target (MLA + DSA + KDA under AttnRes, its streams
// captured after layers 0 and 2) with a DSpark drafter of dummy weights at the target's MLA shape (its config in
// a folder of its own). Its drafts are noise: the output must be the target's, with KDA rollbacks on every
// rejection; the block's non-causal MLA and the context rows run on the GPU kernels. With synthetic acceptance
// the same drafts are verified k at a time.
TEST(CudaSpeculativeDSpark, DummyDrafterDraftsAndTheTargetDecides) {
  SPARROW_REQUIRE_GPU();
  const fs::path fixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k3_1_pro_gpu";
  const fs::path folder = fs::temp_directory_path() / ("sparrow_dspark_gpu_" + std::to_string(::getpid()));
  fs::create_directories(folder);
  const nlohmann::json text = nlohmann::json::parse(std::ifstream(fixture / "config.json"))["text_config"];
  nlohmann::json config = {{"model_type", "k3_dspark"}, {"num_hidden_layers", 2}, {"intermediate_size", 256},
                           {"hidden_act", "silu"}, {"target_layer_ids", {0, 2}}, {"num_target_layers", 2},
                           {"markov_rank", 16}, {"dspark_noise_token_id", 3}};
  for (const char* key : {"hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps"})
    config[key] = text[key];
  std::ofstream(folder / "config.json") << config.dump();
  std::unique_ptr<Model> target = load_model(fixture.string(), Device::Cuda);
  LoadOptions dummy;
  dummy.load_format = "dummy";
  std::unique_ptr<DSparkDrafter> drafter = load_dspark_drafter(folder.string(), *target, dummy);
  fs::remove_all(folder);

  const std::vector<Request> requests = repetitive_requests(target->vocab_size());
  const EngineRun plain = run(*target, requests, "", false);
  const std::string dspark = R"({"method": "dspark", "model": "-", "num_speculative_tokens": 4})";
  for (bool eager : {true, false}) {  // the target's verify steps with and without graphs; the drafter is eager
    SCOPED_TRACE(eager ? "eager" : "CUDA graphs");
    const EngineRun got = run(*target, requests, dspark, eager, drafter.get());
    expect_the_targets_tokens(got, plain);
    EXPECT_GT(got.stats.spec_decode.drafts, 0);
    std::printf("[ note ] dspark %s: %lld drafts, acceptance length %.2f\n", eager ? "eager" : "graphs",
                static_cast<long long>(got.stats.spec_decode.drafts), got.stats.spec_decode.acceptance_length());
  }
  const EngineRun synthetic = run(*target, requests,
                                  R"({"method": "dspark", "model": "-", "num_speculative_tokens": 4,
                                      "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3})",
                                  false, drafter.get());
  EXPECT_NEAR(synthetic.stats.spec_decode.acceptance_length(), 3.0, 0.6);
}

// The Qwen3 DSpark drafter (GQA with q/k norms, non-causal with a 16-token sliding window, a reduced draft
// vocabulary) on the GPU against its float64 reference (tests/fixtures/minimax_m3_dspark,
// tools/make_qwen3_dspark_fixture.py): the context rows from the reference's target streams, the block's
// logits before and after the Markov bias within bf16 noise, the greedy drafts wherever the reference's
// margin exceeds it; then the engine on the MiniMax-M3 fixture gives the target's greedy tokens with it.
TEST(CudaSpeculativeDSpark, Qwen3DrafterMatchesItsReference) {
  SPARROW_REQUIRE_GPU();
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3_dspark";
  std::unique_ptr<Model> target =
      load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3").string(), Device::Cuda);
  std::unique_ptr<DSparkDrafter> drafter = load_dspark_drafter(dir.string(), *target);
  ModelRunner runner(*drafter, RunnerOptions{.enforce_eager = true});
  constexpr int64_t kBlock = 4;
  constexpr double kBf16Tolerance = 3e-2;  // relative L2 of a row of logits: bf16 activations and weights
  for (const sparrow::testing::DSparkCase& c : sparrow::testing::read_dspark_cases(dir)) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()));
    CacheConfig config;
    config.device = Device::Cuda;
    config.block_size = 16;
    config.memory_bytes = int64_t(64) << 20;
    config.enable_prefix_caching = false;
    KvCache cache(drafter->cache_spec(), config);
    const Tensor base = sparrow::testing::dspark_block_logits(*drafter, runner, cache, c, kBlock);
    const Tensor host = base.to(Device::Cpu, ScalarType::F32);
    ASSERT_EQ(host.shape(), c.base_logits.shape());
    int32_t previous = c.bonus;
    for (int64_t i = 0; i < kBlock; ++i) {
      EXPECT_LT(model_test::relative_l2(host.row(i), c.base_logits.row(i), host.dim(1)), kBf16Tolerance) << i;
      Tensor logits = ops::select_rows(base, {i});
      ops::add_(logits, drafter->markov_bias({previous}));
      const Tensor biased = logits.to(Device::Cpu, ScalarType::F32);
      EXPECT_LT(model_test::relative_l2(biased.row(0), c.markov_logits.row(i), host.dim(1)), kBf16Tolerance) << i;
      const int32_t draft = drafter->target_token(model_test::argmax(biased.row(0), biased.dim(1)));
      if (c.draft_gaps[size_t(i)] > 0.1f) EXPECT_EQ(draft, c.drafts[size_t(i)]) << "query " << i;
      previous = c.drafts[size_t(i)];  // the reference's chain, so one near tie does not move the rest
    }
  }
  const std::vector<Request> requests = repetitive_requests(target->vocab_size());
  const EngineRun plain = run(*target, requests, "", false);
  const std::string dspark = R"({"method": "dspark", "model": "-", "num_speculative_tokens": 4})";
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "CUDA graphs");
    const EngineRun got = run(*target, requests, dspark, eager, drafter.get());
    expect_the_targets_tokens(got, plain);
    EXPECT_GT(got.stats.spec_decode.drafts, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(CudaFixtures, CudaSpeculative,
                         ::testing::Values("deepseek_v32_gpu", "kimi_linear_gpu", "kimi_k3_1_pro_gpu"),
                         [](const auto& info) { return info.param; });
