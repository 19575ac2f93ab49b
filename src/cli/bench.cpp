// sparrow bench forward --model DIR [--prompt-tokens N] [--decode-tokens N] [--batch B] [--repeats R]
// Times prefill (B sequences of N random tokens in one batch) and decode (B sequences, one token per
// step against their caches) on the CPU path; prints tokens/s as one JSON line per measurement.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/model.h"

namespace sparrow::cli {

void add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  auto* sub = bench->add_subcommand("forward", "Prefill and decode throughput of a model on this machine");
  static std::string model_dir;
  static int64_t prompt_tokens = 128, decode_tokens = 32, batch = 1, repeats = 3;
  sub->add_option("--model", model_dir, "Hugging Face model folder")->required();
  sub->add_option("--prompt-tokens", prompt_tokens, "prompt length per sequence");
  sub->add_option("--decode-tokens", decode_tokens, "decode steps");
  sub->add_option("--batch", batch, "sequences per batch");
  sub->add_option("--repeats", repeats, "repetitions (the best is reported)");
  on_selected(sub, [] {
    SPARROW_CHECK(prompt_tokens > 0 && decode_tokens >= 0 && batch > 0 && repeats > 0, "bench: sizes must be positive");
    auto model = load_model(model_dir);
    std::mt19937 rng(0);
    std::uniform_int_distribution<int32_t> token(0, int32_t(model->vocab_size() - 1));
    using clock = std::chrono::steady_clock;
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
      model->forward(prefill);
      auto t1 = clock::now();
      for (int64_t step = 0; step < decode_tokens; ++step) {
        for (auto& p : parts) p.second = {token(rng)};
        Batch decode = make_batch(parts);
        decode.all_logits = false;
        model->forward(decode);
      }
      auto t2 = clock::now();
      best_prefill = std::min(best_prefill, std::chrono::duration<double>(t1 - t0).count());
      best_decode = std::min(best_decode, std::chrono::duration<double>(t2 - t1).count());
    }
    nlohmann::json out = {{"model", model_dir},
                          {"model_type", model->model_type()},
                          {"threads", num_threads()},
                          {"batch", batch},
                          {"prompt_tokens", prompt_tokens},
                          {"decode_tokens", decode_tokens},
                          {"prefill_tokens_per_s", double(batch * prompt_tokens) / best_prefill},
                          {"decode_tokens_per_s", decode_tokens ? double(batch * decode_tokens) / best_decode : 0.0}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace sparrow::cli
