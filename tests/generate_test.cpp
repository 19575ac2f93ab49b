// Offline generation (engine/generate.h), the loop under `sparrow generate` (both forms) and `sparrow chat`,
// on the bundled trained models (models/):
//   - its greedy tokens are those of decoding one token at a time against the model's own cache;
//   - the streaming form hands over each token as the engine's step samples it (the prompts' tokens
//     interleave, one per step each) and gives what the collecting form returns;
//   - a stop id ends a prompt after it (kept), max_tokens bounds it, 0 tokens asks for nothing;
//   - prompt i of a seeded run draws with seed + i;
//   - a failed step of the model is an error, not a silently shortened output.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/generate.h"
#include "model/model.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

const fs::path kModels = fs::path(SPARROW_SOURCE_DIR) / "models";

std::vector<std::string> bundled_models() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kModels))
    if (fs::exists(entry.path() / "config.json")) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A bundled model with the ids of a few Python openings, as `sparrow generate --prompt` encodes them.
struct BundledModel {
  std::unique_ptr<Model> model;
  std::vector<Tokens> prompts;

  explicit BundledModel(const std::string& name) {
    const std::string dir = (kModels / name).string();
    model = load_model(dir);
    auto tokenizer = load_tokenizer(dir);
    for (const char* text : {"def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"})
      prompts.push_back(tokenizer->encode_with_special_tokens(text));
  }
};

GenerateOptions greedy(int64_t max_tokens) {
  GenerateOptions options;
  options.sampling.temperature = 0;
  options.max_tokens = max_tokens;
  return options;
}

// Greedy decoding without the engine: prefill, then one step per token through a runner, in a cache of
// the sequence's own.
Tokens decode_one_token_at_a_time(Model& model, const Tokens& prompt, int64_t max_tokens) {
  ModelRunner runner(model);
  SequenceState state = runner.new_sequence();
  Tokens generated;
  Tokens next = prompt;
  while (int64_t(generated.size()) < max_tokens) {
    Batch batch = make_batch({{&state, next}});
    batch.all_logits = false;
    const Tensor logits = runner.run(batch).to(Device::Cpu);
    generated.push_back(argmax({logits.row(0), size_t(logits.dim(1))}));
    next = {generated.back()};
  }
  return generated;
}


class GenerateOnBundledModel : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(GenerateOnBundledModel, GreedyTokensAreThoseOfDecodingOneTokenAtATime) {
  BundledModel bundled(GetParam());
  const auto generated = generate(*bundled.model, bundled.prompts, greedy(40));
  ASSERT_EQ(generated.size(), bundled.prompts.size());
  for (size_t i = 0; i < bundled.prompts.size(); ++i)
    EXPECT_EQ(generated[i], decode_one_token_at_a_time(*bundled.model, bundled.prompts[i], 40)) << "prompt " << i;
}

INSTANTIATE_TEST_SUITE_P(Models, GenerateOnBundledModel, ::testing::ValuesIn(bundled_models()),
                         [](const auto& info) { return info.param; });

TEST(Generate, StreamingHandsOverEachTokenAsItsStepSamplesIt) {
  BundledModel bundled("minimax_m3");
  const std::vector<Tokens> prompts = {bundled.prompts[0], bundled.prompts[1]};
  std::vector<std::pair<size_t, int32_t>> handed_over;
  generate(*bundled.model, prompts, greedy(12),
           [&](size_t prompt, int32_t token) { handed_over.push_back({prompt, token}); });
  ASSERT_EQ(handed_over.size(), 24u);
  // Both prompts decode in every step of the engine, so their tokens come one each per step.
  std::vector<Tokens> streamed(prompts.size());
  for (size_t k = 0; k < handed_over.size(); ++k) {
    EXPECT_EQ(handed_over[k].first, k % 2) << "token " << k;
    streamed[handed_over[k].first].push_back(handed_over[k].second);
  }
  EXPECT_EQ(streamed, generate(*bundled.model, prompts, greedy(12)));
}

TEST(Generate, StopsAfterAStopIdAndAtMaxTokens) {
  BundledModel bundled("minimax_m3");
  const Tokens& prompt = bundled.prompts[0];
  const Tokens free_run = generate(*bundled.model, {prompt}, greedy(20))[0];
  ASSERT_EQ(free_run.size(), 20u);

  GenerateOptions stopping = greedy(20);
  stopping.stop_token_ids = {free_run[5]};
  const size_t first = std::find(free_run.begin(), free_run.end(), free_run[5]) - free_run.begin();
  EXPECT_EQ(generate(*bundled.model, {prompt}, stopping)[0], Tokens(free_run.begin(), free_run.begin() + first + 1))
      << "the stop id ends the output and is kept";

  EXPECT_EQ(generate(*bundled.model, {prompt}, greedy(7))[0], Tokens(free_run.begin(), free_run.begin() + 7));
  int calls = 0;
  generate(*bundled.model, {prompt}, greedy(0), [&](size_t, int32_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(Generate, SeededPromptIDrawsWithSeedPlusI) {
  BundledModel bundled("minimax_m3");
  GenerateOptions sampled;
  sampled.max_tokens = 24;
  sampled.sampling.temperature = 1.0f;
  sampled.sampling.seed = 5;
  const auto together = generate(*bundled.model, bundled.prompts, sampled);
  EXPECT_EQ(generate(*bundled.model, bundled.prompts, sampled), together) << "the same seed draws the same tokens";
  for (size_t i = 0; i < bundled.prompts.size(); ++i) {
    GenerateOptions alone = sampled;
    alone.sampling.seed = 5 + i;
    EXPECT_EQ(generate(*bundled.model, {bundled.prompts[i]}, alone)[0], together[i]) << "prompt " << i;
  }
}

TEST(Generate, AFailedStepIsAnError) {
  BundledModel bundled("minimax_m3");
  const Tokens free_run = generate(*bundled.model, {bundled.prompts[0]}, greedy(8))[0];
  // The fourth token poisons the step that decodes it: four tokens come out, then the error.
  sparrow::testing::FailingModel failing(std::move(bundled.model), free_run[3]);
  ASSERT_EQ(std::count(bundled.prompts[0].begin(), bundled.prompts[0].end(), free_run[3]), 0);
  ASSERT_EQ(std::count(free_run.begin(), free_run.begin() + 3, free_run[3]), 0);
  Tokens handed_over;
  const std::string error = sparrow::testing::error_message([&] {
    generate(failing, {bundled.prompts[0]}, greedy(8), [&](size_t, int32_t token) { handed_over.push_back(token); });
  });
  EXPECT_TRUE(sparrow::testing::mentions(error, {"a step of the model failed"})) << error;
  EXPECT_EQ(handed_over, Tokens(free_run.begin(), free_run.begin() + 4));
}
