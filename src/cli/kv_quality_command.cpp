// sparrow bench kv-quality [--model DIR] --file TEXT [--context N] [--kv-cache-dtype D,...]
//                          [--indexer-kv-dtype D,...]
// The quality of the quantised cache formats (issue 7, docs/cache.md), on the CPU: the text is scored as
// `sparrow perplexity` scores it, once per format through a paged KvCache, and each format prints one JSON
// line: its perplexity, the bfloat16 and float32 caches' perplexities beside it, the largest and mean
// |logit - logit with a float32 cache| over every scored position, and, for models with an indexer (DSA
// keys, MSA blocks), the recall of the exact top-k set: per (query, layer[, index head]) that has more
// keys / blocks than it keeps, |kept with the cached keys ∩ kept with the exact fp32 keys| / |exact set|,
// averaged (model/selection_probe.h). The recall isolates the index keys' rounding: both selections use
// the same query in the same forward. Formats run: every --kv-cache-dtype with its "auto" index keys,
// then (for models with an indexer) every --indexer-kv-dtype over a float32 cache.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/text_generation.h"
#include "core/error.h"
#include "model/model.h"
#include "model/selection_probe.h"

namespace sparrow::cli {

namespace {

struct Measured {
  double nll = 0;
  int64_t scored = 0;
  std::vector<Tensor> logits;  // per window
  SelectionProbe probe;
};

Measured measure(ModelRunner& runner, const std::vector<std::vector<int32_t>>& windows, const CacheConfig& config) {
  Measured m;
  selection_probe() = &m.probe;
  try {
    for (const std::vector<int32_t>& chunk : windows) {
      m.logits.push_back(forward_in_kv_cache(runner, chunk, config));
      m.nll += window_nll(m.logits.back(), chunk);
      m.scored += int64_t(chunk.size()) - 1;
    }
  } catch (...) {
    selection_probe() = nullptr;
    throw;
  }
  selection_probe() = nullptr;
  return m;
}

}  // namespace

void add_bench_kv_quality(CLI::App* bench) {
  auto* sub = bench->add_subcommand("kv-quality",
                                    "Perplexity, logit error and indexer top-k recall of each KV-cache format (CPU)");
  static std::string model_dir, text_path;
  static int64_t window = 0;
  static std::vector<std::string> kv_dtypes = {"float32", "bfloat16", "fp8", "fp8_per_tensor", "nvfp4"};
  static std::vector<std::string> index_dtypes = {"float32", "bfloat16", "fp8", "mxfp4", "nvfp4"};
  sub->add_option("--model", model_dir, "Hugging Face model folder (default: the bundled model)");
  sub->add_option("--file", text_path, "UTF-8 text file to score")->required();
  sub->add_option("--context", window, "tokens per window (default: min(the model's context, 1024))");
  sub->add_option("--kv-cache-dtype", kv_dtypes, "cache formats to measure (index keys auto)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--indexer-kv-dtype", index_dtypes,
                  "index-key formats to measure over a float32 cache (models with an indexer)")
      ->delimiter(',')
      ->capture_default_str();
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    const int64_t context = model_context_length(model_dir);
    if (window == 0) window = std::min<int64_t>(context, 1024);
    SPARROW_CHECK(window >= 2 && window <= context, "--context must be between 2 and the model's context (", context,
                  "), got ", window);
    // Every format is checked before the first is measured.
    std::vector<CacheConfig> configs;
    for (const std::string& kv : kv_dtypes) {
      configs.emplace_back();
      apply_cache_format_flags(kv, "", configs.back());
    }
    std::ifstream in(text_path, std::ios::binary);
    SPARROW_CHECK(in, text_path, ": cannot open");
    std::stringstream text;
    text << in.rdbuf();
    auto tokenizer = load_tokenizer(model_dir);
    auto model = load_cli_model(model_dir, "cpu");
    ModelRunner runner(*model, cli_runner_options());
    bool has_indexer = false;
    for (const LayerCacheSpec& layer : model->cache_spec())
      has_indexer |= layer.page(PageKind::DsaIndexKey) || layer.page(PageKind::MsaIndexKey);
    if (has_indexer)
      for (const std::string& index : index_dtypes) {
        configs.emplace_back();
        apply_cache_format_flags("float32", nlohmann::json{{"indexer_kv_dtype", index}}.dump(), configs.back());
      }

    const std::vector<std::vector<int32_t>> windows =
        perplexity_windows(tokenizer->encode_with_special_tokens(text.str()), window);
    SPARROW_CHECK(!windows.empty(), text_path, ": the text has fewer than two tokens; nothing to score");
    auto perplexity = [](const Measured& m) { return std::exp(m.nll / double(m.scored)); };
    CacheConfig reference_config, bf16_config;
    apply_cache_format_flags("float32", "", reference_config);
    apply_cache_format_flags("bfloat16", "", bf16_config);
    const Measured reference = measure(runner, windows, reference_config);
    const double bf16_perplexity = perplexity(measure(runner, windows, bf16_config));

    for (const CacheConfig& config : configs) {
      const Measured m = measure(runner, windows, config);
      double max_error = 0, sum_error = 0;
      int64_t count = 0;
      for (size_t w = 0; w < windows.size(); ++w) {
        const Tensor &a = m.logits[w], &b = reference.logits[w];
        for (int64_t i = 0; i < a.numel(); ++i) {
          const double e = std::abs(double(a.data()[i]) - double(b.data()[i]));
          max_error = std::max(max_error, e);
          sum_error += e;
        }
        count += a.numel();
      }
      // The index keys' format as the planner resolves "auto" (on the CPU: the kv dtype's counterpart).
      CacheConfig planned = config;
      planned.memory_bytes = int64_t(1) << 40;
      const CachePlan plan = plan_cache(model->cache_spec(), planned);
      nlohmann::json out = {{"model_type", model->model_type()},
                            {"kv_cache_dtype", config.kv_cache_dtype},
                            {"indexer_kv_dtype", has_indexer ? nlohmann::json(cache_dtype_name(plan.index_dtype))
                                                             : nlohmann::json(nullptr)},
                            {"tokens", m.scored},
                            {"window", window},
                            {"perplexity", perplexity(m)},
                            {"perplexity_float32", perplexity(reference)},
                            {"perplexity_bfloat16", bf16_perplexity},
                            {"logit_max_abs_error", max_error},
                            {"logit_mean_abs_error", sum_error / double(count)}};
      if (has_indexer) {
        out["topk_recall"] = m.probe.recall();
        out["recall_rows"] = m.probe.rows;
      } else {
        out["topk_recall"] = nullptr;
      }
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
    }
  });
}

}  // namespace sparrow::cli
