#include "server/responses_request.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <string_view>

#include "server/api_error.h"

namespace sparrow::server {
namespace {

// The fields /v1/responses reads: OpenAI's request fields and the vLLM extras sparrow honours. The
// ones sparrow refuses (previous_response_id, background, ...) are known too, so that their 400 can
// say why.
// clang-format off
constexpr std::string_view kKnownFields[] = {
    "model", "input", "instructions", "max_output_tokens", "stream", "stream_options", "temperature", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls",
    "text", "structured_outputs", "reasoning", "include_reasoning", "include", "top_logprobs", "store",
    "previous_response_id", "conversation", "background", "prompt", "metadata", "user", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "service_tier", "truncation", "chat_template_kwargs", "request_id",
    "priority", "cache_salt"};
// clang-format on

void check_known_fields(const Json& body) {
  for (auto it = body.begin(); it != body.end(); ++it)
    if (std::find(std::begin(kKnownFields), std::end(kKnownFields), it.key()) == std::end(kKnownFields))
      bad_request("Unknown parameter: '" + it.key() + "'. /v1/responses does not take it (see docs/server.md)",
                  it.key());
}

// A string field that must be one of `allowed`.
std::optional<std::string> one_of(const Fields& f, const std::string& name,
                                  std::initializer_list<const char*> allowed) {
  auto value = f.string(name);
  if (!value) return value;
  std::string list;
  for (const char* a : allowed) {
    if (*value == a) return value;
    list += std::string(list.empty() ? "" : ", ") + "'" + a + "'";
  }
  f.invalid(name, "must be one of " + list + ", got '" + *value + "'");
}

// A field sparrow does not implement: accepted only as null (or `allowed`), else a 400 saying why.
void refuse_unless(const Fields& f, const std::string& name, const Json& allowed, const std::string& why) {
  const Json* value = f.get(name);
  if (value && *value != allowed) f.invalid(name, why);
}

// OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512.
Json parse_metadata(const Fields& f) {
  const Json* metadata = f.object("metadata");
  if (!metadata) return nullptr;
  if (metadata->size() > 16) f.invalid("metadata", "may hold at most 16 key-value pairs");
  for (auto it = metadata->begin(); it != metadata->end(); ++it) {
    if (it.key().size() > 64) f.invalid("metadata", "keys may be at most 64 characters long");
    if (!it->is_string() || it->get<std::string>().size() > 512)
      f.invalid("metadata", "values must be strings of at most 512 characters ('" + it.key() + "')");
  }
  return *metadata;
}

// A message's text part: its text (input_text, output_text, text) or refusal; false for another type.
bool text_part(const Fields& part, const std::string& type, std::string& text) {
  if (type == "input_text" || type == "output_text" || type == "text" || type == "refusal") {
    const char* key = type == "refusal" ? "refusal" : "text";
    auto t = part.string(key);
    if (!t) part.invalid(key, "is required and must be a string");
    text = *t;
    return true;
  }
  return false;
}

// The 400 for a content part that is neither text nor, where images may go, input_image.
[[noreturn]] void refuse_part(const Fields& part, const std::string& where, const std::string& type) {
  if (type == "input_image" || type == "input_file" || type == "input_audio")
    bad_request("`" + where + "`: content parts of type '" + type +
                    "' are not supported here (images go in user and system messages; audio and files are not "
                    "supported)",
                part.param("type"));
  part.invalid("type", "'" + type + "' is not a content part type (\"input_text\", \"input_image\", \"output_text\", "
                       "\"refusal\")");
}

// A message's content as a list of parts: a string is one text part; in a list, text parts become
// {"type": "text", "text"} and, where `images` is given (user and system messages), each input_image part
// {"type": "image"} (the Hugging Face templates' image placeholder), its URL appended to `images` (OpenAI's
// input_image: "image_url", a URL or a data: URL, or "file_id", which needs the Files API sparrow does not serve;
// "detail" accepted, as vLLM does: the processor decides the resolution). Any other part is a 400 naming it.
Json content_parts(const Json& content, const std::string& where, std::vector<ImageUrl>* images) {
  if (content.is_string()) return Json::array({{{"type", "text"}, {"text", content}}});
  if (!content.is_array()) bad_request("`" + where + "` must be a string or a list of content parts", where);
  Json parts = Json::array();
  for (size_t i = 0; i < content.size(); ++i) {
    std::string part_where = where + "[" + std::to_string(i) + "]";
    Fields part(content[i], part_where);
    auto type = part.string("type");
    if (!type)
      part.invalid("type", images ? "is required (\"input_text\" or \"input_image\")"
                                  : "is required (\"input_text\" or \"output_text\")");
    std::string text;
    if (images && *type == "input_image") {
      if (part.has("file_id"))
        part.invalid("file_id", "is not supported: sparrow serves no Files API; send the image as image_url (a data: "
                                "URL, or a file:// URL under --allowed-local-media-path)");
      auto url = part.string("image_url");
      if (!url) part.invalid("image_url", "is required and must be a string (a data: URL or a file:// URL)");
      one_of(part, "detail", {"auto", "low", "high"});
      images->push_back({*url, part.param("image_url")});
      parts.push_back({{"type", "image"}});
    } else if (text_part(part, *type, text)) {
      parts.push_back({{"type", "text"}, {"text", text}});
    } else {
      refuse_part(part, part_where, *type);
    }
  }
  return parts;
}

// Text parts joined by newlines (vLLM's "string" content format).
std::string joined_text(const Json& parts) {
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? "\n" : "") + parts[i]["text"].get<std::string>();
  return text;
}

// The text of a message that carries no images (an assistant's, a tool's output).
std::string content_text(const Json& content, const std::string& where) {
  return joined_text(content_parts(content, where, nullptr));
}

// A user or system message's content as the chat template sees it: its text when it has no image, else its parts.
Json message_content(const Json& content, const std::string& where, std::vector<ImageUrl>& images) {
  const size_t before = images.size();
  Json parts = content_parts(content, where, &images);
  if (images.size() == before) return joined_text(parts);
  return parts;
}

// The chat messages of `input` (module comment in responses_request.h); `continue_final` is set when
// the last item is an assistant message still in progress (vLLM also continues a reasoning item; the
// templates here continue a message's content only).
class InputMessages {
 public:
  Json messages = Json::array();
  bool continue_final = false;
  std::vector<ImageUrl> images;  // the input_image parts, in message order

  void add_item(const Json& item, const std::string& where) {
    Fields f(item, where);
    std::string type = f.string("type").value_or("message");  // EasyInputMessage may leave it out
    continue_final = false;
    if (type == "message") {
      add_message(f, item, where);
    } else if (type == "function_call") {
      auto call_id = f.string("call_id"), name = f.string("name"), arguments = f.string("arguments");
      if (!call_id) f.invalid("call_id", "is required and must be a string");
      if (!name) f.invalid("name", "is required and must be a string");
      if (!arguments) f.invalid("arguments", "is required and must be a string (the call's JSON arguments)");
      Json call = {{"id", *call_id}, {"type", "function"}, {"function", {{"name", *name}, {"arguments", *arguments}}}};
      call_names_[*call_id] = *name;
      Json& message = assistant_with_free("tool_calls", true);
      if (!message.contains("tool_calls")) message["tool_calls"] = Json::array();
      message["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output") {
      auto call_id = f.string("call_id");
      if (!call_id) f.invalid("call_id", "is required and must be a string");
      const Json* output = f.get("output");
      if (!output) f.invalid("output", "is required (a string or a list of content parts)");
      Json message = {
          {"role", "tool"}, {"content", content_text(*output, f.param("output"))}, {"tool_call_id", *call_id}};
      // The function's name too, for templates that print it with the result (vLLM leaves it out).
      if (auto called = call_names_.find(*call_id); called != call_names_.end()) message["name"] = called->second;
      messages.push_back(std::move(message));
    } else if (type == "reasoning") {
      if (f.has("encrypted_content"))
        f.invalid("encrypted_content", "is not supported: sparrow neither makes nor reads encrypted reasoning");
      std::string text = reasoning_text(f);
      Json& message = assistant_with_free("reasoning", false);
      // `reasoning` is vLLM's name for it; the bundled chat templates read `reasoning_content`.
      message["reasoning"] = text;
      message["reasoning_content"] = text;
    } else if (type == "item_reference") {
      bad_request("`" + where +
                      "`: item references are not supported: sparrow does not store responses or items, "
                      "so send the items themselves",
                  where + ".type");
    } else {
      bad_request("`" + where + "`: input items of type '" + type +
                      "' are not supported (sparrow takes message, function_call, function_call_output and "
                      "reasoning items)",
                  where + ".type");
    }
  }

 private:
  void add_message(const Fields& f, const Json& item, const std::string& where) {
    auto role = f.string("role");
    if (!role) f.invalid("role", "is required and must be a string");
    if (*role != "user" && *role != "assistant" && *role != "system" && *role != "developer")
      f.invalid("role", "must be 'user', 'assistant', 'system' or 'developer', got '" + *role + "'");
    const Json* content = f.get("content");
    if (!content) f.invalid("content", "is required (a string or a list of content parts)");
    if (*role == "assistant") {
      assistant_with_free("content", false)["content"] = content_text(*content, f.param("content"));
      continue_final = in_progress(f);
      return;
    }
    // A developer message is the newer name of a system message; chat templates know only "system".
    messages.push_back(
        {{"role", *role == "developer" ? "system" : *role}, {"content", message_content(*content, f.param("content"), images)}});
  }

  static bool in_progress(const Fields& f) {
    auto status = f.string("status");
    return status == "in_progress" || status == "incomplete";
  }

  static std::string reasoning_text(const Fields& f) {
    // vLLM reads the reasoning text from `content` ("reasoning_text" parts), else from `summary`.
    for (const char* key : {"content", "summary"}) {
      const Json* parts = f.get(key);
      if (!parts) continue;
      if (!parts->is_array()) f.invalid(key, "must be a list of text parts");
      if (parts->empty()) continue;
      std::string text;
      for (size_t i = 0; i < parts->size(); ++i) {
        Fields part((*parts)[i], f.param(key) + "[" + std::to_string(i) + "]");
        auto t = part.string("text");
        if (!t) part.invalid("text", "is required and must be a string");
        text += (i ? "\n" : "") + *t;
      }
      return text;
    }
    return "";
  }

  // The assistant message this item belongs to: the last message when it is the assistant's and
  // `slot` is still free in it (for tool_calls: any number of calls), else a new one.
  Json& assistant_with_free(const char* slot, bool many) {
    if (!messages.empty()) {
      Json& last = messages.back();
      bool free = !last.contains(slot) || last[slot].is_null() || (many && last[slot].is_array());
      if (last["role"] == "assistant" && free) return last;
    }
    messages.push_back({{"role", "assistant"}, {"content", nullptr}});
    return messages.back();
  }

  std::map<std::string, std::string> call_names_;  // call_id -> the function called
};

// Flat Responses tools ({"type": "function", "name", "description", "parameters", "strict"}) as the
// chat tools the template renders and the parsers read ({"type": "function", "function": {...}}).
Json chat_tools(const Fields& f) {
  const Json* tools = f.get("tools");
  if (!tools) return nullptr;
  if (!tools->is_array()) f.invalid("tools", "must be a list of tools");
  if (tools->empty()) return nullptr;
  Json out = Json::array();
  for (size_t i = 0; i < tools->size(); ++i) {
    std::string where = "tools[" + std::to_string(i) + "]";
    Fields tool((*tools)[i], where);
    auto type = tool.string("type");
    if (type != "function")
      bad_request("`" + where + ".type` " + (type ? "'" + *type + "' is not supported" : std::string("is required")) +
                      ": sparrow serves function tools only (no hosted, custom or MCP tools)",
                  where + ".type");
    auto name = tool.string("name");
    if (!name) tool.invalid("name", "is required and must be a string");
    Json function = {{"name", *name}};
    if (auto description = tool.string("description")) function["description"] = *description;
    if (const Json* parameters = tool.object("parameters")) function["parameters"] = *parameters;
    if (auto strict = tool.boolean("strict")) function["strict"] = *strict;
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

// tool_choice: "none" | "auto" | "required" | {"type": "function", "name": ...} (flat, unlike chat's).
ToolChoice parse_tool_choice(const Fields& f, const Json& tools) {
  using Mode = ToolChoice::Mode;
  ToolChoice choice;
  choice.mode = tools.is_null() ? Mode::None : Mode::Auto;  // vLLM check_tool_usage
  const Json* value = f.get("tool_choice");
  if (!value) return choice;
  if (value->is_string()) {
    std::string mode = value->get<std::string>();
    if (mode == "none")
      choice.mode = Mode::None;
    else if (mode == "auto")
      choice.mode = tools.is_null() ? Mode::None : Mode::Auto;
    else if (mode == "required")
      choice.mode = Mode::Required;
    else
      f.invalid("tool_choice",
                "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}, got '" + mode + "'");
  } else {
    Fields c(*value, "tool_choice");
    auto type = c.string("type");
    if (type != "function")
      c.invalid("type", (type ? "'" + *type + "' is not supported" : std::string("is required")) +
                            ": sparrow forces function tools only ({\"type\": \"function\", \"name\": ...})");
    auto name = c.string("name");
    if (!name) c.invalid("name", "is required for a named tool choice");
    choice.mode = Mode::Named;
    choice.function_name = *name;
  }
  if (choice.mode == Mode::Required && tools.is_null())
    bad_request("tool_choice 'required' needs `tools`", "tool_choice");
  if (choice.mode == Mode::Named) {
    bool offered = !tools.is_null() && std::any_of(tools.begin(), tools.end(), [&](const Json& t) {
      return t["function"]["name"] == choice.function_name;
    });
    if (!offered)
      bad_request("tool_choice names the function '" + choice.function_name + "', which `tools` does not list",
                  "tool_choice.name");
  }
  return choice;
}

// text.format → the structured output: json_object, or json_schema {name, schema, strict, description}.
void parse_text_format(const Fields& f, ResponsesRequest& out) {
  const Json* text = f.object("text");
  if (!text) return;
  Fields t(*text, "text");
  one_of(t, "verbosity", {"low", "medium", "high"});  // accepted and echoed; no effect here
  out.text = *text;
  const Json* format = t.object("format");
  if (!format) {
    out.text["format"] = {{"type", "text"}};
    return;
  }
  Fields ft(*format, "text.format");
  auto type = one_of(ft, "type", {"text", "json_object", "json_schema"});
  if (!type) ft.invalid("type", "is required ('text', 'json_object' or 'json_schema')");
  if (*type == "text") return;
  SamplingParams& s = out.chat.sampling;
  if (s.structured.active())
    bad_request("Cannot specify both structured_outputs and text.format", "structured_outputs");
  structured::StructuredOutputSpec spec;
  if (*type == "json_object") {
    spec.kind = structured::StructuredOutputSpec::Kind::JsonObject;
    set_structured_output(s, std::move(spec), "text.format");
    return;
  }
  if (!ft.string("name")) ft.invalid("name", "is required for a json_schema format");
  ft.string("description");
  ft.boolean("strict");  // sparrow is always strict: the output follows the schema
  const Json* schema = ft.object("schema");
  if (!schema) ft.invalid("schema", "is required (a JSON schema object)");
  spec.kind = structured::StructuredOutputSpec::Kind::JsonSchema;
  spec.text = schema->dump();
  set_structured_output(s, std::move(spec), "text.format.schema");
}

}  // namespace

ResponsesRequest parse_responses_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs) {
  Fields f(body);
  check_known_fields(body);
  ResponsesRequest out;
  ChatRequest& chat = out.chat;
  chat.model = f.string("model").value_or("");
  chat.request_id = f.string("request_id").value_or("");

  // What sparrow cannot honour, each with the reason.
  const std::string not_stored =
      "is not supported: sparrow does not store responses; send the whole conversation as `input`";
  refuse_unless(f, "previous_response_id", nullptr, not_stored);
  refuse_unless(f, "conversation", nullptr, not_stored);
  refuse_unless(f, "background", false,
                "is not supported: sparrow does not store responses to run them in the background");
  refuse_unless(f, "prompt", nullptr, "(a stored prompt template) is not supported");
  refuse_unless(f, "max_tool_calls", nullptr, "is not supported (sparrow runs no built-in tools)");
  refuse_unless(f, "cache_salt", nullptr, "is not supported");
  refuse_unless(f, "priority", 0, "is not supported: sparrow schedules first come, first served");
  out.truncation = one_of(f, "truncation", {"disabled", "auto"}).value_or("disabled");
  if (out.truncation == "auto")
    f.invalid("truncation", "'auto' is not supported: sparrow does not drop input items; send an input that fits");
  out.store = f.boolean("store").value_or(true);

  chat.stream = f.boolean("stream").value_or(false);
  if (const Json* options = f.object("stream_options")) {
    if (!chat.stream) bad_request("Stream options can only be defined when `stream=True`.", "stream_options");
    Fields(*options, "stream_options").boolean("include_obfuscation");  // accepted; sparrow never pads events
  }

  chat.sampling = defaults;
  parse_sampling_fields(f, chat.sampling);
  if (auto m = f.integer("max_output_tokens")) {
    if (*m < 1) f.invalid("max_output_tokens", "must be at least 1, got " + std::to_string(*m));
    chat.max_tokens = *m;
  }
  parse_text_format(f, out);

  // include: "message.output_text.logprobs" asks for logprobs; the other values OpenAI defines concern
  // built-in tools or encrypted reasoning, which sparrow never produces, so they add nothing.
  if (const Json* include = f.get("include")) {
    static constexpr const char* known[] = {"message.output_text.logprobs",   "reasoning.encrypted_content",
                                            "code_interpreter_call.outputs",  "computer_call_output.output.image_url",
                                            "file_search_call.results",       "message.input_image.image_url",
                                            "web_search_call.action.sources", "web_search_call.results"};
    if (!include->is_array()) f.invalid("include", "must be a list of strings");
    for (const Json& value : *include) {
      bool ok = value.is_string() &&
                std::any_of(std::begin(known), std::end(known), [&](const char* k) { return value == k; });
      if (!ok) f.invalid("include", "holds " + value.dump() + ", which is not a value OpenAI defines");
      if (value == "message.output_text.logprobs") out.output_logprobs = true;
    }
  }
  if (auto k = f.integer("top_logprobs")) {
    if (*k < 0 || *k > max_logprobs) f.invalid("top_logprobs", "must be in [0, " + std::to_string(max_logprobs) + "]");
    out.top_logprobs = *k;
  }
  if (out.output_logprobs) {
    chat.logprobs = true;
    chat.top_logprobs = out.top_logprobs;
    chat.sampling.logprobs = out.top_logprobs;
  }

  // Tools and the choice among them.
  chat.tools = chat_tools(f);
  if (const Json* tools = f.get("tools")) out.tools = *tools;
  chat.tool_choice = parse_tool_choice(f, chat.tools);
  // Echoed as given, except that "auto" without tools is "none" (vLLM check_tool_usage).
  out.tool_choice = chat.tools.is_null() ? Json("none") : Json("auto");
  if (f.has("tool_choice") && !(chat.tools.is_null() && body.at("tool_choice") == "auto"))
    out.tool_choice = body.at("tool_choice");
  chat.parallel_tool_calls = f.boolean("parallel_tool_calls").value_or(true);
  chat.include_reasoning = f.boolean("include_reasoning").value_or(true);

  // The input, as chat messages.
  InputMessages input;
  if (auto instructions = f.string("instructions")) {
    out.instructions = *instructions;
    input.messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const Json* given = f.get("input");
  if (!given) bad_request("`input` is required (a string, or a list of input items)", "input");
  if (given->is_string()) {
    input.messages.push_back({{"role", "user"}, {"content", given->get<std::string>()}});
  } else if (given->is_array()) {
    if (given->empty()) f.invalid("input", "must not be an empty list");
    for (size_t i = 0; i < given->size(); ++i) input.add_item((*given)[i], "input[" + std::to_string(i) + "]");
  } else {
    f.invalid("input", "must be a string or a list of input items");
  }

  // reasoning.effort reaches the template as vLLM hands it: `reasoning_effort`, and `enable_thinking`
  // off for effort "none" (on otherwise) unless chat_template_kwargs set it.
  Json kwargs = Json::object();
  if (const Json* k = f.object("chat_template_kwargs")) kwargs = *k;
  if (const Json* reasoning = f.object("reasoning")) {
    Fields r(*reasoning, "reasoning");
    auto effort = one_of(r, "effort", {"none", "minimal", "low", "medium", "high", "xhigh"});
    // A summary is accepted: the reasoning text itself comes back in the reasoning item's content.
    one_of(r, "summary", {"auto", "concise", "detailed"});
    one_of(r, "generate_summary", {"auto", "concise", "detailed"});
    out.reasoning = *reasoning;
    if (effort) {
      if (!kwargs.contains("reasoning_effort")) kwargs["reasoning_effort"] = *effort;
      if (!kwargs.contains("enable_thinking")) kwargs["enable_thinking"] = *effort != "none";
    }
  }

  out.metadata = parse_metadata(f);
  for (auto [name, field] : {std::pair{"user", &out.user}, std::pair{"safety_identifier", &out.safety_identifier},
                             std::pair{"prompt_cache_key", &out.prompt_cache_key}})
    if (auto value = f.string(name)) *field = *value;
  one_of(f, "prompt_cache_retention", {"in_memory", "in-memory", "24h"});  // accepted; the prefix cache decides
  out.service_tier = one_of(f, "service_tier", {"auto", "default", "flex", "scale", "priority"}).value_or("auto");

  chat.images = std::move(input.images);
  chat.template_input = {{"messages", std::move(input.messages)},
                         {"add_generation_prompt", !input.continue_final},
                         {"continue_final_message", input.continue_final},
                         {"chat_template_kwargs", std::move(kwargs)}};
  if (!chat.tools.is_null()) chat.template_input["tools"] = chat.tools;
  return out;
}

}  // namespace sparrow::server
