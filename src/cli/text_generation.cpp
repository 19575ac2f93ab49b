#include "cli/text_generation.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace sparrow::cli {

std::vector<int32_t> generate_streaming(Model& model, const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options, int64_t context,
                                        const std::function<void(int32_t)>& on_token) {
  // Checked here rather than by the engine: its messages speak of requests, these of the text typed
  // and the model's context.
  SPARROW_CHECK(!prompt.empty(), "the prompt is empty (it tokenizes to no tokens)");
  SPARROW_CHECK(int64_t(prompt.size()) < context, "the prompt has ", prompt.size(),
                " tokens, more than the model's context of ", context, " leaves room for");
  for (int32_t id : prompt)
    SPARROW_CHECK(id >= 0 && id < model.vocab_size(), "prompt token ", id, " is outside the model's vocabulary (",
                  model.vocab_size(), ")");
  GenerateOptions within_context = options;
  within_context.max_tokens = std::min(options.max_tokens, context - int64_t(prompt.size()));
  std::vector<int32_t> output;
  generate(model, {prompt}, within_context, [&](size_t, int32_t token) {
    output.push_back(token);
    on_token(token);
  });
  return output;
}

void write_now(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace sparrow::cli
