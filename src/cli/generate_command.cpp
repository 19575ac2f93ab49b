// sparrow generate [--model DIR] (--prompt TEXT | --prompt-ids FILE.json) [--max-tokens N] [--temperature T]
//                  [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--speculative-config JSON]
//   --prompt      continues raw text (no chat template; no BOS unless tokenizer_config.json's
//                 add_bos_token) and streams the continuation's text to stdout as it is decoded.
//   --prompt-ids  continues each id list of {"prompts": [[id, ...], ...]} and prints
//                 {"completions": [[id, ...], ...]}.
// Without --model, the bundled model. Temperature 0 is greedy.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/text_generation.h"
#include "core/error.h"
#include "core/wire.h"
#include "engine/generate.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "tokenizer/detokenizer.h"

namespace sparrow::cli {
namespace {

// With speculative decoding, a line on stderr as vLLM logs its SpecDecoding metrics (one per data-parallel
// group, each counting its own share of the prompts).
void print_speculation(const SpeculativeConfig& config, const SpecDecodeStats& stats) {
  if (!config.enabled()) return;
  const std::string group =
      cli_data_parallel_size() > 1 ? " (data-parallel group " + std::to_string(cli_data_parallel_rank()) + ")" : "";
  std::fprintf(stderr, "sparrow: speculative decoding%s: mean acceptance length %.2f, %lld of %lld draft tokens "
               "accepted in %lld verify steps\n", group.c_str(), stats.acceptance_length(),
               static_cast<long long>(stats.accepted_tokens), static_cast<long long>(stats.draft_tokens),
               static_cast<long long>(stats.drafts));
}

// Streams the continuation of `prompt_text` (the end token itself is not written).
void generate_text(const std::string& model_dir, const std::string& device, const std::string& prompt_text,
                   GenerateOptions options) {
  auto tokenizer = load_tokenizer(model_dir);
  auto model = load_cli_model(model_dir, device);
  options.runner = cli_runner_options();  // after the load: on rank 0 of a tensor-parallel run, its workers
  auto draft = load_draft_model(options.speculative, model_dir, device, *model);
  options.draft_model = draft.get();
  std::vector<int32_t> prompt = tokenizer->encode_with_special_tokens(prompt_text);
  IncrementalDetokenizer detokenizer(*tokenizer);
  SpecDecodeStats spec_stats;
  options.spec_stats = &spec_stats;
  generate_streaming(*model, prompt, options, model_context_length(model_dir), [&](int32_t token) {
    if (!options.stop_token_ids.count(token)) write_now(detokenizer.push(token).text);
  });
  write_now(detokenizer.finish().text + "\n");
  print_speculation(options.speculative, spec_stats);
}

}  // namespace

void add_generate(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "Continue a text prompt (streamed) or token-id prompts (JSON)");
  static std::string model_dir, prompt_text, prompts_path, device = "cpu", speculative_config;
  static GenerateOptions options;
  static int64_t seed = -1;
  static bool ignore_eos = false;
  options.sampling.temperature = 1.0f;
  options.max_tokens = 128;
  sub->add_option("--model", model_dir, "Hugging Face model folder (default: the bundled model)");
  auto* text = sub->add_option("--prompt", prompt_text, "text to continue; the continuation is streamed to stdout");
  auto* ids = sub->add_option("--prompt-ids", prompts_path, "JSON file {\"prompts\": [[id, ...], ...]}");
  sub->add_option("--max-tokens", options.max_tokens, "tokens to generate per prompt")->capture_default_str();
  sub->add_option("--temperature", options.sampling.temperature, "0 = greedy")->capture_default_str();
  sub->add_option("--top-p", options.sampling.top_p, "nucleus sampling mass");
  sub->add_option("--top-k", options.sampling.top_k, "keep the k most likely tokens (0 = all)");
  sub->add_option("--seed", seed, "random seed (prompt i uses seed + i)");
  sub->add_flag("--ignore-eos", ignore_eos, "do not stop at the end-of-sequence token");
  add_device_option(sub, device);
  add_speculative_option(sub, speculative_config);
  on_selected(sub, [text, ids] {
    SPARROW_CHECK(text->count() + ids->count() == 1, "generate needs exactly one of --prompt TEXT and --prompt-ids FILE");
    if (model_dir.empty()) model_dir = default_model_dir();
    if (seed >= 0) options.sampling.seed = uint64_t(seed);
    validate(options.sampling);
    SPARROW_CHECK(options.max_tokens >= 0, "--max-tokens must be >= 0");
    if (!ignore_eos) options.stop_token_ids = eos_token_ids(model_dir);
    options.speculative = read_speculative_config(speculative_config);
    if (text->count()) return generate_text(model_dir, device, prompt_text, options);

    const PromptFile file = read_prompt_file(prompts_path);
    const std::vector<std::vector<int32_t>>& prompts = file.ids;
    auto model = load_cli_model(model_dir, device, GroupRole::EveryGroupTakesAShare);
    SPARROW_CHECK(!file.has_images() || model->vision(), prompts_path, ": a prompt has images, but ", model_dir,
                  " has no vision tower");
    options.runner = cli_runner_options();
    auto draft = load_draft_model(options.speculative, model_dir, device, *model);
    options.draft_model = draft.get();
    for (size_t i = 0; i < prompts.size(); ++i)
      for (int32_t id : prompts[i])
        SPARROW_CHECK(id < model->vocab_size(), prompts_path, ": prompt ", i, " holds id ", id,
                      " outside the vocabulary (", model->vocab_size(), ")");
    // Under data parallelism every group generates its share of the prompts (with their own seeds) and rank 0
    // prints them all.
    options.numbers = cli_group_share(prompts.size());
    std::vector<std::vector<int32_t>> mine;
    for (size_t i : options.numbers) {
      mine.push_back(prompts[i]);
      if (file.has_images())
        options.images.push_back(prompt_images(file, i, model_dir, model->vision()->image_token_id()));
    }
    SpecDecodeStats spec_stats;
    options.spec_stats = &spec_stats;
    const std::vector<std::vector<int32_t>> completions = generate(*model, mine, options);
    print_speculation(options.speculative, spec_stats);
    wire::Writer message;
    message.put<uint64_t>(mine.size());
    for (size_t j = 0; j < mine.size(); ++j) {
      message.put<uint64_t>(options.numbers[j]);
      message.put(completions[j]);
    }
    ModelRunner idle(*model, options.runner);
    const std::vector<std::vector<uint8_t>> shares = cli_gather_shares(idle, std::move(message.bytes));
    if (shares.empty()) return;  // another group's leader: rank 0 prints
    std::vector<std::vector<int32_t>> all(prompts.size());
    for (const std::vector<uint8_t>& bytes : shares) {
      wire::Reader reader(bytes, "generated completions");
      for (uint64_t n = reader.get<uint64_t>(); n > 0; --n) {
        const uint64_t i = reader.get<uint64_t>();
        SPARROW_CHECK(i < prompts.size(), "generated completions: prompt ", i);
        all[i] = reader.get_vector<int32_t>();
      }
      reader.finish();
    }
    nlohmann::json out = {{"completions", all}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace sparrow::cli
