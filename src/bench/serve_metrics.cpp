#include "bench/serve_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <set>

#include "core/error.h"

namespace sparrow::bench {
namespace {

struct Metric {
  const char* key;     // ttft, tpot, itl, e2el
  const char* name;    // as printed
  const char* header;  // the summary's section title
};
const Metric kMetrics[] = {{"ttft", "TTFT", "Time to First Token"},
                           {"tpot", "TPOT", "Time per Output Token (excl. 1st token)"},
                           {"itl", "ITL", "Inter-token Latency"},
                           {"e2el", "E2EL", "End-to-end Latency"}};

// "99", "99.9": how vLLM names a percentile in its keys (p99_ttft_ms) and summary (P99 TTFT).
std::string percentile_word(double p) {
  char buf[32];
  if (p == std::floor(p))
    std::snprintf(buf, sizeof buf, "%lld", (long long)p);
  else
    std::snprintf(buf, sizeof buf, "%g", p);
  return buf;
}

// The percentiles reported: p90 and p99 always, plus those asked for.
std::vector<double> reported_percentiles(const std::vector<double>& asked) {
  std::set<double> all(asked.begin(), asked.end());
  all.insert({90.0, 99.0});
  return {all.begin(), all.end()};
}

// Peak output tokens in any one-second bucket, counting each output chunk as a token (as vLLM does).
double peak_output_per_second(const std::vector<RequestResult>& done) {
  if (done.empty()) return 0;
  double first = done[0].start_time;
  for (const RequestResult& r : done) first = std::min(first, r.start_time);
  std::map<int64_t, double> buckets;
  for (const RequestResult& r : done) {
    double t = r.start_time + r.ttft;
    buckets[int64_t(t - first)] += 1;
    for (double gap : r.itl) buckets[int64_t((t += gap) - first)] += 1;
  }
  double peak = 0;
  for (const auto& [second, n] : buckets) peak = std::max(peak, n);
  return peak;
}

// The most requests in flight at once: a sweep over the half-open intervals [start, start + latency).
int64_t peak_concurrency(const std::vector<RequestResult>& done) {
  std::vector<std::pair<double, int>> events;
  for (const RequestResult& r : done) {
    events.push_back({r.start_time, +1});
    events.push_back({r.start_time + r.latency, -1});
  }
  std::sort(events.begin(), events.end());  // at equal times an end (-1) sorts before a start
  int64_t now = 0, peak = 0;
  for (const auto& [t, delta] : events) peak = std::max(peak, now += delta);
  return peak;
}

// One "name{labels} value" sample line: its name and value; false for comments and other lines.
bool parse_sample(const std::string& line, std::string& name, double& value, std::string* labels = nullptr) {
  if (line.empty() || line[0] == '#') return false;
  size_t i = 0;
  while (i < line.size() && line[i] != '{' && line[i] != ' ' && line[i] != '\t') ++i;
  name = line.substr(0, i);
  if (i < line.size() && line[i] == '{') {  // skip the labels; their values may hold '}' inside quotes
    const size_t open = i;
    bool quoted = false;
    for (++i; i < line.size() && (quoted || line[i] != '}'); ++i) {
      if (line[i] == '\\' && quoted) ++i;
      else if (line[i] == '"') quoted = !quoted;
    }
    if (labels) *labels = line.substr(open + 1, i - open - 1);
    ++i;
  }
  const char* start = line.c_str() + std::min(i, line.size());
  char* end = nullptr;
  value = std::strtod(start, &end);
  return end != start;
}

// Calls `sample(name, labels, value)` for every sample line of a Prometheus text page (`labels`: the text
// between the braces, empty without).
void for_each_labelled_sample(const std::string& text,
                              const std::function<void(const std::string&, const std::string&, double)>& sample) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string name, labels;
    double value = 0;
    if (parse_sample(text.substr(begin, end - begin), name, value, &labels)) sample(name, labels, value);
    begin = end + 1;
  }
}

// The same, labels skipped.
void for_each_sample(const std::string& text, const std::function<void(const std::string&, double)>& sample) {
  for_each_labelled_sample(text, [&](const std::string& name, const std::string&, double value) { sample(name, value); });
}

void line(std::string& out, const std::string& label, const std::string& value) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-40s %-10s\n", label.c_str(), value.c_str());
  out += buf;
}

std::string fixed2(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

std::string centered(const std::string& title, char fill) {
  const size_t width = 50, left = title.size() < width ? (width - title.size()) / 2 : 0;
  std::string out(left, fill);
  out += title;
  if (out.size() < width) out.append(width - out.size(), fill);
  return out + "\n";
}

}  // namespace

double percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double rank = p / 100.0 * double(sorted.size() - 1);
  const size_t lo = size_t(std::floor(rank)), hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - double(lo));
}

Summary summarize(std::vector<double> values, const std::vector<double>& percentiles) {
  Summary s;
  std::sort(values.begin(), values.end());
  if (!values.empty()) {
    s.mean = std::accumulate(values.begin(), values.end(), 0.0) / double(values.size());
    double squares = 0;
    for (double v : values) squares += (v - s.mean) * (v - s.mean);
    s.std = std::sqrt(squares / double(values.size()));
  }
  s.median = percentile(values, 50);
  for (double p : percentiles) s.percentiles.push_back({p, percentile(values, p)});
  return s;
}

Slos parse_slos(const std::vector<std::string>& pairs) {
  Slos slos;
  for (const std::string& pair : pairs) {
    const size_t colon = pair.find(':');
    const std::string name = pair.substr(0, colon);
    char* end = nullptr;
    const double ms = colon == std::string::npos ? -1 : std::strtod(pair.c_str() + colon + 1, &end);
    SPARROW_CHECK(colon != std::string::npos && end && *end == '\0' && end != pair.c_str() + colon + 1,
                  "--goodput: '", pair, "' is not NAME:MILLISECONDS (e.g. ttft:500 tpot:50 e2el:10000)");
    SPARROW_CHECK(ms >= 0, "--goodput: the SLO of ", name, " must be non-negative");
    if (name == "ttft")
      slos.ttft_ms = ms;
    else if (name == "tpot")
      slos.tpot_ms = ms;
    else if (name == "e2el")
      slos.e2el_ms = ms;
    else
      fail("--goodput: unknown metric '", name, "' (use ttft, tpot or e2el)");
  }
  return slos;
}

double tpot_seconds(const RequestResult& r) {
  return r.output_len > 1 ? (r.latency - r.ttft) / double(r.output_len - 1) : 0.0;
}

bool meets_slos(const RequestResult& r, const Slos& slos) {
  return r.success && (!slos.ttft_ms || r.ttft * 1e3 <= *slos.ttft_ms) &&
         (!slos.tpot_ms || tpot_seconds(r) * 1e3 <= *slos.tpot_ms) &&
         (!slos.e2el_ms || r.latency * 1e3 <= *slos.e2el_ms);
}

std::optional<PrefixCacheCounters> parse_prefix_cache_counters(const std::string& text) {
  PrefixCacheCounters current, legacy;
  bool have_current = false, have_legacy = false;
  for_each_sample(text, [&](const std::string& name, double value) {
    if (name == "vllm:prefix_cache_queries_total") current.queries += value, have_current = true;
    if (name == "vllm:prefix_cache_hits_total") current.hits += value, have_current = true;
    if (name == "vllm:gpu_prefix_cache_queries_total") legacy.queries += value, have_legacy = true;
    if (name == "vllm:gpu_prefix_cache_hits_total") legacy.hits += value, have_legacy = true;
  });
  if (have_current) return current;  // servers exporting both names count the same tokens twice
  if (have_legacy) return legacy;
  return std::nullopt;
}

SpecDecodeCounters SpecDecodeCounters::operator-(const SpecDecodeCounters& o) const {
  SpecDecodeCounters d{drafts - o.drafts, draft_tokens - o.draft_tokens, accepted_tokens - o.accepted_tokens,
                       accepted_by_position};
  for (size_t i = 0; i < d.accepted_by_position.size() && i < o.accepted_by_position.size(); ++i)
    d.accepted_by_position[i] -= o.accepted_by_position[i];
  return d;
}

std::optional<SpecDecodeCounters> parse_spec_decode_counters(const std::string& text) {
  SpecDecodeCounters c;
  bool any = false;
  for_each_labelled_sample(text, [&](const std::string& name, const std::string& labels, double value) {
    if (name == "vllm:spec_decode_num_drafts_total") c.drafts += value, any = true;
    if (name == "vllm:spec_decode_num_draft_tokens_total") c.draft_tokens += value;
    if (name == "vllm:spec_decode_num_accepted_tokens_total") c.accepted_tokens += value;
    if (name == "vllm:spec_decode_num_accepted_tokens_per_pos_total") {
      const size_t at = labels.find("position=\"");
      if (at == std::string::npos) return;
      const size_t position = size_t(std::strtoul(labels.c_str() + at + 10, nullptr, 10));
      if (position >= 1024) return;
      if (c.accepted_by_position.size() <= position) c.accepted_by_position.resize(position + 1);
      c.accepted_by_position[position] += value;
    }
  });
  if (!any) return std::nullopt;
  return c;
}

Json spec_decode_json(const SpecDecodeCounters& c) {
  // vLLM's bench serve keys (vllm/benchmarks/serve.py): acceptance rate in percent, the mean acceptance length
  // 1 + accepted / drafts, and each position's rate among the drafts.
  Json j;
  j["spec_decode_num_drafts"] = c.drafts;
  j["spec_decode_draft_tokens"] = c.draft_tokens;
  j["spec_decode_accepted_tokens"] = c.accepted_tokens;
  j["spec_decode_acceptance_rate"] = c.draft_tokens > 0 ? Json(100 * c.accepted_tokens / c.draft_tokens) : Json(nullptr);
  j["spec_decode_acceptance_length"] = c.drafts > 0 ? Json(1 + c.accepted_tokens / c.drafts) : Json(nullptr);
  Json per_position = Json::array();
  for (double accepted : c.accepted_by_position) per_position.push_back(c.drafts > 0 ? accepted / c.drafts : 0.0);
  j["spec_decode_per_position_acceptance_rates"] = per_position;
  return j;
}

EngineStepCounters EngineStepCounters::operator-(const EngineStepCounters& o) const {
  return {decode_steps - o.decode_steps,   decode_seconds - o.decode_seconds,   decode_forward_seconds - o.decode_forward_seconds,
          prefill_steps - o.prefill_steps, prefill_seconds - o.prefill_seconds, prefill_forward_seconds - o.prefill_forward_seconds};
}

std::optional<EngineStepCounters> parse_engine_step_counters(const std::string& text) {
  EngineStepCounters c;
  const std::pair<const char*, double*> series[] = {
      {"sparrow:decode_steps_total", &c.decode_steps},
      {"sparrow:decode_step_seconds_total", &c.decode_seconds},
      {"sparrow:decode_forward_seconds_total", &c.decode_forward_seconds},
      {"sparrow:prefill_steps_total", &c.prefill_steps},
      {"sparrow:prefill_step_seconds_total", &c.prefill_seconds},
      {"sparrow:prefill_forward_seconds_total", &c.prefill_forward_seconds}};
  bool found = false;
  for_each_sample(text, [&](const std::string& name, double value) {
    for (const auto& [series_name, field] : series)
      if (name == series_name) *field += value, found = true;
  });
  return found ? std::optional(c) : std::nullopt;
}

// Per kind: steps, mean step and forward time in ms, and the host's share of the loop's time.
Json engine_steps_json(const EngineStepCounters& c) {
  auto kind = [](double steps, double seconds, double forward) {
    Json k = {{"steps", steps}};
    k["mean_step_ms"] = steps > 0 ? Json(1e3 * seconds / steps) : Json(nullptr);
    k["mean_forward_ms"] = steps > 0 ? Json(1e3 * forward / steps) : Json(nullptr);
    k["host_fraction"] = seconds > 0 ? Json(std::max(0.0, 1.0 - forward / seconds)) : Json(nullptr);
    k["seconds"] = seconds;
    return k;
  };
  return {{"decode", kind(c.decode_steps, c.decode_seconds, c.decode_forward_seconds)},
          {"prefill", kind(c.prefill_steps, c.prefill_seconds, c.prefill_forward_seconds)}};
}

Json result_json(const RunInfo& info, const std::vector<RequestResult>& results) {
  std::vector<RequestResult> done;
  for (const RequestResult& r : results)
    if (r.success) done.push_back(r);
  int64_t total_input = 0, total_output = 0, good = 0;
  std::vector<double> ttfts, tpots, itls, e2els;
  for (const RequestResult& r : done) {
    total_input += r.prompt_len;
    total_output += r.output_len;
    good += meets_slos(r, info.slos) ? 1 : 0;
    ttfts.push_back(r.ttft);
    if (r.output_len > 1) tpots.push_back(tpot_seconds(r));
    itls.insert(itls.end(), r.itl.begin(), r.itl.end());
    e2els.push_back(r.latency);
  }
  const double seconds = info.duration > 0 ? info.duration : 1e-9;

  Json j;
  j["date"] = info.date;
  j["backend"] = info.backend;
  j["endpoint"] = info.endpoint;
  j["base_url"] = info.base_url;
  j["model_id"] = info.model_id;
  j["tokenizer_id"] = info.tokenizer_id.empty() ? Json(nullptr) : Json(info.tokenizer_id);
  j["dataset_name"] = info.dataset_name;
  j["num_prompts"] = results.size();
  j["request_rate"] = std::isinf(info.request_rate) ? Json("inf") : Json(info.request_rate);
  j["burstiness"] = info.burstiness;
  j["max_concurrency"] = info.max_concurrency > 0 ? Json(info.max_concurrency) : Json(nullptr);
  j["seed"] = info.seed;
  j["duration"] = info.duration;
  j["completed"] = done.size();
  j["failed"] = results.size() - done.size();
  j["total_input_tokens"] = total_input;
  j["total_output_tokens"] = total_output;
  j["request_throughput"] = double(done.size()) / seconds;
  j["request_goodput"] = info.slos.any() ? Json(double(good) / seconds) : Json(nullptr);
  j["input_throughput"] = double(total_input) / seconds;
  j["output_throughput"] = double(total_output) / seconds;
  j["total_token_throughput"] = double(total_input + total_output) / seconds;
  j["max_output_tokens_per_s"] = peak_output_per_second(done);
  j["max_concurrent_requests"] = peak_concurrency(done);
  const auto& prefix = info.prefix_cache;
  j["prefix_cache_queries"] = prefix ? Json(prefix->queries) : Json(nullptr);
  j["prefix_cache_hits"] = prefix ? Json(prefix->hits) : Json(nullptr);
  j["prefix_cache_hit_rate"] = prefix && prefix->queries > 0 ? Json(prefix->hits / prefix->queries) : Json(nullptr);
  j["engine_steps"] = info.engine_steps ? engine_steps_json(*info.engine_steps) : Json(nullptr);
  if (info.spec_decode) j.update(spec_decode_json(*info.spec_decode));
  if (info.slos.any()) {
    Json slos = Json::object();
    if (info.slos.ttft_ms) slos["ttft"] = *info.slos.ttft_ms;
    if (info.slos.tpot_ms) slos["tpot"] = *info.slos.tpot_ms;
    if (info.slos.e2el_ms) slos["e2el"] = *info.slos.e2el_ms;
    j["goodput_slos_ms"] = slos;
  }

  const std::vector<double> percentiles = reported_percentiles(info.metric_percentiles);
  const std::vector<double>* values[] = {&ttfts, &tpots, &itls, &e2els};
  for (size_t m = 0; m < 4; ++m) {
    const std::string key = kMetrics[m].key;
    Summary s = summarize(*values[m], percentiles);
    j["mean_" + key + "_ms"] = s.mean * 1e3;
    j["median_" + key + "_ms"] = s.median * 1e3;
    j["std_" + key + "_ms"] = s.std * 1e3;
    for (const auto& [p, v] : s.percentiles) j["p" + percentile_word(p) + "_" + key + "_ms"] = v * 1e3;
  }

  Json input_lens = Json::array(), output_lens = Json::array(), ttft_list = Json::array(), itl_list = Json::array(),
       latencies = Json::array(), start_times = Json::array(), errors = Json::array();
  bool agentic = false;
  for (const RequestResult& r : results) {
    input_lens.push_back(r.prompt_len);
    output_lens.push_back(r.success ? r.output_len : 0);
    ttft_list.push_back(r.ttft);
    itl_list.push_back(r.itl);
    latencies.push_back(r.latency);
    start_times.push_back(r.start_time);
    errors.push_back(r.error);
    agentic = agentic || r.session >= 0;
  }
  j["input_lens"] = std::move(input_lens);
  j["output_lens"] = std::move(output_lens);
  j["ttfts"] = std::move(ttft_list);
  j["itls"] = std::move(itl_list);
  j["latencies"] = std::move(latencies);
  j["start_times"] = std::move(start_times);
  j["errors"] = std::move(errors);
  if (agentic) {
    Json sessions = Json::array(), turns = Json::array();
    for (const RequestResult& r : results) {
      sessions.push_back(r.session);
      turns.push_back(r.turn);
    }
    j["session_ids"] = std::move(sessions);
    j["turn_ids"] = std::move(turns);
  }
  return j;
}

std::string summary_text(const RunInfo& info, const Json& j) {
  std::string out = centered(" Serving Benchmark Result ", '=');
  auto integer = [&](const char* key) { return std::to_string(j[key].get<int64_t>()); };
  line(out, "Successful requests:", integer("completed"));
  line(out, "Failed requests:", integer("failed"));
  if (info.max_concurrency > 0) line(out, "Maximum request concurrency:", std::to_string(info.max_concurrency));
  if (!std::isinf(info.request_rate)) line(out, "Request rate configured (RPS):", fixed2(info.request_rate));
  line(out, "Benchmark duration (s):", fixed2(info.duration));
  line(out, "Total input tokens:", integer("total_input_tokens"));
  line(out, "Total generated tokens:", integer("total_output_tokens"));
  line(out, "Request throughput (req/s):", fixed2(j["request_throughput"]));
  if (info.slos.any()) line(out, "Request goodput (req/s):", fixed2(j["request_goodput"]));
  line(out, "Input token throughput (tok/s):", fixed2(j["input_throughput"]));
  line(out, "Output token throughput (tok/s):", fixed2(j["output_throughput"]));
  line(out, "Peak output token throughput (tok/s):", fixed2(j["max_output_tokens_per_s"]));
  line(out, "Peak concurrent requests:", integer("max_concurrent_requests"));
  line(out, "Total token throughput (tok/s):", fixed2(j["total_token_throughput"]));
  if (!j["prefix_cache_hit_rate"].is_null())
    line(out, "Prefix cache hit rate (%):", fixed2(100 * j["prefix_cache_hit_rate"].get<double>()));
  if (j.contains("spec_decode_acceptance_length") && !j["spec_decode_acceptance_length"].is_null()) {
    out += "---------------Speculative Decoding---------------\n";
    line(out, "Acceptance rate (%):", fixed2(j["spec_decode_acceptance_rate"].get<double>()));
    line(out, "Acceptance length:", fixed2(j["spec_decode_acceptance_length"].get<double>()));
    line(out, "Drafts:", std::to_string(int64_t(j["spec_decode_num_drafts"].get<double>())));
    line(out, "Draft tokens:", std::to_string(int64_t(j["spec_decode_draft_tokens"].get<double>())));
    line(out, "Accepted tokens:", std::to_string(int64_t(j["spec_decode_accepted_tokens"].get<double>())));
  }
  const std::vector<double> percentiles = reported_percentiles(info.metric_percentiles);
  for (const Metric& m : kMetrics) {
    const std::string key = m.key;
    if (std::find(info.percentile_metrics.begin(), info.percentile_metrics.end(), key) ==
        info.percentile_metrics.end())
      continue;
    out += centered(m.header, '-');
    line(out, std::string("Mean ") + m.name + " (ms):", fixed2(j["mean_" + key + "_ms"]));
    line(out, std::string("Median ") + m.name + " (ms):", fixed2(j["median_" + key + "_ms"]));
    for (double p : percentiles) {
      const std::string word = percentile_word(p);
      line(out, "P" + word + " " + m.name + " (ms):", fixed2(j["p" + word + "_" + key + "_ms"]));
    }
  }
  return out + std::string(50, '=') + "\n";
}

}  // namespace sparrow::bench
