// sparrow perplexity [--model DIR] --file TEXT_FILE [--context N]
// Prints {"perplexity", "mean_nll", "tokens", "window"} as JSON. The recipe is that of
// tools/perplexity_reference.py, which measures the same with transformers: the file's ids (no special
// tokens added, BOS only if add_bos_token), cut into consecutive non-overlapping windows of
// N = min(context length, 1024) tokens (the last may be shorter); one forward per window, in which each
// token after the first is scored by the log-softmax at the position before it.
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

void add_perplexity(CLI::App& app) {
  auto* sub = app.add_subcommand("perplexity", "Perplexity of the model on a text file (JSON on stdout)");
  static std::string model_dir, text_path, device = "cpu";
  static int64_t window = 0;
  sub->add_option("--model", model_dir, "Hugging Face model folder (default: the bundled model)");
  add_device_option(sub, device);
  sub->add_option("--file", text_path, "UTF-8 text file to score")->required();
  sub->add_option("--context", window, "tokens per window (default: min(the model's context, 1024))");
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    const int64_t context = context_length(model_dir);
    if (window == 0) window = std::min<int64_t>(context, 1024);
    SPARROW_CHECK(window >= 2 && window <= context, "--context must be between 2 and the model's context (", context,
                  "), got ", window);
    std::ifstream in(text_path, std::ios::binary);
    SPARROW_CHECK(in, text_path, ": cannot open");
    std::stringstream text;
    text << in.rdbuf();

    auto tokenizer = load_tokenizer(model_dir);
    auto model = load_cli_model(model_dir, device);
    const std::vector<int32_t> ids = text_prompt_ids(*tokenizer, model_dir, text.str());
    double total_nll = 0;
    int64_t scored = 0;
    for (size_t start = 0; start < ids.size(); start += size_t(window)) {
      std::vector<int32_t> chunk(ids.begin() + start, ids.begin() + std::min(ids.size(), start + size_t(window)));
      if (chunk.size() < 2) continue;  // a lone token predicts nothing
      SequenceState state = model->new_sequence();
      Tensor logits = model->forward(make_batch({{&state, chunk}})).to(Device::Cpu);
      for (size_t i = 0; i + 1 < chunk.size(); ++i)
        total_nll -= token_logprob({logits.row(int64_t(i)), size_t(logits.row_size())}, chunk[i + 1], 0).logprob;
      scored += int64_t(chunk.size()) - 1;
    }
    SPARROW_CHECK(scored > 0, text_path, ": the text has fewer than two tokens; nothing to score");
    const double mean_nll = total_nll / double(scored);
    nlohmann::json out = {
        {"perplexity", std::exp(mean_nll)}, {"mean_nll", mean_nll}, {"tokens", scored}, {"window", window}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace sparrow::cli
