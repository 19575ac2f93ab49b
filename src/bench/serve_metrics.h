// The statistics of `sparrow bench serve`, defined as vLLM's `vllm bench serve` defines them
// (vllm/benchmarks/serve.py, calculate_metrics), and its result JSON under vLLM's --save-result field
// names so the same tools read both:
//
//   TTFT  send to the first chunk that carries output text
//   ITL   the gaps between successive chunks that carry output (all requests' gaps pooled)
//   TPOT  per request (E2EL - TTFT) / (output tokens - 1), for requests with more than one token
//   E2EL  send to the end of the stream
//   goodput  requests per second that met every given SLO (a request with one token has TPOT 0)
//
// Percentiles interpolate linearly between order statistics (numpy's default); std is the population
// standard deviation. Latencies are kept in seconds and reported in milliseconds.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/workloads.h"

namespace sparrow::bench {

// What one request measured.
struct RequestResult {
  bool success = false;
  std::string error;        // why it failed
  int64_t prompt_len = 0;   // input tokens: the server's usage when given, else the client's count
  int64_t output_len = 0;   // output tokens: the server's usage, else the local tokenizer, else chunks
  double ttft = 0;          // seconds
  std::vector<double> itl;  // seconds
  double latency = 0;       // E2EL, seconds
  double start_time = 0;    // seconds after the benchmark started
  int64_t session = -1, turn = -1;  // agentic only
};

// p in [0, 100] of `sorted` (ascending), numpy's linear interpolation; 0 for an empty list.
double percentile(const std::vector<double>& sorted, double p);

struct Summary {
  double mean = 0, median = 0, std = 0;
  std::vector<std::pair<double, double>> percentiles;  // (p, value)
};
Summary summarize(std::vector<double> values, const std::vector<double>& percentiles);

// --goodput ttft:MS tpot:MS e2el:MS
struct Slos {
  std::optional<double> ttft_ms, tpot_ms, e2el_ms;
  bool any() const { return ttft_ms || tpot_ms || e2el_ms; }
};
Slos parse_slos(const std::vector<std::string>& pairs);

double tpot_seconds(const RequestResult& r);  // 0 with fewer than 2 output tokens
bool meets_slos(const RequestResult& r, const Slos& slos);

// Prefix-cache counters scraped from a Prometheus /metrics page: vLLM's (and sparrow's)
// vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (in tokens), or the older
// vllm:gpu_prefix_cache_*; summed over label sets. Empty when the page has neither.
struct PrefixCacheCounters {
  double queries = 0, hits = 0;
};
std::optional<PrefixCacheCounters> parse_prefix_cache_counters(const std::string& prometheus_text);

// sparrow's engine-loop counters (server/metrics.h): steps of each kind, their time, and the part of it
// from the batch being ready to the sampled tokens (the rest is host work). Empty for other servers.
struct EngineStepCounters {
  double decode_steps = 0, decode_seconds = 0, decode_forward_seconds = 0;
  double prefill_steps = 0, prefill_seconds = 0, prefill_forward_seconds = 0;
  EngineStepCounters operator-(const EngineStepCounters& o) const;
};
std::optional<EngineStepCounters> parse_engine_step_counters(const std::string& prometheus_text);

// Speculative decoding's counters (vLLM's vllm:spec_decode_*, sparrow's the same): summed over label sets,
// accepted tokens by draft position. Empty when the server reports none.
struct SpecDecodeCounters {
  double drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  std::vector<double> accepted_by_position;
  SpecDecodeCounters operator-(const SpecDecodeCounters& o) const;
};
std::optional<SpecDecodeCounters> parse_spec_decode_counters(const std::string& prometheus_text);

// What the run was, for the result file and the summary.
struct RunInfo {
  std::string backend, base_url, endpoint, model_id, tokenizer_id, dataset_name, date;
  double request_rate = 0, burstiness = 1;
  int64_t max_concurrency = 0;  // 0: none
  uint64_t seed = 0;
  double duration = 0;          // seconds
  std::optional<PrefixCacheCounters> prefix_cache;  // the change over the run
  std::optional<EngineStepCounters> engine_steps;   // the change over the run (sparrow servers)
  std::optional<SpecDecodeCounters> spec_decode;    // the change over the run (servers that speculate)
  std::vector<std::string> percentile_metrics;      // printed in the summary
  std::vector<double> metric_percentiles;           // besides p90 and p99, which are always reported
  Slos slos;
};

// The result JSON: vLLM's save-result fields (completed, failed, total_input_tokens, ...,
// mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..., input_lens, output_lens, ttfts, itls,
// latencies, start_times, errors) plus input_throughput, p90 of every metric, the prefix-cache
// counters and hit rate, vLLM's spec_decode_* keys when the server speculates, and for agentic runs the session and turn of every request.
Json result_json(const RunInfo& info, const std::vector<RequestResult>& results);
// The one-screen summary, in vLLM's layout, from a result_json.
std::string summary_text(const RunInfo& info, const Json& result);

}  // namespace sparrow::bench
