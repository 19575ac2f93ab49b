// The real chat templates rendering a fuzzed request: messages, tools, documents and
// chat_template_kwargs as a client sends them. Input: one byte choosing the template, then the request's
// JSON text. A bad request or a template's own raise_exception must be a sparrow::Error.
#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "template/chat_template.h"

using namespace sparrow;

namespace {

// The bundled models' templates with their special tokens, and the other families' templates
// (tests/data/templates) with a sibling model's special tokens.
const std::vector<std::unique_ptr<ChatTemplate>>& templates() {
  static const std::vector<std::unique_ptr<ChatTemplate>> all = [] {
    std::vector<std::unique_ptr<ChatTemplate>> t;
    auto add = [&](const char* model, const char* file) {
      t.push_back(std::make_unique<ChatTemplate>(
          ChatTemplate::load(fuzz::source_path(model), file ? fuzz::source_path(file) : "")));
    };
    add("models/kimi_k3", nullptr);
    add("models/minimax_m3", nullptr);
    add("models/deepseek_v32", nullptr);
    add("models/kimi_k3", "tests/data/templates/kimi-k2.jinja");
    add("models/kimi_k3", "tests/data/templates/kimi-k2-thinking.jinja");
    add("models/minimax_m3", "tests/data/templates/minimax-m2.jinja");
    return t;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const ChatTemplate& chat_template = *templates()[data[0] % templates().size()];
  auto request = nlohmann::ordered_json::parse(fuzz::as_text(data + 1, size - 1), nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded()) return 0;
  fuzz::refusing_only_with_errors([&] { chat_template.render(request); });
  return 0;
}
