// The request streams `sparrow bench serve` sends, deterministic from a seed (docs/bench.md):
//
//   random   vLLM's random dataset: input / output lengths uniform in [L(1-r), L(1+r)], an optional shared
//            prefix, prompt text of random tokens.
//   random-mm  vLLM's random multimodal dataset: the random prompts, each with images of random pixels (JPEG data
//            URLs, as vLLM's benchmark sends them), their count and sizes drawn as vLLM draws them.
//   agentic  multi-turn sessions shaped on public descriptions of coding-agent traces (SemiAnalysis
//            AgentX): one system prompt and tool schemas, then turns that each send the whole growing
//            conversation and get a short answer; a tool result or a user message is appended between
//            turns, with a think time. The recorded assistant messages are synthetic (as AgentX feeds back
//            recorded responses), so the conversation does not depend on what the server generates.
//
// Every draw goes through Rng, whose algorithms are written here (the standard library's distributions
// differ between implementations), so a seed gives the same workload everywhere.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace sparrow::bench {

using Json = nlohmann::ordered_json;

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0);
  double uniform();                            // [0, 1)
  int64_t integer(int64_t lo, int64_t hi);     // inclusive
  double normal();                             // standard normal (Box-Muller)
  double gamma(double shape, double scale);    // Marsaglia-Tsang
  void fill(uint8_t* out, size_t n);           // n random bytes
  // A lognormal draw given by its median and log-space spread, rounded and clamped to [lo, hi].
  int64_t lognormal(double median, double sigma, int64_t lo, int64_t hi);

 private:
  std::mt19937_64 engine_;  // its output sequence is fixed by the C++ standard
};

// Random text of a given token count. With a tokenizer: random vocabulary tokens (whole UTF-8 characters,
// no special tokens), decoded, re-encoded and trimmed until the text is exactly that many tokens (vLLM's
// method, so the lengths are exact). Without: common English words, one per token, with a leading
// space; an estimate (the server's usage counts are then the lengths reported).
class TextMaker {
 public:
  explicit TextMaker(std::shared_ptr<const Tokenizer> tokenizer);
  // With `before`, the text is made to follow it: before + text is count(before) + tokens tokens.
  std::string make(Rng& rng, int64_t tokens, const std::string& before = "") const;
  // The token count of `text`: exact with a tokenizer, else `estimate`.
  int64_t count(const std::string& text, int64_t estimate) const;
  bool exact() const { return tokenizer_ != nullptr; }

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::vector<int32_t> allowed_;  // token ids that decode to whole characters
};

// One request of a job.
struct WorkItem {
  std::string prompt;       // random: the prompt (the user message for chat)
  size_t messages = 0;      // agentic: this turn sends the session's first `messages` messages
  int64_t prompt_len = 0;   // client-side count (exact with a tokenizer; chat templates add more)
  int64_t output_len = 0;   // max_tokens
  double think_time_s = 0;  // pause before sending (agentic turns after the first)
  std::vector<std::string> images;  // random-mm: data: URLs, sent as image_url parts after the prompt
};

// What one concurrency slot runs start to finish: a random prompt, or a session's turns in order.
struct Job {
  std::vector<WorkItem> requests;
  Json messages = nullptr, tools = nullptr;  // agentic: the whole conversation and the tool schemas
};

struct RandomOptions {
  int64_t num_prompts = 1000, input_len = 1024, output_len = 128, prefix_len = 0;
  double range_ratio = 0;
  uint64_t seed = 0;
};
std::vector<Job> random_workload(const RandomOptions& options, const TextMaker& text);

// random-mm (vLLM's RandomMultiModalDataset): each prompt gets a count of images drawn uniformly from
// [floor(n (1 - r)), ceil(n (1 + r))], at most `image_limit`, each of a size drawn from the buckets by probability
// (normalised; buckets of more than one frame are videos, which sparrow does not send: refused unless their
// probability is 0).
struct ImageBucket {
  int64_t height = 0, width = 0, frames = 1;
  double probability = 0;
};
struct RandomMmOptions {
  int64_t base_items = 1;         // --random-mm-base-items-per-request
  double items_range_ratio = 0;   // --random-mm-num-mm-items-range-ratio
  int64_t image_limit = 255;      // --random-mm-limit-mm-per-prompt's "image"
  std::vector<ImageBucket> buckets = {{256, 256, 1, 0.5}, {720, 1280, 1, 0.5}, {720, 1280, 16, 0.0}};
};
// --random-mm-bucket-config as vLLM writes it, a Python dict with tuple keys: "{(256, 256, 1): 0.5, ...}".
std::vector<ImageBucket> parse_image_buckets(const std::string& text);
// --random-mm-limit-mm-per-prompt: '{"image": N, "video": M}'; the image count (videos are never sent).
int64_t parse_image_limit(const std::string& json);
std::vector<Job> random_mm_workload(const RandomOptions& options, const RandomMmOptions& mm, const TextMaker& text);

struct AgenticOptions {
  int64_t sessions = 16;
  int64_t max_turns = 100;          // requests per session at most
  int64_t max_context = 131072;     // a session ends before a turn whose prompt + output would pass this
  int64_t system_len = 3000;        // system prompt + tool schemas, tokens
  int64_t append_len = 600;         // median tool result, tokens (user messages: a third of it)
  int64_t output_len = 150;         // median output, tokens
  double think_time_ms = 1000;      // median pause between turns
  uint64_t seed = 0;
};
std::vector<Job> agentic_workload(const AgenticOptions& options, const TextMaker& text);

// Start offsets (seconds) of n arrivals at `rate` per second: all 0 for an infinite rate, else gamma
// gaps of shape `burstiness` (1: a Poisson process; below 1 burstier, above 1 more even) with mean
// 1/rate, scaled so the last arrival is at n/rate, as vLLM's get_request does.
std::vector<double> arrival_times(int64_t n, double rate, double burstiness, uint64_t seed);

}  // namespace sparrow::bench
