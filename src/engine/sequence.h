// One choice of a request as it moves through the engine: waiting -> running -> finished, and back to
// waiting when preempted (its cache is dropped; its tokens, prompt and generated, are recomputed when it
// runs again, and its sampler and detokenizer carry on where they were).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cache/kv_cache.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "structured/matcher.h"
#include "tokenizer/detokenizer.h"

namespace sparrow {

enum class SequenceStatus { Waiting, Running, Finished };

struct Sequence {
  // `request` must outlive the sequence. Choice i of a seeded request draws with seed + i.
  // `end_tokens`: the ids that end it (eos unless ignore_eos, and stop_token_ids); `tokenizer` may be
  // null (no text).
  Sequence(const Request& request, int64_t index, std::vector<int32_t> end_tokens, const Tokenizer* tokenizer);

  const Request& request;
  const int64_t index;
  const int64_t prompt_length;
  std::vector<int32_t> tokens;  // the prompt, then the generated tokens
  // Speculative decoding (engine/speculative.h): tokens guessed to follow `tokens`, run and verified in the
  // sequence's next step after its pending tokens; never part of `tokens` until the target confirms them.
  std::vector<int32_t> draft;
  // Probabilistic drafts: the distribution each was drawn from (draft.size() rows of vocabulary size, flat);
  // empty for deterministic ones.
  std::vector<float> draft_probs;
  // Keeps the first n draft tokens (and their distributions).
  void truncate_draft(size_t n) {
    if (n >= draft.size()) return;
    if (!draft_probs.empty()) draft_probs.resize(draft_probs.size() / draft.size() * n);
    draft.resize(n);
  }

  SequenceStatus status = SequenceStatus::Waiting;
  // While running: the KvCache sequence and the model's handle on it. state.length counts the tokens
  // whose rows are in the cache (computed, or reused from the prefix cache).
  SeqId cache_id = -1;
  SequenceState state;

  Sampler sampler;
  std::optional<IncrementalDetokenizer> detokenizer;
  // Structured output: the grammar's state after the generated tokens (advanced only when a token is
  // sampled, so a preempted sequence's recompute does not feed it again). Null without one.
  std::unique_ptr<structured::GrammarMatcher> matcher;
  // allowed_token_ids as token bitmask words (ops::TokenBitmask); null without them.
  std::shared_ptr<const std::vector<uint32_t>> allowed_tokens;
  // Filled as prefill chunks run (choice 0 only, when asked for); sent with the first token.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  bool wants_prompt_logprobs = false;
  int64_t cached_tokens = 0;  // prompt tokens the prefix cache served at first admission
  std::optional<std::chrono::steady_clock::time_point> first_scheduled;  // RequestOutput::first_scheduled
  bool admitted_before = false;

  const SamplingParams& params() const { return request.params; }
  int64_t num_computed() const { return state.length; }
  int64_t num_pending() const { return int64_t(tokens.size()) - state.length; }  // tokens to run
  std::span<const int32_t> prompt() const { return {tokens.data(), size_t(prompt_length)}; }
  std::span<const int32_t> output() const {
    return {tokens.data() + prompt_length, tokens.size() - size_t(prompt_length)};
  }
  int64_t num_output() const { return int64_t(tokens.size()) - prompt_length; }
};

}  // namespace sparrow
