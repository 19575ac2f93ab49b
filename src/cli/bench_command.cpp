// sparrow bench forward --model DIR [--prompt-tokens N] [--decode-tokens N] [--batch B,...] [--repeats R] [--profile]
//                     [--images-per-prompt M --image-size WxH]
//   Times prefill (B sequences of N random tokens in one batch) and decode (B sequences, one token per
//   step against their caches); prints tokens/s as one JSON line per batch size, one model load for all;
//   --profile adds where a step's time goes, part by part (runner/step_profile.h). With images (a model with
//   a vision tower), each prompt also holds M random images, and prefill includes the tower's time.
// sparrow bench kernels [--filter NAME] [--quick] [--iterations N] [--json FILE]
//   Times each GPU kernel at the real models' shapes (kernels/cuda/kernel_bench.h) and prints time,
//   bytes and FLOPs counted by hand, TB/s, TFLOP/s and the fraction of the H200's limit; bench/kernels.sh
//   adds the peers (PyTorch, FlashMLA) measured in the same run.
// sparrow bench serve [--base-url URL] [--dataset-name random|agentic] [--num-prompts N] ...
//   Load on any OpenAI-compatible server with vLLM's `vllm bench serve` flags and metrics
//   (src/bench/serve_bench.h, docs/bench.md).
// sparrow bench kv-quality --model DIR --file TEXT [--kv-cache-dtype D,...] [--indexer-kv-dtype D,...]
//   Perplexity, logit error against the float32 cache and indexer top-k recall per cache format
//   (kv_quality_command.cpp).
// sparrow bench sweep [bench serve's flags] [--concurrencies 1,2,...,256] [--launch 'SERVE ARGS'] ...
//   bench serve at each concurrency, one sweep JSON with the decode roofline beside every point
//   (src/bench/sweep.h; tools/plot_sweep.py draws it).
// sparrow bench collectives -tp N [--device cpu|cuda] [--min-bytes B] [--max-bytes B] [--op NAME,...] [--json FILE]
//   Each collective of an N-rank group timed from min to max bytes (src/bench/collectives.h): the median
//   call time of the slowest rank, algorithm and bus bandwidth (nccl-tests' definitions).
// sparrow bench kv-transfer [--row-bytes B] [--rows 1,8,64,256] [--iterations N]
//   Disaggregation's block-row fetch between two processes, one message a row, against memcpy
//   (src/bench/kv_transfer_bench.h), one JSON line per size.
// sparrow bench roofline --model-config DIR --batch B --input-len I --output-len O [--kv-cache-dtype D]
//   The limits a sweep point records, without a server: the decode step and the serving cycle
//   (src/bench/roofline.h), as one JSON line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "bench/collectives.h"
#include "bench/kv_transfer_bench.h"
#include "bench/roofline.h"
#include "bench/serve_bench.h"
#include "bench/sweep.h"
#include "cli/commands.h"
#include "core/batch_invariance.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/context_parallel.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "runner/model_runner.h"
#include "runner/step_profile.h"
#include "vision/image.h"
#include "vision/image_processor.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/kernel_bench.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#endif

namespace sparrow::cli {

namespace {

// bench forward's images: `count` images of random pixels per prompt, each through the model's processor as a
// served JPEG comes (vision/image_processor.h), their placeholders from prompt position 1 on, one after another.
// The processing is not timed; the tower is, as part of prefill (the engine runs it before the step).
std::vector<vision::ImageInput> bench_images(const vision::ImageProcessor& processor, int64_t count, int64_t width,
                                             int64_t height, std::mt19937& rng) {
  std::vector<vision::ImageInput> images;
  int64_t offset = 1;
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < count; ++i) {
    vision::Image image;
    image.width = width, image.height = height;
    image.rgb.resize(size_t(width * height * 3));
    for (uint8_t& v : image.rgb) v = uint8_t(byte(rng));
    images.push_back(processor.process(vision::encode_jpeg(image)));
    images.back().offset = offset;
    offset += images.back().tokens;
  }
  return images;
}

// "WxH" as two positive sizes.
std::pair<int64_t, int64_t> parse_image_size(const std::string& text) {
  const size_t x = text.find('x');
  int64_t w = 0, h = 0;
  try {
    SPARROW_CHECK(x != std::string::npos, "");
    w = std::stoll(text.substr(0, x));
    h = std::stoll(text.substr(x + 1));
  } catch (const std::exception&) {
  }
  SPARROW_CHECK(w > 0 && h > 0 && w <= 16384 && h <= 16384, "--image-size: '", text,
                "' is not WIDTHxHEIGHT in pixels (e.g. 512x512, at most 16384 a side)");
  return {w, h};
}

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
    device::require();
    SPARROW_CHECK(iterations > 0, "--iterations must be positive");
    cuda::KernelBenchOptions options{filter, quick, quick ? std::min(iterations, 10) : iterations};
    std::vector<cuda::KernelBenchRow> rows;
    // A family runs when the filter is part of its name ("dsa") or names one of its kernels ("sparse_mla_decode"
    // holds "mla"); each family's entry point then applies the filter to its own kernel names.
    auto wanted = [&](const std::string& family) {
      return filter.empty() || family.find(filter) != std::string::npos || filter.find(family) != std::string::npos;
    };
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
      const double limit = std::max(r.bytes / cuda::kHbmBytesPerSecond, r.flops / cuda::matrix_peak(r)) / seconds;
      std::printf("%-22s %-62s %10.1f %8.2f %9.1f %6.0f%%\n", r.kernel.c_str(), r.shape.c_str(), r.median_us, tbps,
                  tflops, 100 * limit);
      if (json) {
        nlohmann::json line = {{"kernel", r.kernel}, {"shape", r.shape},   {"impl", r.impl.empty() ? "sparrow" : r.impl},
                               {"median_us", r.median_us}, {"bytes", r.bytes}, {"flops", r.flops},
                               {"fp8_products", r.fp8_products}, {"note", r.note}};
        std::fprintf(json, "%s\n", line.dump().c_str());
      }
    }
    if (json) std::fclose(json);
#else
    fail("bench kernels: this build of sparrow has no CUDA backend (nvcc was not found when it was built)");
#endif
  });
}

// The flags `bench serve` and `bench sweep` share, and what they end up as.
struct ServeFlags {
  bench::ServeBenchOptions o;
  std::string base_url, host = "127.0.0.1", request_rate = "inf";
  std::string mm_buckets, mm_limit;  // random-mm's, as vLLM writes them; empty: vLLM's defaults
  int port = 8000;
  bool disable_tqdm = false;

  // The options, once parsed.
  bench::ServeBenchOptions options() {
    o.base_url = base_url.empty() ? "http://" + host + ":" + std::to_string(port) : base_url;
    char* end = nullptr;
    o.request_rate = std::strtod(request_rate.c_str(), &end);  // accepts "inf"
    SPARROW_CHECK(!request_rate.empty() && *end == '\0' && o.request_rate > 0,
                  "--request-rate must be a positive number or inf, not '", request_rate, "'");
    o.progress = !disable_tqdm;
    if (!mm_buckets.empty()) o.random_mm.buckets = bench::parse_image_buckets(mm_buckets);
    if (!mm_limit.empty()) o.random_mm.image_limit = bench::parse_image_limit(mm_limit);
    if (const char* key = std::getenv("OPENAI_API_KEY"); key && *key) o.api_key = key;  // as vLLM's client
    return o;
  }
};

// Flag names and defaults are vLLM's where vLLM has the setting (vllm/benchmarks/serve.py, datasets.py).
// `sweep`: the sweep sets --max-concurrency per point, and --num-prompts / --agentic-sessions only when given.
void add_serve_flags(CLI::App* sub, ServeFlags& f, bool sweep) {
  bench::ServeBenchOptions& o = f.o;
  sub->add_option("--base-url", f.base_url, "server URL (default: http://HOST:PORT)");
  sub->add_option("--host", f.host, "server host, when --base-url is not given")->capture_default_str();
  sub->add_option("--port", f.port, "server port, when --base-url is not given")->capture_default_str();
  sub->add_option("--endpoint", o.endpoint, "API path (default: /v1/completions, /v1/chat/completions for openai-chat)");
  sub->add_option("--backend", o.backend, "openai (completions) or openai-chat (default: openai; openai-chat for agentic)");
  sub->add_option("--model", o.model, "model name sent in requests (default: the first of GET /v1/models)");
  sub->add_option("--tokenizer", o.tokenizer,
                  "model folder whose tokenizer makes exact-length prompts and counts tokens locally "
                  "(default: none; the server's usage counts are used)");
  sub->add_option("--dataset-name", o.dataset_name, "random, random-mm (random prompts with images) or agentic")
      ->capture_default_str();
  auto* num_prompts = sub->add_option("--num-prompts", o.random.num_prompts,
                                      sweep ? "requests of the random workload at every point (default: "
                                              "concurrency x --prompts-per-concurrency)"
                                            : "requests of the random workload");
  if (!sweep) num_prompts->capture_default_str();
  sub->add_option("--random-input-len", o.random.input_len, "input tokens per request, after the prefix")
      ->capture_default_str();
  sub->add_option("--random-output-len", o.random.output_len, "output tokens per request (max_tokens)")
      ->capture_default_str();
  sub->add_option("--random-range-ratio", o.random.range_ratio,
                  "lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
      ->capture_default_str();
  sub->add_option("--random-prefix-len", o.random.prefix_len, "tokens of a prefix shared by every prompt")
      ->capture_default_str();
  sub->add_option("--random-mm-base-items-per-request", o.random_mm.base_items, "random-mm: images per request")
      ->capture_default_str();
  sub->add_option("--random-mm-num-mm-items-range-ratio", o.random_mm.items_range_ratio,
                  "random-mm: image counts uniform in [floor(n (1 - r)), ceil(n (1 + r))]")
      ->capture_default_str();
  sub->add_option("--random-mm-limit-mm-per-prompt", f.mm_limit,
                  "random-mm: '{\"image\": N}' caps the count (default 255, vLLM's)");
  sub->add_option("--random-mm-bucket-config", f.mm_buckets,
                  "random-mm: image sizes by probability, '{(H, W, 1): p, ...}' (default: vLLM's, 256x256 and "
                  "720x1280 at 0.5 each)");
  sub->add_option("--request-rate", f.request_rate,
                  "requests (agentic: sessions) per second: inf sends all at once, else Poisson arrivals")
      ->capture_default_str();
  sub->add_option("--burstiness", o.burstiness,
                  "gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more even")
      ->capture_default_str();
  if (!sweep) sub->add_option("--max-concurrency", o.max_concurrency, "most requests (agentic: sessions) in flight");
  sub->add_option("--num-warmups", o.num_warmups,
                  sweep ? "untimed requests before each point (another seed's prompts, sent at the point's concurrency)"
                        : "untimed requests before the run (another seed's prompts, sent at --max-concurrency)")
      ->capture_default_str();
  sub->add_option("--seed", o.seed, "seed of the workload and the arrivals")->capture_default_str();
  sub->add_flag("--ignore-eos", o.ignore_eos, "generate exactly the output length (ignore_eos and min_tokens)");
  sub->add_option("--temperature", o.temperature, "sampling temperature (default 0: greedy)");
  sub->add_option("--goodput", o.goodput, "SLOs for goodput, in ms: ttft:MS tpot:MS e2el:MS")->expected(1, -1);
  sub->add_option("--percentile-metrics", o.percentile_metrics, "metrics the summary prints: ttft,tpot,itl,e2el")
      ->capture_default_str();
  sub->add_option("--metric-percentiles", o.metric_percentiles,
                  "percentiles to report besides p90 and p99, e.g. 50,95,99.9")
      ->capture_default_str();
  sub->add_flag("--save-result", o.save_result,
                sweep ? "also write each point's result JSON (<label>-concurrency<N>.json)" : "write the result JSON");
  sub->add_option("--result-dir", o.result_dir, "folder of the result file");
  if (!sweep)
    sub->add_option("--result-filename", o.result_filename,
                    "result file name (default: <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json)");
  if (!sweep) sub->add_option("--label", o.label, "prefix of the default result file name (default: the backend)");
  sub->add_flag("--disable-tqdm", f.disable_tqdm, "no progress line");
  sub->add_option("--metrics-url", o.metrics_url,
                  "Prometheus page with the prefix-cache counters (default: <base-url>/metrics)");
  auto* sessions = sub->add_option("--agentic-sessions", o.agentic.sessions,
                                   sweep ? "sessions of the agentic workload at every point (default: concurrency x "
                                           "--sessions-per-concurrency)"
                                         : "sessions of the agentic workload");
  if (!sweep) sessions->capture_default_str();
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
}

void add_bench_serve(CLI::App* parent) {
  auto* sub = parent->add_subcommand("serve", "Load an OpenAI-compatible server (vllm bench serve's flags and metrics)");
  static ServeFlags f;
  add_serve_flags(sub, f, /*sweep=*/false);
  on_selected(sub, [] { bench::run_serve_benchmark(f.options()); });
}

// The roofline's link between GPUs (bench sweep, bench roofline): NVLink's bandwidth and a collective's
// fixed cost (roofline.h HardwareLimits).
void add_link_options(CLI::App* sub, double& link_gbps, double& latency_us) {
  sub->add_option("--link-bandwidth", link_gbps, "the roofline's GPU-to-GPU bandwidth each way, GB/s (NVLink 4)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--collective-latency", latency_us, "the roofline's fixed cost of one collective, microseconds")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

// sparrow bench sweep: bench serve's workload over a list of concurrencies, with the decode roofline
// (src/bench/sweep.h, src/bench/roofline.h, docs/bench.md).

void add_bench_sweep(CLI::App* parent) {
  auto* sub = parent->add_subcommand(
      "sweep", "bench serve over concurrencies 1..256 with the decode roofline: the Pareto front's points (sweep JSON)");
  static ServeFlags f;
  static bench::SweepOptions s;
  static std::string concurrencies = "1,2,4,8,16,32,64,128,256";
  static double hbm_tbps = 4.3, peak_tflops = 790, link_gbps = bench::HardwareLimits{}.link_bytes_per_s / 1e9,
                latency_us = bench::HardwareLimits{}.collective_latency_s * 1e6;
  add_serve_flags(sub, f, /*sweep=*/true);
  sub->add_option("--concurrencies", concurrencies, "the points: --max-concurrency of each run")->capture_default_str();
  sub->add_option("--prompts-per-concurrency", s.prompts_per_concurrency,
                  "random: each point sends concurrency x this many prompts")
      ->capture_default_str();
  sub->add_option("--sessions-per-concurrency", s.sessions_per_concurrency,
                  "agentic: each point runs concurrency x this many sessions")
      ->capture_default_str();
  sub->add_option("--launch", s.launch,
                  "start `sparrow serve ARGS` (model folder and serve flags, one quoted string) on a free port for the "
                  "sweep and stop it after; e.g. --launch 'DIR --load-format dummy --device cuda'");
  sub->add_option("--launch-timeout", s.launch_timeout_s, "seconds the launched server may take to listen")
      ->capture_default_str();
  sub->add_option("--server-log", s.server_log, "the launched server's output (default: <sweep file>.server.log)");
  sub->add_option("--model-config", s.model_config,
                  "the served model's folder or config.json, for the roofline (default: --launch's model folder)");
  sub->add_option("--kv-cache-dtype", s.kv_cache_dtype,
                  "the server's KV-cache dtype, for the roofline's bytes: auto (bfloat16, DSA keys fp8), bfloat16, fp8")
      ->capture_default_str();
  sub->add_option("--hbm-bandwidth", hbm_tbps, "the roofline's HBM bandwidth per GPU, TB/s (H200 measured)")
      ->capture_default_str();
  sub->add_option("--peak-tflops", peak_tflops, "the roofline's dense bf16 peak per GPU, TFLOP/s (H200 cuBLASLt)")
      ->capture_default_str();
  sub->add_option("--num-gpus", s.num_gpus,
                  "GPUs the server uses (throughput per GPU divides by it; default: tensor x data parallel)");
  sub->add_option("--tensor-parallel-size", s.tensor_parallel,
                  "the server's tensor-parallel size, for the roofline (default: --launch's -tp, else --num-gpus)");
  sub->add_option("--data-parallel-size", s.data_parallel,
                  "the server's data-parallel groups, for the roofline (default: --launch's -dp, else 1)");
  add_link_options(sub, link_gbps, latency_us);
  sub->add_option("--label", s.label, "the curve's name in the sweep JSON and plots")->capture_default_str();
  sub->add_option("--output", s.output, "the sweep JSON (default: <result-dir>/sweep-<label>-<date>.json)");
  on_selected(sub, [sub] {
    s.serve = f.options();
    s.serve.label = s.label;
    s.concurrencies = bench::parse_concurrencies(concurrencies);
    s.fixed_num_prompts = sub->get_option("--num-prompts")->count() > 0;
    s.fixed_sessions = sub->get_option("--agentic-sessions")->count() > 0;
    SPARROW_CHECK(hbm_tbps > 0 && peak_tflops > 0, "--hbm-bandwidth and --peak-tflops must be positive");
    s.hardware.hbm_bytes_per_s = hbm_tbps * 1e12;
    s.hardware.flops_per_s = peak_tflops * 1e12;
    s.hardware.link_bytes_per_s = link_gbps * 1e9;
    s.hardware.collective_latency_s = latency_us * 1e-6;
    bench::run_sweep(s);
  });
}

// sparrow bench roofline: one point's limits from a config alone (the sweep's model cost and formulas).
void add_bench_roofline(CLI::App* parent) {
  auto* sub = parent->add_subcommand("roofline", "A model's decode roofline and serving limit at one batch and workload");
  static std::string model_config, kv_cache_dtype = "auto";
  static int64_t batch = 1;
  static double input_len = 8192, output_len = 1024, hbm_tbps = 4.3, peak_tflops = 790;
  static bench::ParallelLayout layout;
  static double link_gbps = bench::HardwareLimits{}.link_bytes_per_s / 1e9,
                latency_us = bench::HardwareLimits{}.collective_latency_s * 1e6;
  sub->add_option("--model-config", model_config, "the model's folder or config.json")->required();
  sub->add_option("--batch", batch, "concurrent sequences (the sweep's concurrency)")->capture_default_str();
  sub->add_option("--input-len", input_len, "prompt tokens per request")->capture_default_str();
  sub->add_option("--output-len", output_len, "output tokens per request")->capture_default_str();
  sub->add_option("--kv-cache-dtype", kv_cache_dtype, "as bench sweep's")->capture_default_str();
  sub->add_option("--hbm-bandwidth", hbm_tbps, "HBM bandwidth, TB/s (H200 measured)")->capture_default_str();
  sub->add_option("--peak-tflops", peak_tflops, "dense bf16 peak, TFLOP/s (H200 cuBLASLt)")->capture_default_str();
  sub->add_option("--tensor-parallel-size", layout.tensor_parallel, "GPUs of a tensor-parallel group (also -tp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--data-parallel-size", layout.data_parallel,
                  "data-parallel groups, the experts over all of them (also -dp; docs/parallel.md)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  add_link_options(sub, link_gbps, latency_us);
  on_selected(sub, [] {
    SPARROW_CHECK(batch > 0 && input_len >= 0 && output_len > 0,
                  "--batch and --output-len must be positive, --input-len non-negative");
    SPARROW_CHECK(hbm_tbps > 0 && peak_tflops > 0, "--hbm-bandwidth and --peak-tflops must be positive");
    const bench::HardwareLimits hw{hbm_tbps * 1e12, peak_tflops * 1e12, link_gbps * 1e9, latency_us * 1e-6};
    const bench::ModelCost cost = bench::model_cost_from_path(model_config, kv_cache_dtype);
    const bench::ServingCycle serving = bench::serving_roofline(cost, batch, input_len, output_len, hw, layout);
    const nlohmann::json out = {{"model", to_json(cost)},
                                {"decode", to_json(bench::decode_roofline(cost, batch, serving.context, hw, layout))},
                                {"serving", to_json(serving)}};
    std::printf("%s\n", out.dump().c_str());
  });
}

// A step profile as JSON: per part, its marks per step (layers of that kind), ms per step and share.
nlohmann::json profile_json(const StepProfile& p) {
  nlohmann::json parts = nlohmann::json::array();
  const double steps = double(std::max<int64_t>(p.steps(), 1)), total = p.seconds();
  for (const StepProfile::Part& part : p.parts())
    parts.push_back({{"part", part.name},
                     {"per_step", double(part.count) / steps},
                     {"ms_per_step", 1e3 * part.seconds / steps},
                     {"share", total > 0 ? part.seconds / total : 0.0}});
  return {{"steps", p.steps()}, {"ms_per_step", 1e3 * total / steps}, {"parts", parts}};
}

// The same as a table on stderr (stdout keeps one JSON line per run).
void print_profile(const char* title, const StepProfile& p) {
  const double steps = double(std::max<int64_t>(p.steps(), 1)), total = p.seconds();
  std::fprintf(stderr, "%s, profiled (%lld steps, eager): %.3f ms a step\n", title, (long long)p.steps(),
               1e3 * total / steps);
  std::fprintf(stderr, "  %-22s %8s %12s %7s\n", "part", "x/step", "ms/step", "share");
  for (const StepProfile::Part& part : p.parts())
    std::fprintf(stderr, "  %-22s %8.0f %12.3f %6.1f%%\n", part.name.c_str(), double(part.count) / steps,
                 1e3 * part.seconds / steps, total > 0 ? 100 * part.seconds / total : 0.0);
}

// Sizes as "64K", "16M", "1G" or plain bytes.
int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    fail("not a size: '", text, "' (bytes, or a number with K, M or G)");
  }
  const std::string unit = text.substr(used);
  const double scale = unit.empty() ? 1 : unit == "K" || unit == "KB" || unit == "KiB" ? 1024.0
                       : unit == "M" || unit == "MB" || unit == "MiB"                 ? 1024.0 * 1024
                       : unit == "G" || unit == "GB" || unit == "GiB"                 ? 1024.0 * 1024 * 1024
                                                                                       : -1;
  SPARROW_CHECK(scale > 0 && value > 0 && value * scale < 1e15, "not a size: '", text,
                "' (bytes, or a number with K, M or G)");
  return int64_t(value * scale);
}

void add_bench_collectives(CLI::App* parent) {
  auto* sub = parent->add_subcommand(
      "collectives", "Each collective of a tensor-parallel group timed over sizes (nccl-tests' bus bandwidth)");
  static std::string device = "cpu", min_bytes = "1K", max_bytes, ops, json_path;
  static int iterations = 20, warmup = 3;
  sub->add_option("--min-bytes", min_bytes, "smallest size (bytes, or with K, M, G)")->capture_default_str();
  sub->add_option("--max-bytes", max_bytes, "largest size (default 256M on a GPU, 16M on the CPU); sizes double");
  sub->add_option("--op", ops, "comma-separated: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast "
                               "(default all)");
  sub->add_option("--iterations", iterations, "timed calls per size (the median is reported)")->capture_default_str();
  sub->add_option("--warmup", warmup, "untimed calls per size first")->capture_default_str();
  sub->add_option("--json", json_path, "rank 0 also writes one JSON line per size and operation to this file");
  add_device_option(sub, device);
  on_selected(sub, [] {
    bench::CollectiveBenchOptions options;
    options.min_bytes = parse_bytes(min_bytes);
    options.max_bytes = parse_bytes(max_bytes.empty() ? (parse_device(device) == Device::Cpu ? "16M" : "256M")
                                                      : max_bytes);
    options.iterations = iterations;
    options.warmup = warmup;
    for (size_t at = 0; !ops.empty() && at <= ops.size();) {
      const size_t comma = std::min(ops.find(',', at), ops.size());
      options.ops.push_back(ops.substr(at, comma - at));
      at = comma + 1;
    }
    bench::check_options(options);
    Communicator& comm = join_cli_group(device);
    const std::vector<bench::CollectiveBenchRow> rows = bench::bench_collectives(comm, options);
    if (comm.rank() != 0) return;
    std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
    SPARROW_CHECK(json_path.empty() || json, "cannot write ", json_path);
    std::printf("%-15s %12s %12s %12s %12s   (%d ranks, %s on %s)\n", "op", "bytes", "time_us", "algbw_GB/s",
                "busbw_GB/s", rows.empty() ? 0 : rows[0].ranks, comm.backend().c_str(),
                comm.device() == Device::Cpu ? "cpu" : "cuda");
    for (const bench::CollectiveBenchRow& r : rows) {
      std::printf("%-15s %12lld %12.1f %12.3f %12.3f\n", r.op.c_str(), static_cast<long long>(r.bytes), r.median_us,
                  r.algbw_gbps, r.busbw_gbps);
      if (json)
        std::fprintf(json, "%s\n",
                     nlohmann::json{{"op", r.op},         {"bytes", r.bytes},           {"ranks", r.ranks},
                                    {"backend", r.backend}, {"device", r.device},         {"median_us", r.median_us},
                                    {"algbw_gbps", r.algbw_gbps}, {"busbw_gbps", r.busbw_gbps}}
                         .dump()
                         .c_str());
    }
    if (json) std::fclose(json);
  });
}

void add_bench_kv_transfer(CLI::App* parent) {
  auto* sub = parent->add_subcommand("kv-transfer", "Prefill/decode disaggregation's block-row fetch between two "
                                                    "processes of this machine, against memcpy (docs/disaggregation.md)");
  static std::string row_bytes = "1820000";
  static std::vector<int64_t> rows{1, 8, 64, 256};
  static int iterations = 10;
  sub->add_option("--row-bytes", row_bytes, "one block row's bytes (or with K, M, G)")->capture_default_str();
  sub->add_option("--rows", rows, "rows per fetch; several are measured one after the other")->delimiter(',');
  sub->add_option("--iterations", iterations, "timed fetches per size (the median is reported)")->capture_default_str();
  on_selected(sub, [] {
    bench::KvTransferBenchOptions options;
    options.row_bytes = parse_bytes(row_bytes);
    options.rows = rows;
    options.iterations = iterations;
    for (const bench::KvTransferBenchRow& r : bench::bench_kv_transfer(options))
      std::printf("%s\n", nlohmann::json{{"row_bytes", r.row_bytes}, {"rows", r.rows}, {"median_ms", r.median_ms},
                                          {"gbps", r.gbps}, {"rows_per_s", r.rows_per_s}, {"memcpy_gbps", r.memcpy_gbps},
                                          {"ratio_to_memcpy", r.gbps / r.memcpy_gbps}}
                                .dump()
                                .c_str());
  });
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  auto* sub = bench->add_subcommand("forward", "Prefill and decode throughput of a model on this machine");
  static std::string model_dir, device = "cpu";
  static int64_t prompt_tokens = 128, decode_tokens = 32, repeats = 3;
  static std::vector<int64_t> batches{1};
  static bool profile = false;
  static int64_t images_per_prompt = 0;
  static std::string image_size = "512x512";
  sub->add_option("--model", model_dir, "Hugging Face model folder")->required();
  sub->add_option("--prompt-tokens", prompt_tokens, "prompt length per sequence");
  sub->add_option("--decode-tokens", decode_tokens, "decode steps");
  sub->add_option("--batch", batches, "sequences per batch; several (1,16,64) are measured one after the other")
      ->delimiter(',');
  sub->add_option("--repeats", repeats, "repetitions (the best is reported)");
  sub->add_flag("--profile", profile,
                "after the timed repeats, one more with every step timed part by part (eagerly: embedding, each "
                "mixer and feed-forward kind, lm_head), reported beside the totals");
  sub->add_option("--images-per-prompt", images_per_prompt,
                  "random images in each prompt (a model with a vision tower); prefill includes the tower's time");
  sub->add_option("--image-size", image_size, "the images' WIDTHxHEIGHT in pixels, before the processor's resize");
  add_device_option(sub, device);
  on_selected(sub, [] {
    SPARROW_CHECK(prompt_tokens > 0 && decode_tokens >= 0 && repeats > 0 && images_per_prompt >= 0 &&
                      std::all_of(batches.begin(), batches.end(), [](int64_t b) { return b > 0; }),
                  "bench: sizes must be positive");
    // (Plain variables, not a structured binding: the lambdas below capture them, which clang 14 refuses.)
    const std::pair<int64_t, int64_t> image_dims = parse_image_size(image_size);
    const int64_t image_width = image_dims.first, image_height = image_dims.second;
    auto model = load_cli_model(model_dir, device);
    const VisionEncoder* tower = model->vision();
    SPARROW_CHECK(images_per_prompt == 0 || tower, "--images-per-prompt: ", model->model_type(),
                  " has no vision tower here");
    std::optional<vision::ImageProcessor> processor;
    if (images_per_prompt > 0) processor = vision::ImageProcessor::for_model(model_dir);
    for (const int64_t batch : batches) {
      ModelRunner runner(*model, cli_runner_options());
      std::mt19937 rng(0);
      std::uniform_int_distribution<int32_t> token(0, int32_t(model->vocab_size() - 1));
      using clock = std::chrono::steady_clock;
      // Each step ends with its greedy tokens on the host, as the engine's steps do (only the ids cross
      // from a GPU), so the time is the whole step's.
      auto run_step = [&](const Batch& batch_of_step) {
        Tensor logits = runner.run(batch_of_step);
        const std::vector<TokenDraw> greedy(size_t(logits.dim(0)), TokenDraw{0.0f});
        return ops::sample_tokens(logits, greedy, {});
      };
      // One repeat: B fresh sequences prefilled in one batch, then the decode steps; the seconds of each
      // phase. With profiles, the runner times its parts into them (runner/step_profile.h).
      StepProfile prefill_profile, decode_profile;
      double encoder_s = 0;  // the last repeat's
      int64_t image_tokens = 0;  // per prompt
      auto run_once = [&](bool profiled) {
        std::vector<SequenceState> states(batch);
        std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
        std::vector<std::vector<vision::ImageInput>> images(batch);
        for (int64_t i = 0; i < batch; ++i) {
          states[i] = runner.new_sequence();
          if (processor) images[i] = bench_images(*processor, images_per_prompt, image_width, image_height, rng);
          image_tokens = 0;
          for (const vision::ImageInput& image : images[i]) image_tokens += image.tokens;
          std::vector<int32_t> prompt(prompt_tokens + image_tokens);
          for (auto& t : prompt) t = token(rng);
          for (const vision::ImageInput& image : images[i])
            std::fill_n(prompt.begin() + image.offset, image.tokens, tower->image_token_id());
          parts.push_back({&states[i], prompt});
        }
        Batch prefill = make_batch(parts);
        prefill.all_logits = false;
        runner.set_step_profile(profiled ? &prefill_profile : nullptr);
        auto t0 = clock::now();
        if (processor) {  // each image through the tower, as the engine embeds a miss, then the rows into the step
          ImageRows rows;
          int64_t row = 0;
          for (int64_t i = 0; i < batch; ++i) {
            const int64_t length = int64_t(parts[i].second.size());
            for (const vision::ImageInput& image : images[i])
              rows.add(row, 0, length, image.offset, tower->embed(image.pixel_values, {image.grid}));
            row += length;
          }
          rows.attach_to(prefill);
        }
        const auto encoded = clock::now();
        run_step(prefill);
        auto t1 = clock::now();
        encoder_s = std::chrono::duration<double>(encoded - t0).count();
        runner.set_step_profile(profiled ? &decode_profile : nullptr);
        // The first decode step is not timed when there are others: on a GPU it captures the batch's CUDA
        // graph (tens of ms, once per batch size), which would be counted in every step's mean with a single
        // repeat.
        const int64_t untimed = decode_tokens > 1 ? 1 : 0;
        auto decode_start = t1;
        for (int64_t step = 0; step < decode_tokens; ++step) {
          if (step == untimed) decode_start = clock::now();
          for (auto& p : parts) p.second = {token(rng)};
          Batch decode = make_batch(parts);
          decode.all_logits = false;
          run_step(decode);
        }
        auto t2 = clock::now();
        runner.set_step_profile(nullptr);
        return std::pair{std::chrono::duration<double>(t1 - t0).count(),
                         std::chrono::duration<double>(t2 - decode_start).count()};
      };
      const int64_t timed_decode_steps = decode_tokens > 1 ? decode_tokens - 1 : decode_tokens;
      double best_prefill = 1e30, best_decode = 1e30, best_encoder = 0;
      for (int64_t r = 0; r < repeats; ++r) {
        const auto [prefill_s, decode_s] = run_once(false);
        if (prefill_s < best_prefill) best_encoder = encoder_s;
        best_prefill = std::min(best_prefill, prefill_s);
        best_decode = std::min(best_decode, decode_s);
      }
      const int64_t replays = runner.graph_replays();  // the timed repeats' (the profiled one runs eagerly)
      nlohmann::json out = {{"model", model_dir},
                            {"device", device},
                            {"model_type", model->model_type()},
                            {"threads", num_threads()},
                            {"batch", batch},
                            {"batch_invariant", batch_invariant()},
                            {"prompt_tokens", prompt_tokens},
                            {"decode_tokens", decode_tokens},
                            {"prefill_tokens_per_s", double(batch * (prompt_tokens + image_tokens)) / best_prefill},
                            {"decode_tokens_per_s", decode_tokens ? double(batch * timed_decode_steps) / best_decode : 0.0},
                            {"decode_step_ms", decode_tokens ? 1e3 * best_decode / double(timed_decode_steps) : 0.0},
                            {"cuda_graph_replays", replays}};
      if (images_per_prompt > 0) {
        // prefill_tokens_per_s counts the images' placeholder tokens and includes the tower's time (on the host).
        out["images_per_prompt"] = images_per_prompt;
        out["image_size"] = image_size;
        out["image_tokens_per_prompt"] = image_tokens;
        out["encoder_ms"] = 1e3 * best_encoder;
        out["encoder_share_of_prefill"] = best_encoder / best_prefill;
      }
      if (const DcpMergeCounters& dcp = dcp_merge_counters(); dcp.rows > 0) {
        // Decode context parallelism: what this rank sent to the DSA top-k merges over every run (model/context_parallel.h),
        // against the naive merge (every rank all-gathering its whole local top-k) of the same rows.
        out["dcp_topk_merge"] = {{"rows", dcp.rows.load()},
                                 {"resent_rows", dcp.resent_rows.load()},
                                 {"bytes_sent", dcp.merge_bytes.load()},
                                 {"naive_bytes_sent", dcp.naive_bytes.load()},
                                 {"naive_over_exact", double(dcp.naive_bytes) / double(dcp.merge_bytes)}};
      }
      if (profile) {
        run_once(true);
        out["profile"] = {{"prefill", profile_json(prefill_profile)}, {"decode", profile_json(decode_profile)}};
        if (images_per_prompt > 0) {  // before the step, outside the runner's parts
          out["profile"]["encoder_ms"] = 1e3 * encoder_s;
          std::fprintf(stderr, "vision encoder (host, before the prefill step): %.3f ms for %lld images\n",
                       1e3 * encoder_s, (long long)(batch * images_per_prompt));
        }
        print_profile("prefill step", prefill_profile);
        if (decode_tokens) print_profile("decode step", decode_profile);
      }
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
    }
  });
  add_bench_kernels(bench);
  add_bench_serve(bench);
  add_bench_sweep(bench);
  add_bench_roofline(bench);
  add_bench_collectives(bench);
  add_bench_kv_transfer(bench);
  add_bench_kv_quality(bench);
}

}  // namespace sparrow::cli
