// What the text commands (generate --prompt, chat, perplexity) share: the model's context length, a
// text's prompt ids, and generation that hands each token over as it is sampled (for streaming to the
// terminal).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::cli {

// Generates after `prompt` through the engine (engine/generate.h: one request, a cache just big enough)
// and calls on_token(id) for each token as it is sampled, a stop token included: up to
// options.max_tokens tokens, fewer when a stop token comes or the sequence reaches `context` positions.
// A prompt that is empty, leaves no room in the context or holds ids outside the vocabulary is a one-line
// error naming the command-line cause. Returns the generated ids.
std::vector<int32_t> generate_streaming(Model& model, const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options, int64_t context,
                                        const std::function<void(int32_t)>& on_token);

// Writes text to stdout at once (streaming output must not wait for a newline).
void write_now(const std::string& text);

}  // namespace sparrow::cli
