// What the text commands (generate --prompt, chat, perplexity) share: the model's context length, a
// text's prompt ids, and a token-by-token generation loop that hands each token over as it is sampled
// (for streaming to the terminal).
#pragma once
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::cli {

// Samples up to `max_tokens` tokens after `prompt` (one sequence, its own cache: prefill, then one
// forward per token) and calls on_token(id) for each, end token included; stops after a token of
// `end_tokens` or at `context` positions. Returns the generated ids.
std::vector<int32_t> generate_streaming(Model& model, const std::vector<int32_t>& prompt,
                                        const SamplingParams& sampling, const std::set<int32_t>& end_tokens,
                                        int64_t max_tokens, int64_t context,
                                        const std::function<void(int32_t)>& on_token);

// Writes text to stdout at once (streaming output must not wait for a newline).
void write_now(const std::string& text);

}  // namespace sparrow::cli
