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
//   vllm:request_prompt_tokens, vllm:request_generation_tokens.
// sparrow's engine-loop counters (EngineStats' StepCounters), for the serving benchmark's account of where
//   time goes: sparrow:{decode,prefill}_steps_total, sparrow:{decode,prefill}_step_seconds_total (whole
//   steps) and sparrow:{decode,prefill}_forward_seconds_total (batch ready to tokens sampled).
#pragma once
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
};

class ServerMetrics {
 public:
  ServerMetrics(std::string model_name, int64_t max_model_len);

  void observe_time_to_first_token(double seconds) { ttft_.observe(seconds); }
  void observe_inter_token_latency(double seconds) { itl_.observe(seconds); }
  // One finished choice: its end-to-end latency, its time per output token (after the first; skipped
  // when it produced fewer than 2 tokens), its token counts and finish reason.
  void observe_finished(double e2e_seconds, double time_to_first_token_seconds, int64_t prompt_tokens,
                        int64_t generation_tokens, const std::string& finish_reason);

  std::string render(const EngineGauges& engine) const;

 private:
  std::string labels_;  // model_name="..."
  Histogram ttft_, itl_, e2e_, tpot_, prompt_tokens_, generation_tokens_;
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> finished_by_reason_;
};

// Escapes a Prometheus label value (backslash, double quote, newline).
std::string escape_label_value(const std::string& value);

}  // namespace sparrow::server
