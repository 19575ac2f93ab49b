// Offline generation over a fixed set of prompts: all prompts are prefilled in one batch, then every
// unfinished sequence decodes one token per step in one batch, each against its own cache (the
// prefix is never recomputed). The serving engine's scheduler generalises this loop.
#pragma once
#include <cstdint>
#include <set>
#include <vector>

#include "engine/sampler.h"
#include "model/model.h"

namespace sparrow {

struct GenerateOptions {
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::set<int32_t> stop_token_ids;  // generation ends after emitting one of these (it is kept)
};

std::vector<std::vector<int32_t>> generate(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& options);

// End-of-sequence ids from a model folder: generation_config.json's eos_token_id if present, else
// config.json's (an int or a list).
std::set<int32_t> eos_token_ids(const std::string& model_dir);

}  // namespace sparrow
