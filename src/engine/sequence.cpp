#include "engine/sequence.h"

namespace sparrow {

namespace {
SamplingParams choice_params(const SamplingParams& params, int64_t index) {
  SamplingParams p = params;
  if (p.seed) *p.seed += uint64_t(index);
  return p;
}
}  // namespace

Sequence::Sequence(const Request& request, int64_t index, std::vector<int32_t> end_tokens, const Tokenizer* tokenizer)
    : request(request),
      index(index),
      prompt_length(int64_t(request.prompt.size())),
      tokens(request.prompt),
      sampler(choice_params(request.params, index), std::move(end_tokens)) {
  if (tokenizer) detokenizer.emplace(*tokenizer, request.params.stop);
  state.lora = request.lora;
  wants_prompt_logprobs = index == 0 && request.params.prompt_logprobs >= 0;
  if (wants_prompt_logprobs) prompt_logprobs.resize(prompt_length);
}

}  // namespace sparrow
