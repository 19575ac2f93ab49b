// sparrow score [--model DIR] --prompt-ids FILE.json --out FILE.safetensors
// Writes the logits at every position of every prompt (`logits.<i>`, float32 [len, vocab]), as
// transformers' model(input_ids).logits. A prompt with images ({"ids": [...], "images": [...]}) has each image's
// placeholder rows replaced by the vision tower's embeddings (docs/vision.md).
#include "cli/commands.h"
#include "core/error.h"
#include "core/wire.h"
#include "formats/safetensors.h"
#include "model/model.h"
#include "model/vision_encoder.h"

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
    const PromptFile file = read_prompt_file(prompts_path);
    const std::vector<std::vector<int32_t>>& prompts = file.ids;
    auto model = load_cli_model(model_dir, device, GroupRole::EveryGroupTakesAShare);
    const VisionEncoder* tower = model->vision();
    SPARROW_CHECK(!file.has_images() || tower, prompts_path, ": a prompt has images, but ", model_dir,
                  " has no vision tower");
    for (size_t i = 0; i < prompts.size(); ++i)
      for (int32_t id : prompts[i])
        SPARROW_CHECK(id < model->vocab_size(), prompts_path, ": prompt ", i, " holds id ", id,
                      " outside the vocabulary (", model->vocab_size(), ")");
    // Under data parallelism every group scores its share of the prompts and rank 0 writes them all.
    ModelRunner runner(*model, cli_runner_options());
    const std::vector<size_t> share = cli_group_share(prompts.size());
    wire::Writer mine;
    mine.put<uint64_t>(share.size());
    for (size_t i : share) {
      SequenceState state = runner.new_sequence();
      Batch batch = make_batch({{&state, prompts[i]}});
      ImageRows rows;
      if (tower)
        for (const vision::ImageInput& image : prompt_images(file, i, model_dir, tower->image_token_id()))
          rows.add(0, 0, int64_t(prompts[i].size()), image.offset, tower->embed(image.pixel_values, {image.grid}));
      rows.attach_to(batch);
      const Tensor logits = runner.run(batch).to(Device::Cpu);
      mine.put<uint64_t>(i);
      mine.put<int64_t>(logits.dim(0));
      mine.put(std::vector<float>(logits.data(), logits.data() + logits.numel()));
    }
    const std::vector<std::vector<uint8_t>> shares = cli_gather_shares(runner, std::move(mine.bytes));
    if (shares.empty()) return;  // another group's leader: rank 0 writes the file
    std::vector<std::pair<std::string, Tensor>> out(prompts.size());
    for (const std::vector<uint8_t>& bytes : shares) {
      wire::Reader reader(bytes, "scored prompts");
      for (uint64_t n = reader.get<uint64_t>(); n > 0; --n) {
        const uint64_t i = reader.get<uint64_t>();
        const int64_t rows = reader.get<int64_t>();
        const std::vector<float> values = reader.get_vector<float>();
        SPARROW_CHECK(i < prompts.size() && rows > 0 && int64_t(values.size()) % rows == 0, "scored prompts: entry ", i);
        Tensor logits = Tensor::empty({rows, int64_t(values.size()) / rows});
        std::copy(values.begin(), values.end(), logits.data());
        out[i] = {"logits." + std::to_string(i), std::move(logits)};
      }
      reader.finish();
    }
    write_safetensors(out_path, out);
  });
}

}  // namespace sparrow::cli
