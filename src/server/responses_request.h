// The body of POST /v1/responses (OpenAI's Responses API, as vLLM 0.33 serves it:
// vllm/entrypoints/openai/responses/protocol.py ResponsesRequest, utils.py construct_input_messages),
// turned into the ChatRequest that the chat path renders and generates (chat_prompt.h), plus what the
// response object echoes.
//
// Input items become chat messages, in order: `instructions` first as a system message; a string
// `input` is one user message; a message item keeps its role ("developer" becomes "system", the role
// chat templates know), its text parts joined by newlines; `reasoning`, assistant `message` and
// `function_call` items merge into one assistant message while its slot for them is empty (vLLM's
// rule: a reasoning item, then the text, then the calls of one turn); `function_call_output` items
// become tool messages, named by the function their call_id called. A final assistant message with status "in_progress"
// or "incomplete" is continued (continue_final_message), as vLLM does. A user or system message's input_image parts
// (image_url: a data: URL, or a file:// URL under --allowed-local-media-path) become the template's image
// placeholders and the ChatRequest's images, as chat's image_url parts do (chat_images.h; docs/vision.md).
//
// Unlike the chat endpoints, a field this endpoint does not know is a 400 naming it (OpenAI's own
// Responses API refuses unknown parameters), and so is a known one sparrow cannot honour:
// previous_response_id, conversation, background, prompt, item_reference items (sparrow keeps no
// responses), tools other than functions, input_file / input_audio parts and images given by file_id,
// truncation "auto", max_tool_calls.
#pragma once
#include <cstdint>
#include <string>

#include "engine/sampler.h"
#include "server/json_fields.h"
#include "server/openai_requests.h"

namespace sparrow::server {

struct ResponsesRequest {
  ChatRequest chat;  // messages, tools in the chat shape, tool_choice, sampling, max_tokens, stream, ...

  // Echoed in the response object: the request's values, or the defaults it stands for.
  Json instructions = nullptr;                   // a string, or null
  Json metadata = nullptr;                       // an object of strings, or null
  Json tools = Json::array();                    // the request's tools, in the flat Responses shape
  Json tool_choice = "none";                     // as given; default "auto" with tools, else "none"
  Json text = {{"format", {{"type", "text"}}}};  // the text config as given, or plain text
  Json reasoning = nullptr;                      // {"effort", "summary"}, or null
  Json user = nullptr, safety_identifier = nullptr, prompt_cache_key = nullptr;
  std::string service_tier = "auto", truncation = "disabled";
  bool store = true;  // accepted and echoed; sparrow never stores a response

  bool output_logprobs = false;  // include holds "message.output_text.logprobs"
  int64_t top_logprobs = 0;
};

// 400 ApiErrors name the field at fault (e.g. "input[2].type", "text.format.schema").
ResponsesRequest parse_responses_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs);

}  // namespace sparrow::server
