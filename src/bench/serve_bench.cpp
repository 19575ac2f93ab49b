#include "bench/serve_bench.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "bench/serve_client.h"
#include "core/error.h"

namespace sparrow::bench {
namespace {

// Without --max-concurrency every request may be in flight at once; each takes a thread, so this caps
// the threads (and the concurrency) of an unbounded run.
constexpr int64_t kMaxWorkers = 1024;
constexpr int64_t kWarmupOutputTokens = 16;  // output tokens of a warm-up request at most

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t end; (end = text.find(separator, begin)) != std::string::npos; begin = end + 1)
    parts.push_back(text.substr(begin, end - begin));
  parts.push_back(text.substr(begin));
  return parts;
}

std::vector<double> parse_percentiles(const std::string& text) {
  std::vector<double> out;
  for (const std::string& part : split(text, ',')) {
    char* end = nullptr;
    const double p = std::strtod(part.c_str(), &end);
    SPARROW_CHECK(!part.empty() && *end == '\0' && p >= 0 && p <= 100, "--metric-percentiles: '", part,
                  "' is not a percentile in [0, 100]");
    out.push_back(p);
  }
  return out;
}

std::vector<std::string> parse_metric_names(const std::string& text) {
  std::vector<std::string> names = split(text, ',');
  for (const std::string& name : names)
    SPARROW_CHECK(name == "ttft" || name == "tpot" || name == "itl" || name == "e2el", "--percentile-metrics: '",
                  name, "' is not one of ttft, tpot, itl, e2el");
  return names;
}

struct ServerCounters {
  std::optional<PrefixCacheCounters> prefix_cache;
  std::optional<EngineStepCounters> engine_steps;
  std::optional<SpecDecodeCounters> spec_decode;
};

ServerCounters scrape_counters(ServeConnection& metrics, const std::string& path) {
  std::optional<std::string> page = metrics.get(path);
  if (!page) return {};
  return {parse_prefix_cache_counters(*page), parse_engine_step_counters(*page), parse_spec_decode_counters(*page)};
}

// vLLM's default result name: <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json.
std::string result_path(const ServeBenchOptions& o, const std::string& backend, const RunInfo& info) {
  std::string name = o.result_filename;
  if (name.empty()) {
    std::string model = info.model_id;
    while (!model.empty() && model.back() == '/') model.pop_back();
    model = model.substr(model.find_last_of('/') == std::string::npos ? 0 : model.find_last_of('/') + 1);
    char rate[32];
    std::snprintf(rate, sizeof rate, "%g", o.request_rate);
    name = (o.label.empty() ? backend : o.label) + "-" + rate + "qps" +
           (o.max_concurrency > 0 ? "-concurrency" + std::to_string(o.max_concurrency) : "") + "-" + model + "-" +
           info.date + ".json";
  }
  if (o.result_dir.empty()) return name;
  std::filesystem::create_directories(o.result_dir);
  return (std::filesystem::path(o.result_dir) / name).string();
}

}  // namespace

std::string now_stamp() {
  std::time_t t = std::time(nullptr);
  std::tm local{};
  localtime_r(&t, &local);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &local);
  return buf;
}

std::string request_body(const Job& job, const WorkItem& item, bool chat, const std::string& model,
                         const ServeBenchOptions& o) {
  Json body = {{"model", model}};
  if (chat) {
    Json messages = Json::array();
    if (job.messages.is_array())
      for (size_t i = 0; i < item.messages && i < job.messages.size(); ++i) messages.push_back(job.messages[i]);
    else if (item.images.empty())
      messages.push_back({{"role", "user"}, {"content", item.prompt}});
    else {  // random-mm: the text, then the images (vLLM's order)
      Json content = Json::array({{{"type", "text"}, {"text", item.prompt}}});
      for (const std::string& url : item.images) content.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
      messages.push_back({{"role", "user"}, {"content", std::move(content)}});
    }
    body["messages"] = std::move(messages);
    if (!job.tools.is_null()) {
      body["tools"] = job.tools;
      // The schemas are rendered into the prompt; "none" needs no tool parser on the server (vLLM and
      // sparrow refuse "auto" without one) and the answers are not acted on anyway.
      body["tool_choice"] = "none";
    }
    body["max_completion_tokens"] = item.output_len;
  } else {
    body["prompt"] = item.prompt;
    body["max_tokens"] = item.output_len;
  }
  body["temperature"] = o.temperature;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (o.ignore_eos) {  // vLLM's extension, and min_tokens for servers that only know that one
    body["ignore_eos"] = true;
    body["min_tokens"] = item.output_len;
  }
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Json run_serve_benchmark(const ServeBenchOptions& o) {
  // cpp-httplib writes with plain send(): a server that drops a connection mid-request would raise
  // SIGPIPE and end the run instead of failing that one request.
  std::signal(SIGPIPE, SIG_IGN);
  const bool agentic = o.dataset_name == "agentic", images = o.dataset_name == "random-mm";
  SPARROW_CHECK(agentic || images || o.dataset_name == "random", "--dataset-name must be random, random-mm or agentic, "
                "not '", o.dataset_name, "'");
  const std::string backend = o.backend.empty() ? (agentic || images ? "openai-chat" : "openai") : o.backend;
  SPARROW_CHECK(backend == "openai" || backend == "openai-chat", "--backend must be openai or openai-chat");
  SPARROW_CHECK(!agentic || backend == "openai-chat",
                "the agentic workload is multi-turn chat: use --backend openai-chat (or leave --backend out)");
  SPARROW_CHECK(!images || backend == "openai-chat",
                "random-mm sends images in chat messages: use --backend openai-chat (or leave --backend out)");
  const bool chat = backend == "openai-chat";
  const std::string endpoint = !o.endpoint.empty() ? o.endpoint : chat ? "/v1/chat/completions" : "/v1/completions";
  SPARROW_CHECK(o.max_concurrency >= 0, "--max-concurrency must not be negative");
  RunInfo info;
  info.slos = parse_slos(o.goodput);
  info.metric_percentiles = parse_percentiles(o.metric_percentiles);
  info.percentile_metrics = parse_metric_names(o.percentile_metrics);

  const BaseUrl url = parse_base_url(o.base_url);
  ServeConnection server(url, o.api_key);
  std::string why;
  std::optional<std::string> models = server.get("/v1/models", &why);
  std::string model = o.model;
  int64_t max_model_len = 0;
  if (models) {
    nlohmann::json list = nlohmann::json::parse(*models, nullptr, /*allow_exceptions=*/false);
    if (list.is_object() && list.contains("data") && list["data"].is_array() && !list["data"].empty()) {
      const nlohmann::json& first = list["data"][0];
      if (model.empty() && first.contains("id") && first["id"].is_string()) model = first["id"].get<std::string>();
      if (first.contains("max_model_len") && first["max_model_len"].is_number_integer())
        max_model_len = first["max_model_len"].get<int64_t>();
    }
  }
  SPARROW_CHECK(!model.empty(), "cannot read the served model from ", o.base_url, "/v1/models (",
                why.empty() ? "no model listed" : why, "); is the server up? --model names the model");

  std::shared_ptr<const Tokenizer> tokenizer;
  if (!o.tokenizer.empty()) tokenizer = load_tokenizer(o.tokenizer);
  const TextMaker text(tokenizer);
  std::vector<Job> jobs;
  if (agentic) {
    AgenticOptions a = o.agentic;
    a.seed = o.seed;
    if (max_model_len > 0 && a.max_context > max_model_len) {
      std::printf("agentic: contexts capped at the server's max_model_len, %lld tokens\n", (long long)max_model_len);
      a.max_context = max_model_len;
    }
    jobs = agentic_workload(a, text);
  } else {
    RandomOptions r = o.random;
    r.seed = o.seed;
    jobs = images ? random_mm_workload(r, o.random_mm, text) : random_workload(r, text);
  }
  // One request of a job over a worker's connection; a failure is counted, never the end of the run.
  auto send = [&](ServeConnection& connection, const Job& job, const WorkItem& item, Clock::time_point since) {
    RequestResult r;
    try {
      r = connection.stream(endpoint, request_body(job, item, chat, model, o), chat, since, tokenizer.get());
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    return r;
  };
  SPARROW_CHECK(o.num_warmups >= 0, "--num-warmups must not be negative");
  if (o.num_warmups > 0) {
    // Warm-up requests (vLLM's --num-warmups), left out of every figure: the server's first steps at a
    // new batch size (CUDA graph capture, allocations, GEMM heuristics) are not the workload's. They are
    // the first requests of the same workload drawn with another seed, so that the measured prompts find
    // none of their prefixes cached by the warm-up, sent as many at once as the run will send, each
    // with a short output (kWarmupOutputTokens: a few decode steps at the batch size, not a whole run).
    std::vector<Job> warm;
    const uint64_t warm_seed = o.seed ^ 0x9e3779b97f4a7c15ull;
    if (agentic) {
      AgenticOptions a = o.agentic;
      a.seed = warm_seed;
      a.sessions = o.num_warmups;
      a.output_len = std::min<int64_t>(a.output_len, kWarmupOutputTokens);
      if (max_model_len > 0) a.max_context = std::min(a.max_context, max_model_len);
      warm = agentic_workload(a, text);
    } else {
      RandomOptions r = o.random;
      r.seed = warm_seed;
      r.num_prompts = o.num_warmups;
      r.output_len = std::min<int64_t>(r.output_len, kWarmupOutputTokens);
      warm = images ? random_mm_workload(r, o.random_mm, text) : random_workload(r, text);
    }
    std::atomic<size_t> next{0}, failed{0};
    auto warm_up = [&] {
      ServeConnection connection(url, o.api_key);
      for (size_t j; (j = next++) < warm.size();)
        if (!send(connection, warm[j], warm[j].requests[0], Clock::now()).success) ++failed;
    };
    std::vector<std::thread> senders;
    const int64_t width = std::min<int64_t>(o.num_warmups, o.max_concurrency > 0 ? o.max_concurrency : kMaxWorkers);
    for (int64_t w = 0; w < width; ++w) senders.emplace_back(warm_up);
    for (std::thread& t : senders) t.join();
    std::printf("Warm-up: %zu requests (%zu failed)\n", warm.size(), failed.load());
  }
  std::vector<size_t> first_result(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) first_result[j + 1] = first_result[j] + jobs[j].requests.size();
  const size_t total = first_result.back();
  if (agentic) {
    int64_t longest = 0;
    for (const Job& job : jobs) longest = std::max(longest, job.requests.back().prompt_len);
    std::printf("agentic: %zu sessions, %zu requests, contexts up to %lld tokens (%s)\n", jobs.size(), total,
                (long long)longest, text.exact() ? "local tokenizer count" : "estimated: no --tokenizer");
  }
  std::printf("Traffic request rate: %g\nBurstiness factor: %g (%s)\nMaximum request concurrency: %s\n",
              o.request_rate, o.burstiness, o.burstiness == 1 ? "Poisson process" : "Gamma distribution",
              o.max_concurrency > 0 ? std::to_string(o.max_concurrency).c_str() : "None");
  std::fflush(stdout);

  ServeConnection metrics(o.metrics_url.empty() ? url : parse_base_url(o.metrics_url), o.api_key);
  const std::string metrics_path = o.metrics_url.empty() ? "/metrics" : "";
  const ServerCounters before = scrape_counters(metrics, metrics_path);

  // Jobs start at their arrival times, each on the next free worker: with every worker busy a job waits,
  // as it waits for vLLM's concurrency semaphore.
  const std::vector<double> arrivals = arrival_times(int64_t(jobs.size()), o.request_rate, o.burstiness, o.seed);
  const int64_t workers =
      std::min<int64_t>(int64_t(jobs.size()), o.max_concurrency > 0 ? o.max_concurrency : kMaxWorkers);
  std::vector<RequestResult> results(total);
  std::atomic<size_t> next_job{0}, finished{0};
  const Clock::time_point start = Clock::now();
  auto work = [&] {
    ServeConnection connection(url, o.api_key);  // kept alive across this worker's requests
    for (size_t j; (j = next_job++) < jobs.size();) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(arrivals[j])));
      for (size_t k = 0; k < jobs[j].requests.size(); ++k) {
        const WorkItem& item = jobs[j].requests[k];
        if (item.think_time_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(item.think_time_s));
        RequestResult r = send(connection, jobs[j], item, start);
        if (r.prompt_len < 0) r.prompt_len = item.prompt_len;
        if (agentic) {
          r.session = int64_t(j);
          r.turn = int64_t(k);
        }
        results[first_result[j] + k] = std::move(r);
        ++finished;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) threads.emplace_back(work);
  std::atomic<bool> all_done{false};
  std::thread progress([&] {  // a progress line, on a terminal only
    if (!o.progress || !isatty(STDERR_FILENO)) return;
    while (!all_done) {
      std::fprintf(stderr, "\r%zu/%zu requests", finished.load(), total);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    std::fprintf(stderr, "\r%zu/%zu requests\n", finished.load(), total);
  });
  for (std::thread& t : threads) t.join();
  info.duration = std::chrono::duration<double>(Clock::now() - start).count();
  all_done = true;
  progress.join();

  const ServerCounters after = scrape_counters(metrics, metrics_path);
  if (before.prefix_cache && after.prefix_cache)
    info.prefix_cache = PrefixCacheCounters{after.prefix_cache->queries - before.prefix_cache->queries,
                                            after.prefix_cache->hits - before.prefix_cache->hits};
  if (before.engine_steps && after.engine_steps) info.engine_steps = *after.engine_steps - *before.engine_steps;
  if (before.spec_decode && after.spec_decode) info.spec_decode = *after.spec_decode - *before.spec_decode;
  info.backend = backend;
  info.base_url = o.base_url;
  info.endpoint = endpoint;
  info.model_id = model;
  info.tokenizer_id = o.tokenizer;
  info.dataset_name = o.dataset_name;
  info.date = now_stamp();
  info.request_rate = o.request_rate;
  info.burstiness = o.burstiness;
  info.max_concurrency = o.max_concurrency;
  info.seed = o.seed;
  Json result = result_json(info, results);

  int shown = 0;
  for (const RequestResult& r : results)
    if (!r.success && shown < 10) {
      if (shown == 0) std::printf("Failed requests during benchmark run detected (capping to 10):\n");
      std::printf("Error %d: %s\n", shown++, r.error.c_str());
    }
  std::printf("%s", summary_text(info, result).c_str());
  if (o.save_result) {
    const std::string path = result_path(o, backend, info);
    std::ofstream out(path);
    SPARROW_CHECK(out, "cannot write the result file ", path);
    out << result.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    std::printf("Saved the result to %s\n", path.c_str());
  }
  std::fflush(stdout);
  return result;
}

}  // namespace sparrow::bench
