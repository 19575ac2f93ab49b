// sparrow bench forward --model DIR [--prompt-tokens N] [--decode-tokens N] [--batch B] [--repeats R]
//   Times prefill (B sequences of N random tokens in one batch) and decode (B sequences, one token per
//   step against their caches); prints tokens/s as one JSON line per measurement.
// sparrow bench kernels [--filter NAME] [--quick] [--iterations N] [--json FILE]
//   Times each GPU kernel at the real models' shapes (kernels/cuda/kernel_bench.h) and prints time,
//   bytes and FLOPs counted by hand, TB/s, TFLOP/s and the fraction of the H200's limit; bench/kernels.sh
//   adds the peers (PyTorch, FlashMLA) measured in the same run.
// sparrow bench serve [--base-url URL] [--dataset-name random|agentic] [--num-prompts N] ...
//   Load on any OpenAI-compatible server with vLLM's `vllm bench serve` flags and metrics
//   (src/bench/serve_bench.h, docs/bench.md).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include <nlohmann/json.hpp>

#include "bench/serve_bench.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/model.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/runtime/device.h"
#endif

namespace sparrow::cli {

namespace {

void add_bench_kernels(CLI::App* bench) {
  auto* sub = bench->add_subcommand("kernels", "GPU kernels at the real models' shapes, against the H200's limits");
  static std::string filter, json_path;
  static bool quick = false;
  static int iterations = 50;
  sub->add_option("--filter", filter, "only kernels whose name contains this");
  sub->add_flag("--quick", quick, "a few shapes and iterations (a smoke run)");
  sub->add_option("--iterations", iterations, "timed launches per shape (the median is reported)")->capture_default_str();
  sub->add_option("--json", json_path, "also write one JSON line per measurement to this file");
  on_selected(sub, [] {
#if SPARROW_HAVE_CUDA
    cuda::require_device();
    SPARROW_CHECK(iterations > 0, "--iterations must be positive");
    cuda::KernelBenchOptions options{filter, quick, quick ? std::min(iterations, 10) : iterations};
    std::vector<cuda::KernelBenchRow> rows;
    auto wanted = [&](const char* name) { return filter.empty() || std::string(name).find(filter) != std::string::npos; };
    // Each family's entry point applies the filter to its own kernel names too.
    if (wanted("dsa_index") || wanted("dsa")) cuda::bench_dsa_indexer(options, rows);
    if (wanted("topk")) cuda::bench_topk(options, rows);
    if (wanted("mla")) cuda::bench_mla_decode(options, rows);
    if (wanted("gemm")) cuda::bench_gemm(options, rows);
    if (wanted("sampling")) cuda::bench_sampling(options, rows);
    if (wanted("gqa")) cuda::bench_gqa(options, rows);
    if (wanted("msa")) cuda::bench_msa(options, rows);
    if (wanted("kda")) cuda::bench_kda(options, rows);
    if (wanted("moe")) cuda::bench_moe(options, rows);
    std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
    SPARROW_CHECK(json_path.empty() || json, "cannot write ", json_path);
    std::printf("%-22s %-62s %10s %8s %9s %7s\n", "kernel", "shape", "us", "TB/s", "TFLOP/s", "limit");
    for (const cuda::KernelBenchRow& r : rows) {
      const double seconds = r.median_us * 1e-6;
      const double tbps = r.bytes / seconds / 1e12, tflops = r.flops / seconds / 1e12;
      const double limit = std::max(r.bytes / cuda::kHbmBytesPerSecond, r.flops / cuda::kBf16FlopsPerSecond) / seconds;
      std::printf("%-22s %-62s %10.1f %8.2f %9.1f %6.0f%%\n", r.kernel.c_str(), r.shape.c_str(), r.median_us, tbps,
                  tflops, 100 * limit);
      if (json) {
        nlohmann::json line = {{"kernel", r.kernel}, {"shape", r.shape},   {"impl", r.impl.empty() ? "sparrow" : r.impl},
                               {"median_us", r.median_us}, {"bytes", r.bytes}, {"flops", r.flops},
                               {"note", r.note}};
        std::fprintf(json, "%s\n", line.dump().c_str());
      }
    }
    if (json) std::fclose(json);
#else
    fail("bench kernels: this build of sparrow has no CUDA backend (nvcc was not found when it was built)");
#endif
  });
}

// Flag names and defaults are vLLM's where vLLM has the setting (vllm/benchmarks/serve.py, datasets.py).
void add_bench_serve(CLI::App* parent) {
  auto* sub = parent->add_subcommand("serve", "Load an OpenAI-compatible server (vllm bench serve's flags and metrics)");
  static bench::ServeBenchOptions o;
  static std::string base_url, host = "127.0.0.1", request_rate = "inf";
  static int port = 8000;
  static bool disable_tqdm = false;
  sub->add_option("--base-url", base_url, "server URL (default: http://HOST:PORT)");
  sub->add_option("--host", host, "server host, when --base-url is not given")->capture_default_str();
  sub->add_option("--port", port, "server port, when --base-url is not given")->capture_default_str();
  sub->add_option("--endpoint", o.endpoint, "API path (default: /v1/completions, /v1/chat/completions for openai-chat)");
  sub->add_option("--backend", o.backend, "openai (completions) or openai-chat (default: openai; openai-chat for agentic)");
  sub->add_option("--model", o.model, "model name sent in requests (default: the first of GET /v1/models)");
  sub->add_option("--tokenizer", o.tokenizer,
                  "model folder whose tokenizer makes exact-length prompts and counts tokens locally "
                  "(default: none; the server's usage counts are used)");
  sub->add_option("--dataset-name", o.dataset_name, "random or agentic")->capture_default_str();
  sub->add_option("--num-prompts", o.random.num_prompts, "requests of the random workload")->capture_default_str();
  sub->add_option("--random-input-len", o.random.input_len, "input tokens per request, after the prefix")
      ->capture_default_str();
  sub->add_option("--random-output-len", o.random.output_len, "output tokens per request (max_tokens)")
      ->capture_default_str();
  sub->add_option("--random-range-ratio", o.random.range_ratio,
                  "lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
      ->capture_default_str();
  sub->add_option("--random-prefix-len", o.random.prefix_len, "tokens of a prefix shared by every prompt")
      ->capture_default_str();
  sub->add_option("--request-rate", request_rate,
                  "requests (agentic: sessions) per second: inf sends all at once, else Poisson arrivals")
      ->capture_default_str();
  sub->add_option("--burstiness", o.burstiness,
                  "gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more even")
      ->capture_default_str();
  sub->add_option("--max-concurrency", o.max_concurrency, "most requests (agentic: sessions) in flight");
  sub->add_option("--seed", o.seed, "seed of the workload and the arrivals")->capture_default_str();
  sub->add_flag("--ignore-eos", o.ignore_eos, "generate exactly the output length (ignore_eos and min_tokens)");
  sub->add_option("--temperature", o.temperature, "sampling temperature (default 0: greedy)");
  sub->add_option("--goodput", o.goodput, "SLOs for goodput, in ms: ttft:MS tpot:MS e2el:MS")->expected(1, -1);
  sub->add_option("--percentile-metrics", o.percentile_metrics, "metrics the summary prints: ttft,tpot,itl,e2el")
      ->capture_default_str();
  sub->add_option("--metric-percentiles", o.metric_percentiles,
                  "percentiles to report besides p90 and p99, e.g. 50,95,99.9")
      ->capture_default_str();
  sub->add_flag("--save-result", o.save_result, "write the result JSON");
  sub->add_option("--result-dir", o.result_dir, "folder of the result file");
  sub->add_option("--result-filename", o.result_filename,
                  "result file name (default: <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json)");
  sub->add_option("--label", o.label, "prefix of the default result file name (default: the backend)");
  sub->add_flag("--disable-tqdm", disable_tqdm, "no progress line");
  sub->add_option("--metrics-url", o.metrics_url,
                  "Prometheus page with the prefix-cache counters (default: <base-url>/metrics)");
  sub->add_option("--agentic-sessions", o.agentic.sessions, "sessions of the agentic workload")->capture_default_str();
  sub->add_option("--agentic-turns", o.agentic.max_turns, "requests per session at most")->capture_default_str();
  sub->add_option("--agentic-max-context", o.agentic.max_context,
                  "a session ends before a turn whose prompt + output would pass this many tokens")
      ->capture_default_str();
  sub->add_option("--agentic-system-len", o.agentic.system_len, "tokens of system prompt and tool schemas")
      ->capture_default_str();
  sub->add_option("--agentic-append-len", o.agentic.append_len,
                  "median tokens of a tool result (user messages: a third); lognormal, heavy-tailed")
      ->capture_default_str();
  sub->add_option("--agentic-output-len", o.agentic.output_len, "median output tokens per turn")
      ->capture_default_str();
  sub->add_option("--agentic-think-time-ms", o.agentic.think_time_ms, "median pause between a session's turns")
      ->capture_default_str();
  on_selected(sub, [] {
    o.base_url = base_url.empty() ? "http://" + host + ":" + std::to_string(port) : base_url;
    char* end = nullptr;
    o.request_rate = std::strtod(request_rate.c_str(), &end);  // accepts "inf"
    SPARROW_CHECK(!request_rate.empty() && *end == '\0' && o.request_rate > 0,
                  "--request-rate must be a positive number or inf, not '", request_rate, "'");
    o.progress = !disable_tqdm;
    if (const char* key = std::getenv("OPENAI_API_KEY"); key && *key) o.api_key = key;  // as vLLM's client
    bench::run_serve_benchmark(o);
  });
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  auto* sub = bench->add_subcommand("forward", "Prefill and decode throughput of a model on this machine");
  static std::string model_dir, device = "cpu";
  static int64_t prompt_tokens = 128, decode_tokens = 32, batch = 1, repeats = 3;
  sub->add_option("--model", model_dir, "Hugging Face model folder")->required();
  sub->add_option("--prompt-tokens", prompt_tokens, "prompt length per sequence");
  sub->add_option("--decode-tokens", decode_tokens, "decode steps");
  sub->add_option("--batch", batch, "sequences per batch");
  sub->add_option("--repeats", repeats, "repetitions (the best is reported)");
  add_device_option(sub, device);
  on_selected(sub, [] {
    SPARROW_CHECK(prompt_tokens > 0 && decode_tokens >= 0 && batch > 0 && repeats > 0, "bench: sizes must be positive");
    auto model = load_cli_model(model_dir, device);
    std::mt19937 rng(0);
    std::uniform_int_distribution<int32_t> token(0, int32_t(model->vocab_size() - 1));
    using clock = std::chrono::steady_clock;
    // Each step ends with its greedy tokens on the host, as the engine's steps do (only the ids cross
    // from a GPU), so the time is the whole step's.
    auto run_step = [&](const Batch& batch_of_step) {
      Tensor logits = model->forward(batch_of_step);
      const std::vector<TokenDraw> greedy(size_t(logits.dim(0)), TokenDraw{0.0f});
      return ops::sample_tokens(logits, greedy, {});
    };
    double best_prefill = 1e30, best_decode = 1e30;
    for (int64_t r = 0; r < repeats; ++r) {
      std::vector<SequenceState> states(batch);
      std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
      for (auto& s : states) {
        s = model->new_sequence();
        std::vector<int32_t> prompt(prompt_tokens);
        for (auto& t : prompt) t = token(rng);
        parts.push_back({&s, prompt});
      }
      Batch prefill = make_batch(parts);
      prefill.all_logits = false;
      auto t0 = clock::now();
      run_step(prefill);
      auto t1 = clock::now();
      for (int64_t step = 0; step < decode_tokens; ++step) {
        for (auto& p : parts) p.second = {token(rng)};
        Batch decode = make_batch(parts);
        decode.all_logits = false;
        run_step(decode);
      }
      auto t2 = clock::now();
      best_prefill = std::min(best_prefill, std::chrono::duration<double>(t1 - t0).count());
      best_decode = std::min(best_decode, std::chrono::duration<double>(t2 - t1).count());
    }
    nlohmann::json out = {{"model", model_dir},
                          {"device", device},
                          {"model_type", model->model_type()},
                          {"threads", num_threads()},
                          {"batch", batch},
                          {"prompt_tokens", prompt_tokens},
                          {"decode_tokens", decode_tokens},
                          {"prefill_tokens_per_s", double(batch * prompt_tokens) / best_prefill},
                          {"decode_tokens_per_s", decode_tokens ? double(batch * decode_tokens) / best_decode : 0.0},
                          {"decode_step_ms", decode_tokens ? 1e3 * best_decode / double(decode_tokens) : 0.0},
                          {"cuda_graph_replays", model->graph_replays()}};
    std::printf("%s\n", out.dump().c_str());
  });
  add_bench_kernels(bench);
  add_bench_serve(bench);
}

}  // namespace sparrow::cli
