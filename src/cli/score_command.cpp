// sparrow score [--model DIR] --prompt-ids FILE.json --out FILE.safetensors
// Writes the logits at every position of every prompt (`logits.<i>`, float32 [len, vocab]), as
// transformers' model(input_ids).logits.
#include "cli/commands.h"
#include "core/error.h"
#include "formats/safetensors.h"
#include "model/model.h"

namespace sparrow::cli {

void add_score(CLI::App& app) {
  auto* sub = app.add_subcommand("score", "Logits at every position of each prompt, to a safetensors file");
  static std::string model_dir, prompts_path, out_path, device = "cpu";
  sub->add_option("--model", model_dir, "Hugging Face model folder (default: the bundled model)");
  sub->add_option("--prompt-ids", prompts_path, "JSON file {\"prompts\": [[id, ...], ...]}")->required();
  sub->add_option("--out", out_path, "output .safetensors")->required();
  add_device_option(sub, device);
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    auto prompts = read_prompt_ids(prompts_path);
    auto model = load_cli_model(model_dir, device);
    ModelRunner runner(*model, cli_runner_options());
    std::vector<std::pair<std::string, Tensor>> out;
    for (size_t i = 0; i < prompts.size(); ++i) {
      for (int32_t id : prompts[i])
        SPARROW_CHECK(id < model->vocab_size(), prompts_path, ": prompt ", i, " holds id ", id,
                      " outside the vocabulary (", model->vocab_size(), ")");
      SequenceState state = runner.new_sequence();
      out.push_back({"logits." + std::to_string(i), runner.run(make_batch({{&state, prompts[i]}})).to(Device::Cpu)});
    }
    write_safetensors(out_path, out);
  });
}

}  // namespace sparrow::cli
