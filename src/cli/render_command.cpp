// sparrow render [--model DIR] --request FILE.json
// Prints the prompt that the model's chat template makes of an OpenAI chat request (messages,
// tools, add_generation_prompt, continue_final_message, chat_template_kwargs), byte for byte and
// with nothing added, not even a final newline.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_input.h"
#include "template/chat_template.h"

namespace sparrow::cli {

void add_render(CLI::App& app) {
  auto* sub = app.add_subcommand("render", "Render a chat request into the prompt text with the model's chat template");
  static std::string model_dir, request_path;
  sub->add_option(
      "--model", model_dir,
      "Hugging Face model folder (tokenizer_config.json / chat_template.jinja; default: the bundled model)");
  sub->add_option("--request", request_path, "JSON file holding an OpenAI chat-completions request")->required();
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    ChatTemplate chat_template = ChatTemplate::load(model_dir);
    std::ifstream in(request_path, std::ios::binary);
    SPARROW_CHECK(in, request_path, ": cannot open");
    std::stringstream text;
    text << in.rdbuf();
    auto request = parse_json_input<nlohmann::ordered_json>(text.str());
    SPARROW_CHECK(request.status != decltype(request)::Status::TooDeep, request_path,
                  ": nests arrays and objects more than ", kMaxJsonDepth, " levels deep (the limit)");
    SPARROW_CHECK(request.ok(), request_path, ": not valid JSON");
    std::string prompt = chat_template.render(request.value);
    std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  });
}

}  // namespace sparrow::cli
