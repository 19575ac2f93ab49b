// sparrow generate --model DIR --prompt-ids FILE.json --max-tokens N [--temperature T] [--top-p P]
//                  [--top-k K] [--seed S] [--ignore-eos]
// Prints {"completions": [[id, ...], ...]}. Temperature 0 is greedy.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "engine/generate.h"
#include "model/model.h"

namespace sparrow::cli {

void add_generate(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "Continue prompts token by token");
  static std::string model_dir, prompts_path;
  static GenerateOptions options;
  static int64_t seed = -1;
  static bool ignore_eos = false;
  options.sampling.temperature = 1.0f;
  sub->add_option("--model", model_dir, "Hugging Face model folder")->required();
  sub->add_option("--prompt-ids", prompts_path, "JSON file {\"prompts\": [[id, ...], ...]}")->required();
  sub->add_option("--max-tokens", options.max_tokens, "tokens to generate per prompt")->required();
  sub->add_option("--temperature", options.sampling.temperature, "0 = greedy");
  sub->add_option("--top-p", options.sampling.top_p, "nucleus sampling mass");
  sub->add_option("--top-k", options.sampling.top_k, "keep the k most likely tokens (0 = all)");
  sub->add_option("--seed", seed, "random seed (prompt i uses seed + i)");
  sub->add_flag("--ignore-eos", ignore_eos, "do not stop at the end-of-sequence token");
  on_selected(sub, [] {
    auto prompts = read_prompt_ids(prompts_path);
    if (seed >= 0) options.sampling.seed = uint64_t(seed);
    validate(options.sampling);
    SPARROW_CHECK(options.max_tokens >= 0, "--max-tokens must be >= 0");
    auto model = load_model(model_dir);
    for (size_t i = 0; i < prompts.size(); ++i)
      for (int32_t id : prompts[i])
        SPARROW_CHECK(id < model->vocab_size(), prompts_path, ": prompt ", i, " holds id ", id,
                      " outside the vocabulary (", model->vocab_size(), ")");
    if (!ignore_eos) options.stop_token_ids = eos_token_ids(model_dir);
    nlohmann::json out = {{"completions", generate(*model, prompts, options)}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace sparrow::cli
