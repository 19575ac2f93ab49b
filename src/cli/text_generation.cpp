#include "cli/text_generation.h"

#include "cli/commands.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "kernels/ops.h"

namespace sparrow::cli {

std::vector<int32_t> generate_streaming(Model& model, const std::vector<int32_t>& prompt,
                                        const SamplingParams& sampling, const std::set<int32_t>& end_tokens,
                                        int64_t max_tokens, int64_t context,
                                        const std::function<void(int32_t)>& on_token) {
  SPARROW_CHECK(!prompt.empty(), "the prompt is empty (it tokenizes to no tokens)");
  SPARROW_CHECK(int64_t(prompt.size()) < context, "the prompt has ", prompt.size(),
                " tokens, more than the model's context of ", context, " leaves room for");
  for (int32_t id : prompt)
    SPARROW_CHECK(id >= 0 && id < model.vocab_size(), "prompt token ", id, " is outside the model's vocabulary (",
                  model.vocab_size(), ")");
  Sampler sampler(sampling, std::vector<int32_t>(end_tokens.begin(), end_tokens.end()));
  ModelRunner runner(model, cli_runner_options());
  SequenceState state = runner.new_sequence();
  std::vector<int32_t> output;
  std::vector<int32_t> next_input = prompt;
  const int64_t room = std::min(max_tokens, context - int64_t(prompt.size()));
  while (int64_t(output.size()) < room) {
    Batch batch = make_batch({{&state, next_input}});
    batch.all_logits = false;  // only the last position's logits are sampled
    Tensor logits = runner.run(batch);  // [1, vocab] where the model runs
    std::vector<TokenDraw> draws;
    std::vector<LogitAdjustment> adjustments;
    sampler.prepare(0, prompt, output, draws, adjustments);
    const int32_t token = ops::sample_tokens(logits, draws, adjustments)[0];
    output.push_back(token);
    on_token(token);
    if (end_tokens.count(token)) break;
    next_input = {token};
  }
  return output;
}

void write_now(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace sparrow::cli
