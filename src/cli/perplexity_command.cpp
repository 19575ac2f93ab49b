// sparrow perplexity [--model DIR] --file TEXT_FILE [--context N] [--kv-cache-dtype D] [--attention-config JSON]
// Prints {"perplexity", "mean_nll", "tokens", "window"} as JSON. The recipe is that of
// tools/perplexity_reference.py, which measures the same with transformers: the file's ids (no special
// tokens added, BOS only if add_bos_token), cut into consecutive non-overlapping windows of
// N = min(context length, 1024) tokens (the last may be shorter); one forward per window, in which each
// token after the first is scored by the log-softmax at the position before it. With --kv-cache-dtype or
// --attention-config each window runs through a paged KvCache of those formats (docs/cache.md), so the
// perplexity includes the cache's rounding; without them, the model's own float32 sequence cache.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/text_generation.h"
#include "core/error.h"
#include "engine/logprobs.h"
#include "model/model.h"

namespace sparrow::cli {

std::vector<std::vector<int32_t>> perplexity_windows(const std::vector<int32_t>& ids, int64_t window) {
  std::vector<std::vector<int32_t>> windows;
  for (size_t start = 0; start < ids.size(); start += size_t(window))
    if (ids.size() - start >= 2)  // a lone token predicts nothing
      windows.emplace_back(ids.begin() + start, ids.begin() + std::min(ids.size(), start + size_t(window)));
  return windows;
}

double window_nll(const Tensor& logits, const std::vector<int32_t>& chunk) {
  double nll = 0;
  for (size_t i = 0; i + 1 < chunk.size(); ++i)
    nll -= token_logprob({logits.row(int64_t(i)), size_t(logits.row_size())}, chunk[i + 1], 0).logprob;
  return nll;
}

void add_perplexity(CLI::App& app) {
  auto* sub = app.add_subcommand("perplexity", "Perplexity of the model on a text file (JSON on stdout)");
  static std::string model_dir, text_path, device = "cpu", kv_cache_dtype = "auto", attention_config;
  static int64_t window = 0;
  sub->add_option("--model", model_dir, "Hugging Face model folder (default: the bundled model)");
  add_device_option(sub, device);
  sub->add_option("--file", text_path, "UTF-8 text file to score")->required();
  sub->add_option("--context", window, "tokens per window (default: min(the model's context, 1024))");
  add_cache_format_options(sub, kv_cache_dtype, attention_config);
  on_selected(sub, [sub] {
    const bool paged = sub->count("--kv-cache-dtype") > 0 || sub->count("--attention-config") > 0;
    CacheConfig cache_config;
    apply_cache_format_flags(kv_cache_dtype, attention_config, cache_config);
    cache_config.device = parse_device(device);
    if (model_dir.empty()) model_dir = default_model_dir();
    const int64_t context = model_context_length(model_dir);
    if (window == 0) window = std::min<int64_t>(context, 1024);
    SPARROW_CHECK(window >= 2 && window <= context, "--context must be between 2 and the model's context (", context,
                  "), got ", window);
    std::ifstream in(text_path, std::ios::binary);
    SPARROW_CHECK(in, text_path, ": cannot open");
    std::stringstream text;
    text << in.rdbuf();

    auto tokenizer = load_tokenizer(model_dir);
    auto model = load_cli_model(model_dir, device);
    ModelRunner runner(*model, cli_runner_options());
    const std::vector<int32_t> ids = tokenizer->encode_with_special_tokens(text.str());
    double total_nll = 0;
    int64_t scored = 0;
    for (const std::vector<int32_t>& chunk : perplexity_windows(ids, window)) {
      Tensor logits;
      if (paged) {
        logits = forward_in_kv_cache(runner, chunk, cache_config);
      } else {
        SequenceState state = runner.new_sequence();
        logits = runner.run(make_batch({{&state, chunk}})).to(Device::Cpu);
      }
      total_nll += window_nll(logits, chunk);
      scored += int64_t(chunk.size()) - 1;
    }
    SPARROW_CHECK(scored > 0, text_path, ": the text has fewer than two tokens; nothing to score");
    const double mean_nll = total_nll / double(scored);
    nlohmann::json out = {
        {"perplexity", std::exp(mean_nll)}, {"mean_nll", mean_nll}, {"tokens", scored}, {"window", window}};
    if (paged) {
      out["kv_cache_dtype"] = kv_cache_dtype;
      out["indexer_kv_dtype"] = cache_config.indexer_kv_dtype;
    }
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace sparrow::cli
