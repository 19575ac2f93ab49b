// The Jinja interpreter on fuzzed template text (a --chat-template file, or a model's chat_template),
// rendering one fixed conversation with tools. Syntax and runtime errors must be sparrow::Errors.
#include <cstdint>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "template/chat_template.h"

using namespace sparrow;

namespace {

const nlohmann::ordered_json& conversation() {
  static const nlohmann::ordered_json request = [] {
    auto all = nlohmann::ordered_json::parse(fuzz::read_file(fuzz::source_path("tests/data/templates/conversations.json")));
    for (const auto& c : all)
      if (c["name"] == "reasoning_with_tools") return c["request"];
    std::abort();
  }();
  return request;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  jinja::Dict special_tokens;
  special_tokens.set("bos_token", "<s>");
  special_tokens.set("eos_token", "</s>");
  fuzz::refusing_only_with_errors([&] {
    ChatTemplate chat_template({{"default", std::string(fuzz::as_text(data, size))}}, special_tokens);
    chat_template.render(conversation());
  });
  return 0;
}
