// Offline generation over a fixed set of prompts, run by the serving engine's loop (EngineCore): all
// prompts are prefilled in one batch, then every unfinished sequence decodes one token per step in one
// batch, each against its own cache (the prefix is never recomputed). `sparrow generate` (both forms) and
// `sparrow chat` generate through here, so the engine is the only generation loop.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/speculative.h"
#include "model/model.h"
#include "runner/model_runner.h"
#include "vision/image_input.h"

namespace sparrow {

struct GenerateOptions {
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::set<int32_t> stop_token_ids;  // generation ends after emitting one of these (it is kept)
  RunnerOptions runner;              // how the engine's runner runs steps (--enforce-eager)
  // Speculative decoding (--speculative-config); the draft model of method draft_model must outlive the call.
  SpeculativeConfig speculative;
  Model* draft_model = nullptr;
  // The prompts' numbers in the command's list, for their seeds (prompt i draws with seed + numbers[i]): a
  // data-parallel group generating its share of a list keeps the draws of the whole list. Empty: 0, 1, ...
  std::vector<size_t> numbers;
  // With speculative decoding: where the run's counters go when it ends (the draft tokens verified and
  // accepted, engine/speculative.h). Null: not reported.
  SpecDecodeStats* spec_stats = nullptr;
  // Each prompt's images (Request::images), or empty: none for any.
  std::vector<std::vector<vision::ImageInput>> images;
};

// Calls on_token(i, id) for each token generated after prompts[i] as soon as it is sampled (a stop token
// too), in the order of the steps. Prompt i samples with options.sampling.seed + i when seeded. Throws
// sparrow::Error when a step of the model fails (the engine prints its cause to stderr).
using OnGeneratedToken = std::function<void(size_t prompt, int32_t token)>;
void generate(Model& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
              const OnGeneratedToken& on_token);
// The same, the tokens of each prompt collected.
std::vector<std::vector<int32_t>> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& options);

// End-of-sequence ids from a model folder: generation_config.json's eos_token_id if present, else
// config.json's (an int or a list).
std::set<int32_t> eos_token_ids(const std::string& model_dir);

}  // namespace sparrow
