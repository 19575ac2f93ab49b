#include "server/metrics.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace sparrow::server {
namespace {

// Latency buckets in seconds, spanning a fast CPU model (milliseconds) to long generations.
const std::vector<double> kFirstTokenBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,  0.75,
                                                1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0};
const std::vector<double> kInterTokenBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,
                                                0.4,   0.5,   0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 80.0};
const std::vector<double> kRequestBuckets = {0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,
                                             10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 1920.0};

// vLLM's buckets for vllm:request_params_n and vllm:iteration_tokens_total.
const std::vector<double> kParamsNBuckets = {1, 2, 5, 10, 20};
const std::vector<int> kIterationTokensLog2 = {0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};  // 1, 8, ..., 16384

// 1, 2, 5, 10, 20, 50, ... up to `limit` (how vLLM sizes its token-count histograms).
std::vector<double> one_two_five_buckets(int64_t limit) {
  std::vector<double> out;
  for (double scale = 1;; scale *= 10)
    for (double mantissa : {1.0, 2.0, 5.0}) {
      if (mantissa * scale > double(std::max<int64_t>(limit, 1))) return out;
      out.push_back(mantissa * scale);
    }
}

// The shortest decimal that reads back as `v` ("0.1", not "0.10000000000000001"), as Prometheus clients
// print their numbers.
std::string number(double v) {
  char buf[64];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double value) {
  out += name + "{" + labels + "} " + number(value) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();  // first bound >= value
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    sample(out, name + "_bucket", labels + ",le=\"" + le + "\"", double(cumulative));
  }
  sample(out, name + "_sum", labels, sum_);
  sample(out, name + "_count", labels, double(count_));
}

std::string escape_label_value(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

ServerMetrics::ServerMetrics(std::string model_name, int64_t max_model_len, CacheInfo cache)
    : labels_("model_name=\"" + escape_label_value(model_name) + "\""),
      cache_(std::move(cache)),
      ttft_(kFirstTokenBuckets),
      itl_(kInterTokenBuckets),
      e2e_(kRequestBuckets),
      tpot_(kInterTokenBuckets),
      prompt_tokens_(one_two_five_buckets(max_model_len)),
      generation_tokens_(one_two_five_buckets(max_model_len)),
      queue_(kRequestBuckets),
      prefill_(kRequestBuckets),
      decode_(kRequestBuckets),
      inference_(kRequestBuckets),
      params_n_(kParamsNBuckets),
      params_max_tokens_(one_two_five_buckets(max_model_len)),
      max_generation_tokens_(one_two_five_buckets(max_model_len)) {}

void ServerMetrics::observe_phases(double queue, double prefill, double decode, double inference) {
  queue_.observe(queue);
  prefill_.observe(prefill);
  decode_.observe(decode);
  inference_.observe(inference);
}

void ServerMetrics::observe_request(int64_t n, int64_t max_tokens) {
  params_n_.observe(double(n));
  params_max_tokens_.observe(double(max_tokens));
}

void ServerMetrics::observe_finished(double e2e_seconds, double time_to_first_token_seconds, int64_t prompt_tokens,
                                     int64_t generation_tokens, const std::string& finish_reason) {
  e2e_.observe(e2e_seconds);
  if (generation_tokens >= 2)
    tpot_.observe((e2e_seconds - time_to_first_token_seconds) / double(generation_tokens - 1));
  prompt_tokens_.observe(double(prompt_tokens));
  generation_tokens_.observe(double(generation_tokens));
  std::lock_guard<std::mutex> lock(mutex_);
  ++finished_by_reason_[finish_reason];
}

std::string ServerMetrics::render(const EngineGauges& engine) const {
  std::string out;
  auto gauge = [&](const char* name, const char* help, double value) {
    header(out, name, "gauge", help);
    sample(out, name, labels_, value);
  };
  // Prometheus clients name a counter's samples <name>_total; the TYPE line carries the base name.
  auto counter = [&](const std::string& base, const char* help, double value) {
    header(out, base, "counter", help);
    sample(out, base + "_total", labels_, value);
  };
  gauge("vllm:num_requests_running", "Number of requests in the running batch.", double(engine.running));
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.", double(engine.waiting));
  gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
        engine.kv_blocks_total > 0 ? double(engine.kv_blocks_used) / double(engine.kv_blocks_total) : 0.0);
  gauge("sparrow:kv_cache_blocks_used", "KV-cache blocks held by requests.", double(engine.kv_blocks_used));
  gauge("sparrow:kv_cache_blocks_total", "KV-cache blocks in the pool.", double(engine.kv_blocks_total));
  counter("vllm:prompt_tokens", "Prompt tokens processed.", double(engine.prompt_tokens_total));
  counter("vllm:generation_tokens", "Tokens generated.", double(engine.generation_tokens_total));
  counter("vllm:num_preemptions", "Requests preempted (to be recomputed) for lack of KV-cache blocks.",
          double(engine.preemptions));
  counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", double(engine.prefix_queries));
  counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", double(engine.prefix_hits));
  counter("vllm:mm_cache_queries", "Images whose embeddings a step needed.", double(engine.mm_cache_queries));
  counter("vllm:mm_cache_hits", "Images whose embeddings the encoder cache held.", double(engine.mm_cache_hits));
  counter("sparrow:encoder_seconds", "Seconds the vision tower spent embedding images.", engine.encoder_seconds);
  if (engine.kv_transfer) {
    // docs/disaggregation.md: a prefill instance's offers, a decode instance's fetches (one message a block row).
    counter("sparrow:kv_transfer_offers", "Prompt caches offered to decode instances.", double(engine.kv_offers));
    counter("sparrow:kv_transfer_offers_fetched", "Offers a decode instance fetched.", double(engine.kv_offers_fetched));
    counter("sparrow:kv_transfer_offers_failed", "Offers that expired or whose fetch failed.", double(engine.kv_offers_failed));
    counter("sparrow:kv_transfer_fetches", "Fetches of a prefill instance's cache started.", double(engine.kv_fetches));
    counter("sparrow:kv_transfer_fetches_failed", "Fetches that failed.", double(engine.kv_fetches_failed));
    counter("sparrow:kv_transfer_fetched_messages", "Block rows and states fetched, one message each.",
            double(engine.kv_fetched_messages));
    counter("sparrow:kv_transfer_fetched_bytes", "Bytes fetched.", double(engine.kv_fetched_bytes));
    counter("sparrow:kv_transfer_fetch_seconds", "Seconds from a fetch's request to its last byte, summed.",
            engine.kv_fetch_seconds);
  }
  if (!engine.requests_by_group.empty()) {
    // Data parallel (docs/parallel.md): how the server balanced the requests over the groups' engines.
    header(out, "sparrow:data_parallel_requests", "counter", "Requests handed to each data-parallel group's engine.");
    for (size_t g = 0; g < engine.requests_by_group.size(); ++g)
      sample(out, "sparrow:data_parallel_requests_total", labels_ + ",group=\"" + std::to_string(g) + "\"",
             double(engine.requests_by_group[g]));
  }
  if (engine.speculative) {
    // vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py): the mean acceptance length is
    // 1 + accepted_tokens / drafts, the acceptance rate accepted_tokens / draft_tokens.
    counter("vllm:spec_decode_num_drafts", "Verify steps of a request with at least one draft token.",
            double(engine.spec_drafts));
    counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", double(engine.spec_draft_tokens));
    counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", double(engine.spec_accepted_tokens));
    header(out, "vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted, by draft position.");
    for (size_t i = 0; i < engine.spec_accepted_by_position.size(); ++i)
      sample(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", labels_ + ",position=\"" + std::to_string(i) + "\"",
             double(engine.spec_accepted_by_position[i]));
  }
  for (const auto& [kind, steps] : {std::pair{"decode", engine.decode}, std::pair{"prefill", engine.prefill}}) {
    const std::string base = std::string("sparrow:") + kind;
    counter(base + "_steps", "Engine steps of this kind.", double(steps.steps));
    counter(base + "_step_seconds", "Engine-loop time of these steps, scheduling to the last event.", steps.seconds);
    counter(base + "_forward_seconds", "Time of these steps from the batch being ready to the tokens being sampled.",
            steps.forward_seconds);
  }

  header(out, "vllm:request_success", "counter", "Finished requests (choices) by finish reason.");
  {
    std::map<std::string, uint64_t> by_reason = {{"stop", 0}, {"length", 0}, {"abort", 0}};
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [reason, n] : finished_by_reason_) by_reason[reason] = n;
    for (const auto& [reason, n] : by_reason)
      sample(out, "vllm:request_success_total", labels_ + ",finished_reason=\"" + escape_label_value(reason) + "\"",
             double(n));
  }

  auto histogram = [&](const Histogram& h, const char* name, const char* help) {
    header(out, name, "histogram", help);
    h.render(out, name, labels_);
  };
  histogram(ttft_, "vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.");
  histogram(itl_, "vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.");
  histogram(e2e_, "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.");
  histogram(tpot_, "vllm:request_time_per_output_token_seconds", "Per request: decode time per output token.");
  histogram(prompt_tokens_, "vllm:request_prompt_tokens", "Prompt length of finished requests, in tokens.");
  histogram(generation_tokens_, "vllm:request_generation_tokens", "Generated tokens of finished requests.");
  histogram(queue_, "vllm:request_queue_time_seconds", "Time from arrival to first being scheduled.");
  histogram(prefill_, "vllm:request_prefill_time_seconds", "Time from first being scheduled to the first token.");
  histogram(decode_, "vllm:request_decode_time_seconds", "Time from the first token to the last.");
  histogram(inference_, "vllm:request_inference_time_seconds", "Time from first being scheduled to the last token.");
  histogram(params_n_, "vllm:request_params_n", "The n of each request.");
  histogram(params_max_tokens_, "vllm:request_params_max_tokens", "The max_tokens of each request.");
  histogram(max_generation_tokens_, "vllm:request_max_num_generation_tokens",
            "Per request: the most tokens one of its choices generated.");

  // vllm:iteration_tokens_total, a histogram over engine steps (the engine counts them by powers of two,
  // and every bound here is one, so each cumulative count is exact).
  header(out, "vllm:iteration_tokens_total", "histogram", "Tokens per engine step.");
  {
    int64_t steps = 0;
    for (int64_t n : engine.iteration_steps_by_log2) steps += n;
    for (int k : kIterationTokensLog2) {
      int64_t at_most = 0;
      for (int i = 0; i <= k; ++i) at_most += engine.iteration_steps_by_log2[size_t(i)];
      sample(out, "vllm:iteration_tokens_total_bucket", labels_ + ",le=\"" + number(double(int64_t(1) << k)) + "\"",
             double(at_most));
    }
    sample(out, "vllm:iteration_tokens_total_bucket", labels_ + ",le=\"+Inf\"", double(steps));
    sample(out, "vllm:iteration_tokens_total_sum", labels_, double(engine.iteration_tokens));
    sample(out, "vllm:iteration_tokens_total_count", labels_, double(steps));
  }

  header(out, "vllm:cache_config_info", "gauge", "The KV cache's settings, as labels.");
  sample(out, "vllm:cache_config_info",
         labels_ + ",block_size=\"" + std::to_string(cache_.block_size) + "\",cache_dtype=\"" +
             escape_label_value(cache_.cache_dtype) + "\",enable_prefix_caching=\"" +
             (cache_.enable_prefix_caching ? "True" : "False") + "\",indexer_kv_dtype=\"" +
             escape_label_value(cache_.indexer_kv_dtype) + "\",num_gpu_blocks=\"" +
             std::to_string(engine.kv_blocks_total) + "\"",
         1.0);
  return out;
}

}  // namespace sparrow::server
