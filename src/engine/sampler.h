// Turning a sequence's logits into its next token, in vLLM's order (vllm/v1/sample/sampler.py):
//   1. the ids that end generation are masked until min_tokens tokens exist;
//   2. penalties: repetition (over prompt + output), frequency and presence (over output only);
//   3. temperature 0 (below 1e-5): greedy, argmax with ties to the smaller id; otherwise
//   4. divide by the temperature, keep the top_k largest, drop tokens below min_p times the top
//      probability, keep the smallest set whose probability reaches top_p, and draw one token with a
//      key from the sequence's own generator (seeded: the same seed gives the same tokens alone or in a
//      batch).
// Before step 1, logit_bias is added (vLLM's LogitBiasLogitsProcessor, also before the penalties); after
// step 2 a structured output's grammar and allowed_token_ids leave only their tokens (a token bitmask: the
// engine's sequences hold the grammar matcher, structured/matcher.h).
// Steps 1-2 become LogitAdjustments and 3-4 a TokenDraw (kernels/sampling_rule.h, which defines them
// exactly); ops::sample_tokens carries them out for a whole batch on the CPU or the GPU.
// Logprobs are not computed here: vLLM returns those of the raw model logits (logprobs.h).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/sampling_rule.h"
#include "structured/spec.h"

namespace sparrow {

struct SamplingParams {
  float temperature = 1.0f;
  float top_p = 1.0f;  // (0, 1]
  float min_p = 0.0f;  // [0, 1]
  int64_t top_k = 0;   // 0 or -1: disabled
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;  // >= 1
  int64_t min_tokens = 0;   // end tokens are masked (and stop strings ignored) until this many exist
  bool ignore_eos = false;
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  std::vector<int32_t> stop_token_ids;
  bool include_stop_str_in_output = false;
  int64_t logprobs = -1;         // -1: none; k >= 0: the sampled token's logprob and the top k
  int64_t prompt_logprobs = -1;  // -1: none; k >= 0: each prompt token's logprob and the top k
  int64_t n = 1;                 // independent choices
  bool skip_special_tokens = true;
  // What the output must be (JSON schema, regex, choice, grammar): structured/spec.h.
  structured::StructuredOutputSpec structured;
  std::vector<std::pair<int32_t, float>> logit_bias;       // token, added to its logit ([-100, 100])
  std::optional<std::vector<int32_t>> allowed_token_ids;  // only these may be drawn (non-empty)
};

// OpenAI's range of a logit_bias value.
inline constexpr float kMaxLogitBias = 100.0f;

// vLLM's default --max-logprobs: the largest logprobs / prompt_logprobs accepted.
inline constexpr int64_t kMaxLogprobs = 20;

// Checks every range; throws sparrow::Error naming the bad parameter.
void validate(const SamplingParams& params);

// Step 2 for row `row` (vLLM apply_all_penalties): a token seen in the prompt or the output has its
// logit divided by repetition_penalty when positive, multiplied when not; then
// logit -= frequency_penalty * (times in output) + presence_penalty * (in output at all).
// With `masked` ids (step 1), those become -inf. One adjustment per token.
void penalty_adjustments(int32_t row, const SamplingParams& params, std::span<const int32_t> prompt,
                         std::span<const int32_t> output, std::span<const int32_t> masked,
                         std::vector<LogitAdjustment>& adjustments);
// The same applied to a row of host logits in place.
void apply_penalties(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                     std::span<const int32_t> output);

class Sampler {
 public:
  // `end_tokens`: the ids that end generation (eos unless ignore_eos, and stop_token_ids); they are
  // masked until min_tokens tokens were generated. Without a seed the generator starts at random.
  explicit Sampler(const SamplingParams& params, std::vector<int32_t> end_tokens = {});

  // The draw of a sequence's output token number output.size(), whose tokens so far are prompt + output, as
  // row `row` of a batch: appends its draw and its adjustments. The draw's key depends only on the
  // generator's seed and the output position, never on how many draws came before: a token is drawn with
  // the same key whether it is sampled alone, in a batch, after a preemption's recompute, or while
  // verifying speculative draft tokens (where rejected drafts must not use up keys); so a seeded request
  // gives the same text with speculation as without (engine/speculative.h).
  void prepare(int32_t row, std::span<const int32_t> prompt, std::span<const int32_t> output,
               std::vector<TokenDraw>& draws, std::vector<LogitAdjustment>& adjustments);

  // The key output token `output_index` is drawn with (what prepare puts in its draw).
  uint64_t key(int64_t output_index) const { return key_at(uint64_t(output_index)); }

  // A token from one row of host logits (prepare + the CPU reference); each call draws with the next key.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> prompt = {},
                 std::span<const int32_t> output = {});

 private:
  void prepare_at(uint64_t key_index, int32_t row, std::span<const int32_t> prompt, std::span<const int32_t> output,
                  std::vector<TokenDraw>& draws, std::vector<LogitAdjustment>& adjustments) const;
  // SplitMix64's stream from the seed: the key of draw `index`.
  uint64_t key_at(uint64_t index) const { return mix64(stream_ + index * 0x9E3779B97F4A7C15ull); }

  SamplingParams params_;
  std::vector<int32_t> end_tokens_;
  uint64_t stream_;
  uint64_t calls_ = 0;  // sample()'s draws so far
};

int32_t argmax(std::span<const float> logits);

}  // namespace sparrow
