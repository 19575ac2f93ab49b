#include "bench/sweep.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace sparrow::bench {

namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string last_lines(const std::string& text, int n) {
  size_t pos = text.size();
  while (n-- > 0 && pos > 0) {
    const size_t nl = text.rfind('\n', pos - 1);
    if (nl == std::string::npos) return text;
    pos = nl;
  }
  return text.substr(pos);
}

bool has_flag(const std::vector<std::string>& args, const std::string& flag) {
  for (const std::string& a : args)
    if (a == flag || a.starts_with(flag + "=")) return true;
  return false;
}

std::string flag_value(const std::vector<std::string>& args, const std::string& flag) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag && i + 1 < args.size()) return args[i + 1];
    if (args[i].starts_with(flag + "=")) return args[i].substr(flag.size() + 1);
  }
  return "";
}

// `sparrow serve <launch args>` as a child process; stopped (SIGTERM, then SIGKILL after a minute) when
// this goes out of scope.
class LaunchedServer {
 public:
  LaunchedServer(const std::string& binary, std::vector<std::string> args, const std::string& log, double timeout_s) {
    if (!has_flag(args, "--port")) args.insert(args.end(), {"--port", "0"});
    if (!has_flag(args, "--disable-log-requests")) args.push_back("--disable-log-requests");
    if (!has_flag(args, "--shutdown-timeout")) args.insert(args.end(), {"--shutdown-timeout", "5"});
    std::vector<std::string> argv_strings = {binary, "serve"};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::string command;
    for (const std::string& s : argv_strings) command += (command.empty() ? "" : " ") + s;
    std::printf("sweep: launching %s (log: %s)\n", command.c_str(), log.c_str());
    std::fflush(stdout);

    pid_ = fork();
    SPARROW_CHECK(pid_ >= 0, "--launch: cannot fork");
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
      }
      execv(argv[0], argv.data());
      _exit(127);
    }
    std::string host = flag_value(args, "--host");
    if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
    const std::regex started(R"(on http://[^\s:]+:(\d+))");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      const std::string text = slurp(log);
      std::smatch m;
      if (std::regex_search(text, m, started)) {
        base_url_ = "http://" + host + ":" + m[1].str();
        return;
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        fail("--launch: sparrow serve exited before it listened; the end of ", log, ":", last_lines(text, 5));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    stop();
    fail("--launch: sparrow serve did not listen within ", timeout_s, " s (--launch-timeout); see ", log);
  }
  ~LaunchedServer() { stop(); }
  LaunchedServer(const LaunchedServer&) = delete;
  LaunchedServer& operator=(const LaunchedServer&) = delete;

  const std::string& base_url() const { return base_url_; }

  void stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 600; ++i) {  // a minute
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  std::string base_url_;
};

double number(const Json& j, const char* key, double fallback = 0) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : fallback;
}

Json copy_numbers(const Json& from, std::initializer_list<const char*> keys) {
  Json out = Json::object();
  for (const char* key : keys)
    if (from.contains(key)) out[key] = from[key];
  return out;
}

// A roofline step over the server's layout, per GPU.
Json roofline_json(const ModelCost& cost, int64_t batch, double context, double total_over_output,
                   const HardwareLimits& hw, const ParallelLayout& layout) {
  const DecodeStep step = decode_roofline(cost, batch, context, hw, layout);
  Json j = to_json(step);
  // Prefill counted free: each output token brings its share of the input along.
  j["total_tokens_per_s_per_gpu"] = step.tokens_per_s_per_gpu * total_over_output;
  return j;
}

// The serving limit (prefill + decode over a request cycle, roofline.h) over the layout, per GPU.
Json serving_json(const ModelCost& cost, int64_t batch, double input_len, double output_len, const HardwareLimits& hw,
                  const ParallelLayout& layout) {
  return to_json(serving_roofline(cost, batch, input_len, output_len, hw, layout));
}

// The roofline's layout: the options', else the launched server's -tp / -dp, else num_gpus-way TP.
ParallelLayout sweep_layout(const SweepOptions& o, const std::vector<std::string>& launch_args) {
  auto launched = [&](const char* long_flag, const char* short_flag) -> int64_t {
    std::string v = flag_value(launch_args, long_flag);
    if (v.empty()) v = flag_value(launch_args, short_flag);
    if (v.empty()) return 0;
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    SPARROW_CHECK(*end == '\0' && n > 0, "--launch: ", long_flag, " '", v, "' is not a positive integer");
    return n;
  };
  ParallelLayout layout;
  layout.data_parallel = o.data_parallel > 0 ? o.data_parallel : launched("--data-parallel-size", "-dp");
  if (layout.data_parallel == 0) layout.data_parallel = 1;
  layout.tensor_parallel = o.tensor_parallel > 0 ? o.tensor_parallel : launched("--tensor-parallel-size", "-tp");
  if (layout.tensor_parallel == 0)
    layout.tensor_parallel = o.num_gpus > 0 ? std::max<int64_t>(1, o.num_gpus / layout.data_parallel) : 1;
  SPARROW_CHECK(o.num_gpus == 0 || o.num_gpus == layout.gpus(), "--num-gpus ", o.num_gpus, " is not tensor parallel ",
                layout.tensor_parallel, " x data parallel ", layout.data_parallel, " (", layout.gpus(), " GPUs)");
  return layout;
}

}  // namespace

std::vector<int64_t> parse_concurrencies(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    char* end = nullptr;
    const long long c = std::strtoll(part.c_str(), &end, 10);
    SPARROW_CHECK(!part.empty() && *end == '\0' && c > 0, "--concurrencies: '", part,
                  "' is not a positive integer (e.g. 1,2,4,8)");
    out.push_back(c);
  }
  SPARROW_CHECK(!out.empty(), "--concurrencies: no concurrency given");
  return out;
}

std::vector<std::string> split_arguments(const std::string& text) {
  std::vector<std::string> out;
  std::string current;
  bool in_word = false;
  char quote = 0;
  for (char c : text) {
    if (quote) {
      if (c == quote) quote = 0;
      else current += c;
    } else if (c == '\'' || c == '"') {
      quote = c;
      in_word = true;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      if (in_word) out.push_back(current), current.clear(), in_word = false;
    } else {
      current += c;
      in_word = true;
    }
  }
  SPARROW_CHECK(!quote, "unterminated quote in '", text, "'");
  if (in_word) out.push_back(current);
  return out;
}

Json sweep_point(const Json& result, int64_t concurrency, int64_t num_gpus) {
  Json p = {{"concurrency", concurrency}};
  p.update(copy_numbers(result, {"num_prompts", "completed", "failed", "duration", "request_throughput",
                                 "output_throughput", "total_token_throughput", "input_throughput", "mean_ttft_ms",
                                 "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                                 "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
                                 "max_concurrent_requests", "prefix_cache_hit_rate"}));
  const double completed = number(result, "completed");
  const double input = number(result, "total_input_tokens"), output = number(result, "total_output_tokens");
  const double mean_in = completed > 0 ? input / completed : 0, mean_out = completed > 0 ? output / completed : 0;
  p["mean_input_len"] = mean_in;
  p["mean_output_len"] = mean_out;
  p["mean_context"] = mean_in + mean_out / 2;  // what an average decode step attends over
  const double median_tpot = number(result, "median_tpot_ms"), mean_tpot = number(result, "mean_tpot_ms");
  p["tokens_per_s_per_user"] = median_tpot > 0 ? Json(1000.0 / median_tpot) : Json(nullptr);
  p["mean_tokens_per_s_per_user"] = mean_tpot > 0 ? Json(1000.0 / mean_tpot) : Json(nullptr);
  p["tokens_per_s_per_gpu"] = number(result, "total_token_throughput") / double(num_gpus);
  p["output_tokens_per_s_per_gpu"] = number(result, "output_throughput") / double(num_gpus);
  if (result.contains("engine_steps")) p["engine_steps"] = result["engine_steps"];  // where the time went
  // Speculative decoding's counters over the point (bench serve's, from the server's vLLM metrics).
  for (const auto& [key, value] : result.items())
    if (key.rfind("spec_decode_", 0) == 0) p[key] = value;
  return p;
}

Json run_sweep(const SweepOptions& o) {
  SPARROW_CHECK(!o.concurrencies.empty(), "--concurrencies: no concurrency given");
  SPARROW_CHECK(o.num_gpus >= 0 && o.tensor_parallel >= 0 && o.data_parallel >= 0,
                "--num-gpus, --tensor-parallel-size and --data-parallel-size must be positive");
  SPARROW_CHECK(o.prompts_per_concurrency > 0 && o.sessions_per_concurrency > 0,
                "--prompts-per-concurrency and --sessions-per-concurrency must be positive");
  const std::string date = now_stamp();
  std::string output = o.output;
  if (output.empty()) {
    output = "sweep-" + o.label + "-" + date + ".json";
    if (!o.serve.result_dir.empty()) output = (fs::path(o.serve.result_dir) / output).string();
  }
  if (fs::path(output).has_parent_path()) fs::create_directories(fs::path(output).parent_path());

  // The roofline's model: --model-config, else the launched model folder.
  const std::vector<std::string> launch_args = split_arguments(o.launch);
  const ParallelLayout layout = sweep_layout(o, launch_args);
  const int64_t num_gpus = layout.gpus();
  std::string model_config = o.model_config;
  if (model_config.empty() && !launch_args.empty()) {
    std::string dir = !launch_args[0].starts_with("-") ? launch_args[0] : flag_value(launch_args, "--model");
    if (!dir.empty() && fs::exists(fs::path(dir) / "config.json")) model_config = dir;
  }
  std::optional<ModelCost> cost;
  if (!model_config.empty()) cost = model_cost_from_path(model_config, o.kv_cache_dtype);
  else std::printf("sweep: no --model-config: the sweep has no roofline\n");

  std::unique_ptr<LaunchedServer> server;
  ServeBenchOptions base = o.serve;
  if (!o.launch.empty()) {
    std::string binary = o.sparrow_binary;
    if (binary.empty()) binary = fs::read_symlink("/proc/self/exe").string();
    const std::string log = o.server_log.empty() ? output + ".server.log" : o.server_log;
    server = std::make_unique<LaunchedServer>(binary, launch_args, log, o.launch_timeout_s);
    base.base_url = server->base_url();
  }

  Json points = Json::array(), roofline = Json::array();
  std::string model_id;
  for (size_t i = 0; i < o.concurrencies.size(); ++i) {
    const int64_t c = o.concurrencies[i];
    ServeBenchOptions s = base;
    s.max_concurrency = c;
    // Each point draws its own requests (point i: seed + i, i.e. `sparrow bench serve --seed <seed + i>`'s).
    // With one seed for all, point c's first prompts or sessions would be the previous point's, already in
    // the server's prefix cache: a quarter of the prompt tokens at 1,4,16,... would be cache hits.
    s.seed = o.serve.seed + i;
    if (!o.fixed_num_prompts) s.random.num_prompts = c * o.prompts_per_concurrency;
    if (!o.fixed_sessions) s.agentic.sessions = c * o.sessions_per_concurrency;
    // Warm-up at a point is at least one full wave at its concurrency: the batch size is what is new.
    if (s.num_warmups > 0) s.num_warmups = std::max(s.num_warmups, c);
    if (s.save_result) s.result_filename = o.label + "-concurrency" + std::to_string(c) + ".json";
    std::printf("\n=== sweep: concurrency %lld ===\n", (long long)c);
    std::fflush(stdout);
    Json point;
    try {
      const Json result = run_serve_benchmark(s);
      if (result.contains("model_id") && result["model_id"].is_string()) model_id = result["model_id"];
      point = sweep_point(result, c, num_gpus);
      point["seed"] = s.seed;
      const double out = number(result, "total_output_tokens"), in = number(result, "total_input_tokens");
      if (cost && out > 0) {
        point["roofline"] = roofline_json(*cost, c, point["mean_context"].get<double>(), (in + out) / out,
                                          o.hardware, layout);
        roofline.push_back(point["roofline"]);
        // Every prompt prefilled whole: the random workload's (agentic sessions reuse their prefix).
        if (s.dataset_name == "random")
          point["serving_limit"] = serving_json(*cost, c, point["mean_input_len"].get<double>(),
                                                point["mean_output_len"].get<double>(), o.hardware, layout);
      }
      if (number(result, "failed") > 0 && result.contains("errors"))
        for (const Json& e : result["errors"])
          if (e.is_string() && !e.get<std::string>().empty()) {
            point["first_error"] = e;
            break;
          }
    } catch (const Error& e) {  // the server is gone or refused the run: record it and go on
      point = {{"concurrency", c}, {"completed", 0}, {"error", e.what()}};
      std::printf("sweep: concurrency %lld failed: %s\n", (long long)c, e.what());
    }
    points.push_back(std::move(point));
  }
  if (server) server->stop();

  Json sweep = {{"kind", "sparrow-bench-sweep"},
                {"version", 1},
                {"label", o.label},
                {"date", date},
                {"base_url", base.base_url},
                {"launch", o.launch},
                {"model_id", model_id},
                {"dataset_name", o.serve.dataset_name},
                {"num_gpus", num_gpus},
                {"tensor_parallel", layout.tensor_parallel},
                {"data_parallel", layout.data_parallel},
                {"hardware", {{"hbm_bytes_per_s", o.hardware.hbm_bytes_per_s}, {"flops_per_s", o.hardware.flops_per_s},
                              {"link_bytes_per_s", o.hardware.link_bytes_per_s},
                              {"collective_latency_s", o.hardware.collective_latency_s}}},
                {"axes",
                 {{"x", "tokens_per_s_per_user = 1000 / median TPOT (ms)"},
                  {"y", "tokens_per_s_per_gpu = total (input + output) token throughput / num_gpus"}}},
                {"model_config", model_config},
                {"kv_cache_dtype", o.kv_cache_dtype},
                {"model_cost", cost ? to_json(*cost) : Json(nullptr)}};
  Json workload = {{"seed", o.serve.seed}, {"seeds", "point i: seed + i"}, {"ignore_eos", o.serve.ignore_eos}, {"request_rate", o.serve.request_rate}};
  if (o.serve.dataset_name == "agentic") {
    const AgenticOptions& a = o.serve.agentic;
    workload.update({{"sessions", o.fixed_sessions ? Json(a.sessions) : Json("concurrency x " + std::to_string(o.sessions_per_concurrency))},
                     {"max_turns", a.max_turns}, {"max_context", a.max_context}, {"system_len", a.system_len},
                     {"append_len", a.append_len}, {"output_len", a.output_len}, {"think_time_ms", a.think_time_ms}});
  } else {
    const RandomOptions& r = o.serve.random;
    workload.update({{"num_prompts", o.fixed_num_prompts ? Json(r.num_prompts)
                                                         : Json("concurrency x " + std::to_string(o.prompts_per_concurrency))},
                     {"input_len", r.input_len}, {"output_len", r.output_len}, {"range_ratio", r.range_ratio},
                     {"prefix_len", r.prefix_len}});
  }
  sweep["workload"] = workload;
  sweep["points"] = points;
  sweep["roofline"] = roofline;

  // The last two columns (sparrow servers): the mean decode step of the engine loop, and the share of it
  // spent on the host (scheduling, bookkeeping, detokenizing) rather than in the forward pass.
  std::printf("\n%-11s %9s %14s %14s %14s %14s %14s %8s %9s %7s\n", "concurrency", "completed", "tok/s/user",
              "tok/s/GPU", "out tok/s/GPU", "roof tok/s/usr", "roof out/GPU", "of roof", "step ms", "host");
  for (const Json& p : points) {
    const Json* r = p.contains("roofline") ? &p["roofline"] : nullptr;
    const double user = p.value("tokens_per_s_per_user", Json(nullptr)).is_number() ? p["tokens_per_s_per_user"].get<double>() : 0;
    const Json* decode =
        p.contains("engine_steps") && p["engine_steps"].is_object() ? &p["engine_steps"]["decode"] : nullptr;
    std::printf("%-11lld %9.0f %14.1f %14.1f %14.1f %14.1f %14.1f %7.1f%% %9.2f %6.0f%%\n",
                (long long)p["concurrency"].get<int64_t>(), number(p, "completed"), user,
                number(p, "tokens_per_s_per_gpu"), number(p, "output_tokens_per_s_per_gpu"),
                r ? number(*r, "tokens_per_s_per_user") : 0.0, r ? number(*r, "tokens_per_s_per_gpu") : 0.0,
                r && number(*r, "tokens_per_s_per_user") > 0 ? 100 * user / number(*r, "tokens_per_s_per_user") : 0.0,
                decode ? number(*decode, "mean_step_ms") : 0.0, decode ? 100 * number(*decode, "host_fraction") : 0.0);
  }
  std::ofstream out(output);
  SPARROW_CHECK(out, "cannot write the sweep file ", output);
  out << sweep.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  std::printf("Saved the sweep to %s\n", output.c_str());
  std::fflush(stdout);
  bool any = false;
  for (const Json& p : points) any = any || number(p, "completed") > 0;
  SPARROW_CHECK(any, "no request of the sweep completed (each point's first_error / error is in ", output, ")");
  return sweep;
}

}  // namespace sparrow::bench
