// /metrics: the server's counters and latency histograms in the Prometheus text format, under vLLM's
// metric names (vllm docs/design/metrics.md) so existing dashboards work unchanged. Every series
// carries the label model_name="<served model name>".
//
// Gauges (from Engine::stats() at scrape time): vllm:num_requests_running, vllm:num_requests_waiting,
//   vllm:kv_cache_usage_perc (0..1), and sparrow:kv_cache_blocks_used / sparrow:kv_cache_blocks_total.
// Counters: vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
//   vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens, from the engine), and
//   vllm:request_success_total{finished_reason=stop|length|abort} (from the server).
// Histograms (measured by the server): vllm:time_to_first_token_seconds (arrival to first token),
//   vllm:inter_token_latency_seconds (between tokens of one request), vllm:e2e_request_latency_seconds,
//   vllm:request_time_per_output_token_seconds (per request: decode time / (tokens - 1)),
//   vllm:request_prompt_tokens, vllm:request_generation_tokens; per finished choice the phases
//   vllm:request_queue_time_seconds (arrival to first scheduled), vllm:request_prefill_time_seconds (first
//   scheduled to first token), vllm:request_decode_time_seconds (first to last token),
//   vllm:request_inference_time_seconds (first scheduled to last token); per request
//   vllm:request_params_n, vllm:request_params_max_tokens and, once all its choices finished,
//   vllm:request_max_num_generation_tokens; per engine step vllm:iteration_tokens_total (from the engine).
// Info: vllm:cache_config_info (value 1; the cache settings as labels).
// sparrow's engine-loop counters (EngineStats' StepCounters), for the serving benchmark's account of where
//   time goes: sparrow:{decode,prefill}_steps_total, sparrow:{decode,prefill}_step_seconds_total (whole
//   steps) and sparrow:{decode,prefill}_forward_seconds_total (batch ready to tokens sampled).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace sparrow::server {

// A cumulative histogram with fixed upper bounds (plus +Inf). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // Appends the _bucket / _sum / _count lines; `labels` is the label list without braces.
  void render(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; one more for +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What the engine reports at scrape time (a copy of Engine::Stats, so this file does not need the
// engine).
struct EngineGauges {
  struct Steps {
    int64_t steps = 0;
    double seconds = 0, forward_seconds = 0;
  };
  int64_t running = 0, waiting = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0;
  int64_t prefix_queries = 0, prefix_hits = 0, preemptions = 0;
  int64_t prompt_tokens_total = 0, generation_tokens_total = 0;
  Steps decode, prefill;  // EngineStats' step counters
  std::array<int64_t, 32> iteration_steps_by_log2{};  // EngineStats' IterationTokens
  int64_t iteration_tokens = 0;
  std::vector<int64_t> requests_by_group;  // data parallel: EngineStats' (empty otherwise)
  // Speculative decoding (EngineStats' SpecDecodeStats); reported when the server speculates.
  bool speculative = false;
  int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_by_position;
  // Images: EngineStats' encoder cache counters and the vision tower's seconds.
  int64_t mm_cache_queries = 0, mm_cache_hits = 0;
  double encoder_seconds = 0;
  // Prefill/decode disaggregation (EngineStats' KvTransferStats); reported with --kv-transfer-config.
  bool kv_transfer = false;
  int64_t kv_offers = 0, kv_offers_fetched = 0, kv_offers_failed = 0, kv_fetches = 0, kv_fetches_failed = 0;
  int64_t kv_fetched_messages = 0, kv_fetched_bytes = 0;
  double kv_fetch_seconds = 0;
};

// The cache settings vllm:cache_config_info reports.
struct CacheInfo {
  int64_t block_size = 0;
  std::string cache_dtype, indexer_kv_dtype;
  bool enable_prefix_caching = true;
};

class ServerMetrics {
 public:
  ServerMetrics(std::string model_name, int64_t max_model_len, CacheInfo cache = {});

  void observe_time_to_first_token(double seconds) { ttft_.observe(seconds); }
  void observe_inter_token_latency(double seconds) { itl_.observe(seconds); }
  // One finished choice: its end-to-end latency, its time per output token (after the first; skipped
  // when it produced fewer than 2 tokens), its token counts and finish reason.
  void observe_finished(double e2e_seconds, double time_to_first_token_seconds, int64_t prompt_tokens,
                        int64_t generation_tokens, const std::string& finish_reason);
  // A finished choice's phases, in seconds (see above).
  void observe_phases(double queue, double prefill, double decode, double inference);
  // A request at arrival: its choices per prompt and its max_tokens.
  void observe_request(int64_t n, int64_t max_tokens);
  // A request whose choices all finished: the most tokens one of them generated.
  void observe_max_generation_tokens(int64_t tokens) { max_generation_tokens_.observe(double(tokens)); }

  std::string render(const EngineGauges& engine) const;

 private:
  std::string labels_;  // model_name="..."
  CacheInfo cache_;
  Histogram ttft_, itl_, e2e_, tpot_, prompt_tokens_, generation_tokens_;
  Histogram queue_, prefill_, decode_, inference_, params_n_, params_max_tokens_, max_generation_tokens_;
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> finished_by_reason_;
};

// Escapes a Prometheus label value (backslash, double quote, newline).
std::string escape_label_value(const std::string& value);

}  // namespace sparrow::server
