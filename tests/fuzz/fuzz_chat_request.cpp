// A /v1/chat/completions body, as the server reads it: the JSON parse, parse_chat_request, then what the
// handler derives from the request before any model runs: the tool parsers built from `tools` (their
// JSON schemas), the reasoning options read from chat_template_kwargs. A bad body must be refused with a
// 400 (ApiError) or a sparrow::Error, never anything else.
#include <cstdint>

#include "fuzz_util.h"
#include "server/api_error.h"
#include "server/openai_requests.h"
#include "server/parsers/parser.h"

using namespace sparrow;
using namespace sparrow::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Json body = parse_json_object(std::string(fuzz::as_text(data, size)));
    ChatRequest request = parse_chat_request(body, SamplingParams{}, kMaxLogprobs);
    // The handler hands the parsers plain nlohmann::json copies (chat_completion.cpp make_choice).
    nlohmann::json tools = nlohmann::json::parse(request.tools.dump());
    nlohmann::json kwargs = nlohmann::json::parse(request.template_input["chat_template_kwargs"].dump());
    for (const std::string& name : parsers::parser_names()) {
      parsers::make_tool_parser(name, tools, /*id_seed=*/1);
      parsers::make_reasoning_parser(name, parsers::reasoning_options(name, kwargs, "prompt"));
    }
  } catch (const ApiError&) {
  } catch (const Error&) {
  }
  return 0;
}
