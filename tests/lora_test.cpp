// LoRA adapters (model/lora.h, issue 29) on the CPU, for every bundled model: an adapter answers as its
// merged checkpoint (W + scaling B A written out as a model of its own), with greedy tokens equal and
// logprobs within float rounding; requests of different adapters and of the base model share one batch and
// each answers as it does alone, bit for bit; a prefix cached by the base model is not reused by an adapter's
// request; on quantized base weights an adapter answers as its merge into the dequantized twin; and the
// adapter files sparrow cannot apply are refused with one-line errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/engine_core.h"
#include "lora_test_util.h"
#include "model/lora.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
using namespace sparrow::testing;
namespace fs = std::filesystem;

namespace {

using Choice = Gathered;
using Outputs = GatheredOutputs;

EngineConfig engine_config(int64_t max_num_seqs) {
  EngineConfig config;
  config.max_model_len = 512;
  config.max_num_seqs = max_num_seqs;
  config.max_num_batched_tokens = 4096;
  config.cache.block_size = 16;
  config.cache.max_num_seqs = 16;
  config.cache.memory_bytes = int64_t(256) << 20;
  return config;
}

// Runs the requests in order through one engine: `together` submits them all before stepping (one batch),
// otherwise each runs to its end before the next is added (the prefix cache still holds earlier prompts).
Outputs run(Model& model, const std::vector<Request>& requests, bool together, bool prefix_caching = false) {
  EngineConfig config = engine_config(16);
  config.cache.enable_prefix_caching = prefix_caching;
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

// Up to 260 tokens: past the bundled models' sparse budgets (128 keys: deepseek_v32's index_topk,
// minimax_m3's 4 blocks of 32).
std::vector<Request> prompts(int64_t vocab, bool prompt_logprobs) {
  return greedy_requests(vocab, {5, 46, 150, 260}, 7, 2, prompt_logprobs ? 1 : -1);
}

std::vector<Request> with_adapter(std::vector<Request> requests, std::shared_ptr<const LoraAdapter> adapter,
                                  const std::string& tag) {
  for (Request& r : requests) {
    r.id += tag;
    r.lora = adapter;
  }
  return requests;
}

// Greedy tokens equal; every logprob (sampled and prompt) within `tol`. Returns the largest difference.
double expect_close(const Choice& got, const Choice& want, double tol, const std::string& what) {
  EXPECT_EQ(got.tokens, want.tokens) << what;
  double worst = 0;
  EXPECT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < std::min(got.logprobs.size(), want.logprobs.size()); ++i)
    worst = std::max(worst, std::fabs(double(got.logprobs[i].logprob) - want.logprobs[i].logprob));
  EXPECT_EQ(got.prompt_logprobs.size(), want.prompt_logprobs.size()) << what;
  for (size_t i = 0; i < std::min(got.prompt_logprobs.size(), want.prompt_logprobs.size()); ++i)
    if (got.prompt_logprobs[i] && want.prompt_logprobs[i])
      worst = std::max(worst, std::fabs(double(got.prompt_logprobs[i]->logprob) - want.prompt_logprobs[i]->logprob));
  EXPECT_LE(worst, tol) << what;
  return worst;
}

bool bitwise_equal(const Choice& a, const Choice& b) {
  if (a.tokens != b.tokens || a.logprobs.size() != b.logprobs.size()) return false;
  for (size_t i = 0; i < a.logprobs.size(); ++i)
    if (a.logprobs[i].logprob != b.logprobs[i].logprob || a.logprobs[i].top != b.logprobs[i].top) return false;
  return true;
}

class Lora : public ::testing::TestWithParam<std::string> {};

}  // namespace

// The prompts through `merged` alone, through `base` with `adapter`, and through `base` alone: the adapted
// answers are checked against the merged ones (greedy equal, logprobs within 2e-3); each caller then checks that
// the adapter matters.
struct AdapterRun {
  std::vector<Request> plain;
  Outputs want, got, without;
};
AdapterRun expect_answers_as(Model& base, Model& merged, std::shared_ptr<const LoraAdapter> adapter,
                             const std::string& what) {
  AdapterRun run_of;
  run_of.plain = prompts(base.vocab_size(), true);
  run_of.want = run(merged, run_of.plain, false);
  run_of.got = run(base, with_adapter(run_of.plain, adapter, "+a"), false);
  run_of.without = run(base, run_of.plain, false);
  for (const Request& r : run_of.plain) expect_close(run_of.got.at(r.id + "+a"), run_of.want.at(r.id), 2e-3, what + " " + r.id);
  return run_of;
}

// An adapter over `which` projections answers as its merged checkpoint, and differently from the base model.
void expect_answers_as_merged(const std::string& model, Targets which) {
  const fs::path dir = bundled(model);
  const Adapter a = make_adapter(dir, 8, 11, which);
  ASSERT_FALSE(a.ab.empty());
  const auto merged = merged_model(dir, a);
  auto base = load_model(dir.string());
  auto adapter = load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16);
  EXPECT_EQ(adapter->modules.size(), a.ab.size());
  EXPECT_FLOAT_EQ(adapter->scaling, 2.0f);
  auto merged_weights = load_model(merged->path());
  const AdapterRun out = expect_answers_as(*base, *merged_weights, adapter, model);
  double differs = 0;
  for (const Request& r : out.plain) {
    // The adapter must matter: its answers are not the base model's.
    for (size_t i = 0; i < out.want.at(r.id).prompt_logprobs.size(); ++i)
      if (out.want.at(r.id).prompt_logprobs[i] && out.without.at(r.id).prompt_logprobs[i])
        differs = std::max(differs, std::fabs(double(out.want.at(r.id).prompt_logprobs[i]->logprob) -
                                              out.without.at(r.id).prompt_logprobs[i]->logprob));
  }
  EXPECT_GT(differs, 0.05) << "the adapter hardly changes the model: the test would not see it ignored";
}

TEST_P(Lora, AnAdapterAnswersAsItsMergedCheckpoint) { expect_answers_as_merged(GetParam(), Targets::All); }

// The routed experts alone: each expert's gate, up and down inside the MoE, whether the checkpoint stores
// the experts one by one (deepseek_v32 under transformers' names, kimi_k3 under w1 / w3 / w2) or stacked
// (minimax_m3).
TEST_P(Lora, AnAdapterOfTheRoutedExpertsAnswersAsItsMergedCheckpoint) {
  expect_answers_as_merged(GetParam(), Targets::RoutedExpertsOnly);
}

// The indexers' projections alone: they change only which keys the sparse attention reads (prompts()
// runs past the sparse budgets).
TEST_P(Lora, AnAdapterOfTheIndexersAnswersAsItsMergedCheckpoint) {
  if (GetParam() == "kimi_k3") GTEST_SKIP() << "the bundled kimi_k3 has no indexer";
  expect_answers_as_merged(GetParam(), Targets::IndexersOnly);
}

// vLLM's shared-outer form of routed-expert adapters (experts.w1 / w3 / w2, gate's and up's A and down's B
// one per MoE): it answers as its merged checkpoint, and a factor the experts share is stored once.
TEST_P(Lora, AnAdapterInVllmsSharedOuterFormAnswersAsItsMergedCheckpoint) {
  const fs::path dir = bundled(GetParam());
  Adapter a = make_adapter(dir, 8, 13, Targets::RoutedExpertsOnly);
  make_shared_outer(a);
  const auto merged = merged_model(dir, a);
  auto base = load_model(dir.string());
  auto adapter = load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16);
  ASSERT_EQ(adapter->modules.size(), a.ab.size());
  const LoraAdapter::ExpertPairs& first = adapter->expert_stacks.begin()->second;
  ASSERT_GT(first.gate.size(), 1u);
  EXPECT_EQ(first.gate[0]->a.data(), first.gate[1]->a.data()) << "the shared A is stored once a stack";
  EXPECT_EQ(first.down[0]->b.data(), first.down[1]->b.data()) << "the shared B is stored once a stack";
  EXPECT_NE(first.gate[0]->b.data(), first.gate[1]->b.data());
  auto merged_weights = load_model(merged->path());
  const AdapterRun out = expect_answers_as(*base, *merged_weights, adapter, GetParam());
  for (const Request& r : out.plain)
    EXPECT_NE(out.want.at(r.id).prompt_logprobs.back()->logprob, out.without.at(r.id).prompt_logprobs.back()->logprob);
}

TEST_P(Lora, AdaptersAndTheBaseModelShareABatchAndAnswerAsAlone) {
  const fs::path dir = bundled(GetParam());
  const Adapter a = make_adapter(dir, 8, 21), b = make_adapter(dir, 4, 22);
  auto model = load_model(dir.string());
  auto lora_a = load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16);
  auto lora_b = load_lora_adapter("b", b.dir(), dir.string(), Device::Cpu, 16);
  const std::vector<Request> plain = prompts(model->vocab_size(), false);
  // Interleaved: base, a, b, a, base, b, ... so runs of one adapter are short and broken up.
  std::vector<Request> mixed;
  for (size_t i = 0; i < plain.size(); ++i) {
    mixed.push_back(plain[i]);
    mixed.push_back(with_adapter({plain[i]}, i % 2 ? lora_b : lora_a, i % 2 ? "+b" : "+a")[0]);
    mixed.push_back(with_adapter({plain[i]}, i % 2 ? lora_a : lora_b, i % 2 ? "+a" : "+b")[0]);
  }
  const Outputs together = run(*model, mixed, true);
  for (const Request& r : mixed) {
    const Outputs alone = run(*model, {r}, false);
    EXPECT_TRUE(bitwise_equal(together.at(r.id), alone.at(r.id))) << GetParam() << " " << r.id;
  }
  EXPECT_NE(together.at("p3").logprobs.front().logprob, together.at("p3+a").logprobs.front().logprob);
}

TEST_P(Lora, AnAdapterDoesNotReuseTheBaseModelsCachedPrefix) {
  const fs::path dir = bundled(GetParam());
  const Adapter a = make_adapter(dir, 8, 31);
  auto model = load_model(dir.string());
  auto lora = load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16);
  // 130 tokens: the prefill's last block boundary (128) holds a recurrent state snapshot, so a repeat
  // hits the prefix cache on the hybrid models too (cache/kv_cache.h).
  Request base = prompts(model->vocab_size(), false).back();
  base.prompt.resize(130, 7);
  Request base_again = base;
  base_again.id += "+again";
  const Request adapted = with_adapter({base}, lora, "+a")[0];
  Request again = adapted;
  again.id += "+again";
  const Outputs out = run(*model, {base, base_again, adapted, again}, false, /*prefix_caching=*/true);
  ASSERT_GT(out.at(base_again.id).cached_tokens, 0) << "the base model's repeat does not hit the prefix cache";
  EXPECT_EQ(out.at(adapted.id).cached_tokens, 0) << "the adapter's request reused the base model's blocks";
  EXPECT_EQ(out.at(again.id).cached_tokens, out.at(base_again.id).cached_tokens)
      << "the adapter's own prefix is not cached as the base model's is";
  const Outputs fresh = run(*model, {adapted}, false);
  EXPECT_TRUE(bitwise_equal(out.at(adapted.id), fresh.at(adapted.id)));
  EXPECT_TRUE(bitwise_equal(out.at(again.id), fresh.at(adapted.id)));
}

INSTANTIATE_TEST_SUITE_P(BundledModels, Lora, ::testing::Values("deepseek_v32", "kimi_k3", "minimax_m3"));

// On quantized base weights (the fixtures of tests/quantized_weights_test.cpp: MXFP8 projections and NVFP4
// routed experts, MXFP4 routed experts): an adapter over every target, the routed experts' included, answers
// as its merge into the checkpoint's dequantized twin.
class LoraOnQuantizedWeights : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraOnQuantizedWeights, AnAdapterAnswersAsItsMergeIntoTheDequantizedTwin) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam(), twin = dir / "twin";
  const Adapter a = make_adapter(twin, 8, 61);
  ASSERT_TRUE(std::any_of(a.ab.begin(), a.ab.end(), [](const auto& m) { return m.first.find(".experts.") != std::string::npos; }));
  const auto merged = merged_model(twin, a);
  auto quantized = load_model(dir.string());
  auto adapter = load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16);
  EXPECT_EQ(adapter->modules.size(), a.ab.size());
  auto merged_weights = load_model(merged->path());
  const AdapterRun out = expect_answers_as(*quantized, *merged_weights, adapter, GetParam());
  for (const Request& r : out.plain)
    EXPECT_NE(out.got.at(r.id + "+a").prompt_logprobs.back()->logprob, out.without.at(r.id).prompt_logprobs.back()->logprob);
}

INSTANTIATE_TEST_SUITE_P(Formats, LoraOnQuantizedWeights, ::testing::Values("minimax_m3_nvfp4", "deepseek_v32_mxfp4"));

// PEFT's form for stacked experts (LoraConfig.target_parameters: "<moe>.experts.base_layer" and
// "<moe>.experts", every expert's pair in one lora_A / lora_B): an adapter PEFT saved over a bundled model's
// routed experts gives the prompt logprobs transformers gives with it active (tools/make_lora_peft_fixture.py),
// over a prompt past the sparse budgets.
class LoraPeftStackedExperts : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraPeftStackedExperts, GivesTransformersPromptLogprobs) {
  const fs::path dir = bundled(GetParam());
  const fs::path fixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/lora_peft_experts" / GetParam();
  std::ifstream file(fixture / "reference.json");
  const nlohmann::json reference = nlohmann::json::parse(file);
  auto model = load_model(dir.string());
  auto adapter = load_lora_adapter("peft", fixture.string(), dir.string(), Device::Cpu, 16);
  EXPECT_TRUE(adapter->has_routed_experts());
  Request request{"r", reference["prompt"].get<std::vector<int32_t>>(), {}, adapter};
  request.params.max_tokens = 1;
  request.params.prompt_logprobs = 0;
  Request base = request;
  base.id = "base";
  base.lora = nullptr;
  const Outputs out = run(*model, {request, base}, false);
  const auto want = reference["prompt_logprobs"].get<std::vector<double>>();
  const auto want_base = reference["base_prompt_logprobs"].get<std::vector<double>>();
  const auto& got = out.at("r").prompt_logprobs;
  ASSERT_EQ(got.size(), want.size() + 1);  // none for the first token
  double worst = 0, worst_base = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(double(got[i + 1]->logprob) - want[i]));
    worst_base = std::max(worst_base, std::fabs(double(out.at("base").prompt_logprobs[i + 1]->logprob) - want_base[i]));
  }
  EXPECT_LE(worst, 1e-3) << GetParam() << " with the adapter (the base model is " << worst_base << " off)";
  EXPECT_LE(worst_base, 1e-3) << GetParam() << " without it";
}

INSTANTIATE_TEST_SUITE_P(BundledModels, LoraPeftStackedExperts, ::testing::Values("deepseek_v32", "minimax_m3"));

TEST(LoraAdapterFiles, WhatCannotBeAppliedIsRefusedWithOneLine) {
  const fs::path model_dir = bundled("minimax_m3");
  const Adapter good = make_adapter(model_dir, 8, 41, Targets::NoRoutedExperts);
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    EXPECT_TRUE(mentions(error_message(f), {needle}));
  };
  auto load = [&](const fs::path& dir, int64_t max_rank = 16) {
    return [dir, model_dir, max_rank] { load_lora_adapter("x", dir.string(), model_dir.string(), Device::Cpu, max_rank); };
  };
  expect_error(load("/nonexistent/adapter"), "is not a folder");
  expect_error(load(good.dir(), 4), "rank 8 is above --max-lora-rank 4");
  TempDir bad_dir;
  const fs::path bad = bad_dir.path();
  fs::copy_file(good.folder->file("adapter_model.safetensors"), bad / "adapter_model.safetensors");
  bad_dir.write("adapter_config.json", "{\"r\": 8, \"use_dora\": true}");
  expect_error(load(bad), "DoRA");
  bad_dir.write("adapter_config.json", "{\"r\": 8, \"bias\": \"all\"}");
  expect_error(load(bad), "bias");
  bad_dir.write("adapter_config.json", "{\"r\": 8, \"modules_to_save\": [\"lm_head\"]}");
  expect_error(load(bad), "modules_to_save");
  bad_dir.write("adapter_config.json", "{\"r\": 8,");
  expect_error(load(bad), "not valid JSON");
  bad_dir.write("adapter_config.json", "{\"lora_alpha\": 8}");
  expect_error(load(bad), "positive integer \"r\"");
  // A router is not adapted yet, nor an indexer's norm or a stack of experts as a whole; a lone lora_A is
  // incomplete.
  bad_dir.write("adapter_config.json", "{\"r\": 2}");
  const Tensor A = Tensor::zeros({2, 8}), B = Tensor::zeros({8, 2});
  for (const std::string& module :
       {std::string("model.layers.1.self_attn.indexer.k_norm"), std::string("model.layers.1.mlp.gate"),
        std::string("model.layers.1.mlp.experts.gate_up_proj"), std::string("model.layers.1.mlp.experts.x.gate_proj")}) {
    write_safetensors((bad / "adapter_model.safetensors").string(),
                      {{"base_model.model." + module + ".lora_A.weight", A}, {"base_model.model." + module + ".lora_B.weight", B}});
    expect_error(load(bad), "is not one sparrow adapts yet");
  }
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", A}});
  expect_error(load(bad), "has lora_A without lora_B");
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", Tensor::zeros({3, 8})},
                     {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", B}});
  expect_error(load(bad), "expected [2, in] and [out, 2]");
  fs::remove(bad / "adapter_model.safetensors");
  expect_error(load(bad), "has no adapter_model.safetensors");
  // Modules checked against the model's checkpoint: a shape that is not its weight's, a weight it lacks.
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", A},
                     {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", B}});
  expect_error(load(bad), "module 'model.layers.0.self_attn.q_proj' is [8 x 8], the model's weight [");
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight", A},
                     {"base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight", B}});
  expect_error(load(bad), "the model has no weight 'model.layers.9.self_attn.q_proj.weight'");
  // A routed expert of minimax_m3's stacks: checked against its part of them, by the stacks' names, and
  // refused where the model says so (data parallelism).
  auto expert_adapter = [&](const std::string& module, const Tensor& a, const Tensor& b) {
    write_safetensors((bad / "adapter_model.safetensors").string(),
                      {{"base_model.model." + module + ".lora_A.weight", a}, {"base_model.model." + module + ".lora_B.weight", b}});
  };
  expert_adapter("model.layers.1.mlp.experts.3.gate_proj", A, B);
  expect_error(load(bad), "module 'model.layers.1.mlp.experts.3.gate_proj' is [8 x 8], the model's weight [");
  expert_adapter("model.layers.1.mlp.experts.99.down_proj", A, B);
  expect_error(load(bad), "the model's stack model.layers.1.mlp.experts holds ");
  expert_adapter("model.layers.1.mlp.experts.3.w1", A, B);
  expect_error(load(bad), "so their parts are named gate_proj, up_proj and down_proj");
  // vLLM's shared-outer form: a factor by expert must hold every expert, and some factor must be by expert.
  const std::string w1 = "base_model.model.model.layers.1.mlp.experts.w1";
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{w1 + ".lora_A.weight", Tensor::zeros({1, 2, 8})}, {w1 + ".lora_B.weight", Tensor::zeros({1, 8, 2})}});
  expect_error(load(bad), "(expected [experts or 1, 2, in] and [experts or 1, out, 2], at least one of them by expert)");
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{w1 + ".lora_A.weight", Tensor::zeros({3, 2, 8})}, {w1 + ".lora_B.weight", Tensor::zeros({4, 8, 2})}});
  expect_error(load(bad), "at least one of them by expert");
  write_safetensors((bad / "adapter_model.safetensors").string(),
                    {{w1 + ".lora_A.weight", Tensor::zeros({2, 8})}, {w1 + ".lora_B.weight", Tensor::zeros({4, 8, 2})}});
  expect_error(load(bad), "(expected [experts or 1, 2, in] and [experts or 1, out, 2])");
  const Adapter experts = make_adapter(model_dir, 2, 42, Targets::RoutedExpertsOnly);
  EXPECT_TRUE(load_lora_adapter("x", experts.dir(), model_dir.string(), Device::Cpu, 16)->has_routed_experts());
  LoraTarget refusing;
  refusing.routed_experts_refused = "not here, for a reason";
  expect_error([&] { load_lora_adapter("x", experts.dir(), model_dir.string(), refusing, 16); },
               "': not here, for a reason");
  EXPECT_FALSE(load_lora_adapter("x", good.dir(), model_dir.string(), refusing, 16)->has_routed_experts());
}
