// Turning logits into the next token. Temperature 0 is greedy (argmax, ties to the smaller id);
// otherwise the logits are divided by the temperature, cut to the top_k largest and to the smallest
// set whose probability reaches top_p (vLLM's order: top-k, then top-p), and one token is drawn with
// the sequence's own random generator, so the same seed gives the same tokens alone or in a batch.
#pragma once
#include <cstdint>
#include <optional>
#include <random>

namespace sparrow {

struct SamplingParams {
  float temperature = 1.0f;
  float top_p = 1.0f;  // (0, 1]
  int64_t top_k = 0;   // 0 or -1: disabled
  std::optional<uint64_t> seed;
};

// Checks ranges; throws sparrow::Error naming the bad parameter.
void validate(const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

int32_t argmax(const float* logits, int64_t n);

}  // namespace sparrow
