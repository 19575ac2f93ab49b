// `sparrow bench serve`: a load generator for any OpenAI-compatible server, with vLLM's
// `vllm bench serve` flags and metrics (docs/bench.md). It builds the workload (workloads.h), sends it
// with the requested arrival process and concurrency (serve_client.h), reads the server's prefix-cache
// counters from /metrics before and after, and reports the statistics (serve_metrics.h).
#pragma once
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "bench/serve_metrics.h"
#include "bench/workloads.h"

namespace sparrow::bench {

struct ServeBenchOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint;           // empty: /v1/completions (openai) or /v1/chat/completions (openai-chat)
  std::string backend;            // openai | openai-chat; empty: openai-chat for agentic, else openai
  std::string model;              // empty: the first model of GET /v1/models
  std::string tokenizer;          // a model folder whose tokenizer counts tokens locally; empty: none
  std::string dataset_name = "random";  // random | random-mm | agentic
  std::string metrics_url;        // empty: <base-url>/metrics
  std::string api_key;            // sent as a bearer token when not empty
  RandomOptions random;
  RandomMmOptions random_mm;
  AgenticOptions agentic;
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  int64_t max_concurrency = 0;    // 0: no limit
  int64_t num_warmups = 0;        // untimed requests first (vLLM's --num-warmups)
  uint64_t seed = 0;
  bool ignore_eos = false;
  double temperature = 0;
  std::vector<std::string> goodput;               // "ttft:MS" ...
  std::string percentile_metrics = "ttft,tpot,itl";
  std::string metric_percentiles = "99";
  bool save_result = false;
  std::string result_dir, result_filename, label;
  bool progress = true;
};

// Local time as YYYYMMDD-HHMMSS: the result files' "date" and default names (as vLLM's).
std::string now_stamp();

// Runs the benchmark, prints the summary on stdout, writes the result file when asked, and returns the
// result JSON. Bad options and an unreachable server are sparrow::Errors; failed requests are counted.
Json run_serve_benchmark(const ServeBenchOptions& options);

// The JSON body of one request of a job (exposed for the tests).
std::string request_body(const Job& job, const WorkItem& item, bool chat, const std::string& model,
                         const ServeBenchOptions& options);

}  // namespace sparrow::bench
