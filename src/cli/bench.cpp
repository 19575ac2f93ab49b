// sparrow bench forward --model DIR [--prompt-tokens N] [--decode-tokens N] [--batch B] [--repeats R]
//   Times prefill (B sequences of N random tokens in one batch) and decode (B sequences, one token per
//   step against their caches); prints tokens/s as one JSON line per measurement.
// sparrow bench kernels [--filter NAME] [--quick] [--iterations N] [--json FILE]
//   Times each GPU kernel at the real models' shapes (kernels/cuda/kernel_bench.h) and prints time,
//   bytes and FLOPs counted by hand, TB/s, TFLOP/s and the fraction of the H200's limit; bench/kernels.sh
//   adds the peers (PyTorch, FlashMLA) measured in the same run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

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
}

}  // namespace sparrow::cli
