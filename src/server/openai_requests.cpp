#include "server/openai_requests.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "server/api_error.h"
#include "server/kv_transfer_params.h"
#include "structured/spec.h"

namespace sparrow::server {
namespace {

constexpr int64_t kMaxChoices = 128;  // OpenAI's limit on n

// A sampling parameter, held as a float32 as vLLM's sampler holds it: a value beyond float32's range
// (temperature 1e308) is refused, not turned into inf.
float float_field(const Fields& f, const std::string& name, float def, double lo, double hi, const char* range) {
  auto v = f.number(name);
  if (!v) return def;
  std::string given = ", got " + f.get(name)->dump();
  if (!std::isfinite(*v) || *v < lo || *v > hi) f.invalid(name, std::string("must be ") + range + given);
  if (std::fabs(*v) > std::numeric_limits<float>::max())
    f.invalid(name, "is too large for a 32-bit float" + given);
  return float(*v);
}

// logit_bias (OpenAI: {"token id": bias in [-100, 100]}) and allowed_token_ids (vLLM: a non-empty list of
// ids). The ids are checked against the vocabulary by the engine (EngineCore::validate).
void parse_logit_fields(const Fields& f, SamplingParams& s) {
  if (const Json* bias = f.get("logit_bias")) {
    if (!bias->is_object()) f.invalid("logit_bias", "must be an object of token ids to biases");
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      const std::string& key = it.key();
      int64_t id = -1;
      if (!key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == std::string::npos)
        id = std::stoll(key);
      if (id < 0 || id > std::numeric_limits<int32_t>::max())
        f.invalid("logit_bias", "keys must be token ids (non-negative integers as strings), got '" + key + "'");
      if (!it->is_number() || !std::isfinite(it->get<double>()) || std::fabs(it->get<double>()) > kMaxLogitBias)
        f.invalid("logit_bias", "values must be numbers in [-100, 100], got " + it->dump() + " for token " + key);
      s.logit_bias.push_back({int32_t(id), float(it->get<double>())});
    }
  }
  if (auto ids = f.integers("allowed_token_ids")) {
    if (ids->empty()) f.invalid("allowed_token_ids", "must not be empty");
    for (int64_t id : *ids)
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) f.invalid("allowed_token_ids", "must be token ids");
    s.allowed_token_ids = std::vector<int32_t>(ids->begin(), ids->end());
  }
}

// A JSON schema given as an object or as its JSON text (vLLM takes both).
std::string schema_text(const Fields& f, const std::string& name) {
  const Json* v = f.get(name);
  if (v->is_string()) return v->get<std::string>();
  if (!v->is_object() && !v->is_boolean()) f.invalid(name, "must be a JSON schema (an object, or its JSON text)");
  return v->dump();
}

// What the output must be: vLLM 0.33's structured_outputs {json, regex, choice, grammar, json_object,
// disable_any_whitespace, ...}, the older guided_json / guided_regex / guided_choice / guided_grammar
// (guided_decoding_backend ignored), and response_format json_object / json_schema. At most one
// constraint (vLLM refuses several the same way). The spec is compiled here once so that a bad schema,
// regex or grammar is a 400 naming its field.
void parse_structured_outputs(const Fields& f, SamplingParams& s) {
  using Kind = structured::StructuredOutputSpec::Kind;
  struct Given {
    structured::StructuredOutputSpec spec;
    std::string param;
  };
  std::vector<Given> given;
  auto add = [&](Kind kind, std::string text, std::string param) {
    Given g;
    g.spec.kind = kind;
    g.spec.text = std::move(text);
    g.param = std::move(param);
    given.push_back(std::move(g));
  };
  auto choices_of = [](const Fields& fields, const std::string& name) {
    auto list = fields.strings(name);
    if (!list || fields.get(name)->is_string()) fields.invalid(name, "must be a list of strings");
    if (list->empty()) fields.invalid(name, "must not be empty");
    return *list;
  };
  bool any_whitespace = true;
  if (const Json* so = f.get("structured_outputs")) {
    if (!so->is_object()) f.invalid("structured_outputs", "must be an object");
    Fields o(*so, "structured_outputs");
    if (o.has("json")) add(Kind::JsonSchema, schema_text(o, "json"), o.param("json"));
    if (auto regex = o.string("regex")) add(Kind::Regex, *regex, o.param("regex"));
    if (o.has("choice")) {
      add(Kind::Choice, "", o.param("choice"));
      given.back().spec.choices = choices_of(o, "choice");
    }
    if (auto grammar = o.string("grammar")) add(Kind::Grammar, *grammar, o.param("grammar"));
    if (o.boolean("json_object").value_or(false)) add(Kind::JsonObject, "", o.param("json_object"));
    if (o.has("structural_tag")) o.invalid("structural_tag", "is not supported");
    if (auto pattern = o.string("whitespace_pattern")) o.invalid("whitespace_pattern", "is not supported");
    any_whitespace = !o.boolean("disable_any_whitespace").value_or(false);
    o.boolean("disable_fallback");
    o.boolean("disable_additional_properties");
  }
  if (f.has("guided_json")) add(Kind::JsonSchema, schema_text(f, "guided_json"), "guided_json");
  if (auto regex = f.string("guided_regex")) add(Kind::Regex, *regex, "guided_regex");
  if (const Json* c = f.get("guided_choice"); c && !(c->is_array() && c->empty())) {
    add(Kind::Choice, "", "guided_choice");
    given.back().spec.choices = choices_of(f, "guided_choice");
  }
  if (auto grammar = f.string("guided_grammar")) add(Kind::Grammar, *grammar, "guided_grammar");
  if (f.string("guided_whitespace_pattern")) f.invalid("guided_whitespace_pattern", "is not supported");
  f.string("guided_decoding_backend");  // accepted and ignored: sparrow has one backend
  if (const Json* format = f.object("response_format")) {
    Fields rf(*format, "response_format");
    auto type = rf.string("type");
    if (type == "json_object") {
      add(Kind::JsonObject, "", "response_format");
    } else if (type == "json_schema") {
      const Json* js = rf.object("json_schema");
      if (!js) rf.invalid("json_schema", "is required when type is \"json_schema\"");
      Fields j(*js, "response_format.json_schema");
      j.string("name");
      j.string("description");
      j.boolean("strict");  // sparrow is always strict: the output follows the schema
      if (!j.has("schema")) j.invalid("schema", "is required");
      add(Kind::JsonSchema, schema_text(j, "schema"), j.param("schema"));
    } else if (type != "text") {
      bad_request("response_format type must be 'text', 'json_object' or 'json_schema', got '" + type.value_or("") + "'",
                  "response_format.type");
    }
  }
  if (given.empty()) return;
  if (given.size() > 1)
    bad_request("You can only use one kind of structured outputs constraint but multiple are specified: " +
                    given[0].param + " and " + given[1].param,
                given[1].param);
  given[0].spec.any_whitespace = any_whitespace;
  set_structured_output(s, std::move(given[0].spec), given[0].param);
}

}  // namespace

void parse_sampling_fields(const Fields& f, SamplingParams& s) {
  s.temperature = float_field(f, "temperature", s.temperature, 0, std::numeric_limits<double>::max(), ">= 0");
  s.top_p = float_field(f, "top_p", s.top_p, 0, 1, "in (0, 1]");
  if (f.has("top_p") && s.top_p <= 0) f.invalid("top_p", "must be in (0, 1]");
  s.min_p = float_field(f, "min_p", s.min_p, 0, 1, "in [0, 1]");
  s.presence_penalty = float_field(f, "presence_penalty", s.presence_penalty, -2, 2, "in [-2, 2]");
  s.frequency_penalty = float_field(f, "frequency_penalty", s.frequency_penalty, -2, 2, "in [-2, 2]");
  s.repetition_penalty =
      float_field(f, "repetition_penalty", s.repetition_penalty, 0, std::numeric_limits<double>::max(), "> 0");
  if (f.has("repetition_penalty") && s.repetition_penalty <= 0) f.invalid("repetition_penalty", "must be > 0");
  if (auto k = f.integer("top_k")) {
    if (*k < -1) f.invalid("top_k", "must be -1 (disabled), 0 (disabled) or positive");
    s.top_k = *k;
  }
  if (auto seed = f.integer("seed")) s.seed = uint64_t(*seed);  // any int64, as OpenAI's

  if (auto stop = f.strings("stop")) {
    for (const auto& str : *stop)
      if (str.empty()) f.invalid("stop", "may not contain an empty string");
    s.stop = *stop;
  }
  if (auto ids = f.integers("stop_token_ids")) {
    for (int64_t id : *ids)
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) f.invalid("stop_token_ids", "must be token ids");
    s.stop_token_ids.assign(ids->begin(), ids->end());
  }
  s.include_stop_str_in_output = f.boolean("include_stop_str_in_output").value_or(false);
  s.ignore_eos = f.boolean("ignore_eos").value_or(false);
  s.skip_special_tokens = f.boolean("skip_special_tokens").value_or(true);
  f.boolean("spaces_between_special_tokens");  // accepted; our detokenizer never inserts spaces

  parse_logit_fields(f, s);
  parse_structured_outputs(f, s);
  // What we cannot honour is refused rather than silently ignored.
  if (const Json* v = f.get("bad_words"); v && !(v->is_array() && v->empty())) f.invalid("bad_words", "is not supported");
}

void set_structured_output(SamplingParams& s, structured::StructuredOutputSpec spec, const std::string& param) {
  try {
    structured::build_grammar(spec);
  } catch (const Error& e) {
    bad_request("`" + param + "` is invalid: " + e.what(), param);
  }
  s.structured = std::move(spec);
}

namespace {

// The fields both endpoints share, in vLLM's ranges (vllm SamplingParams._verify_args).
void parse_generation_fields(const Fields& f, GenerationFields& out, const SamplingParams& defaults,
                             int64_t max_logprobs) {
  out.model = f.string("model").value_or("");
  SamplingParams& s = out.sampling;
  s = defaults;
  parse_sampling_fields(f, s);
  if (auto n = f.integer("n")) {
    if (*n < 1 || *n > kMaxChoices) f.invalid("n", "must be in [1, " + std::to_string(kMaxChoices) + "]");
    s.n = *n;
  }
  if (auto best_of = f.integer("best_of"); best_of && *best_of != s.n)
    f.invalid("best_of", "is not supported (only best_of == n)");

  // max_completion_tokens replaces the deprecated max_tokens; when both are given it wins.
  for (const char* name : {"max_tokens", "max_completion_tokens"})
    if (auto m = f.integer(name)) {
      if (*m < 1) f.invalid(name, "must be at least 1, got " + std::to_string(*m));
      out.max_tokens = *m;
    }
  if (auto m = f.integer("min_tokens")) {
    if (*m < 0) f.invalid("min_tokens", "must be >= 0");
    if (out.max_tokens && *m > *out.max_tokens) f.invalid("min_tokens", "must be <= max_tokens");
    s.min_tokens = *m;
  }

  if (auto k = f.integer("prompt_logprobs")) {
    if (*k < 0 || *k > max_logprobs)
      f.invalid("prompt_logprobs", "must be in [0, " + std::to_string(max_logprobs) + "]");
    s.prompt_logprobs = *k;
  }

  out.stream = f.boolean("stream").value_or(false);
  if (const Json* options = f.object("stream_options")) {
    if (!out.stream) bad_request("Stream options can only be defined when `stream=True`.", "stream_options");
    Fields o(*options, "stream_options");
    out.stream_options.include_usage = o.boolean("include_usage").value_or(false);
    out.stream_options.continuous_usage_stats = o.boolean("continuous_usage_stats").value_or(false);
  }
  if (out.stream && s.prompt_logprobs >= 0)
    bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs");

  if (auto k = f.integer("truncate_prompt_tokens")) {
    if (*k < 1) f.invalid("truncate_prompt_tokens", "must be >= 1");
    out.truncate_prompt_tokens = *k;
  }
  out.return_token_ids = f.boolean("return_token_ids").value_or(false);
  out.request_id = f.string("request_id").value_or("");
  out.kv_transfer = parse_kv_transfer_params(f);
  // The proxy reads the handoff from the prefill instance's whole response (vLLM's proxies do the same).
  if (out.kv_transfer.remote_decode && out.stream)
    bad_request("kv_transfer_params: do_remote_decode needs stream false (the handoff is in the response body)",
                "kv_transfer_params");
  f.string("user");  // accepted and ignored, as vLLM does
}

ToolChoice parse_tool_choice(const Json* value) {
  ToolChoice choice;
  if (!value) return choice;
  if (value->is_string()) {
    std::string mode = value->get<std::string>();
    if (mode == "none")
      choice.mode = ToolChoice::Mode::None;
    else if (mode == "auto")
      choice.mode = ToolChoice::Mode::Auto;
    else if (mode == "required")
      choice.mode = ToolChoice::Mode::Required;
    else
      bad_request("Invalid value for `tool_choice`: " + mode + " (expected none, auto, required or a function)",
                  "tool_choice");
    return choice;
  }
  Fields f(*value, "tool_choice");
  if (f.string("type") != "function") f.invalid("type", "must be \"function\"");
  const Json* function = f.object("function");
  if (!function) f.invalid("function", "is required for a named tool choice");
  auto name = Fields(*function, "tool_choice.function").string("name");
  if (!name) bad_request("`tool_choice.function.name` is required", "tool_choice.function.name");
  choice.mode = ToolChoice::Mode::Named;
  choice.function_name = *name;
  return choice;
}

void check_tools(const Json& tools) {
  if (!tools.is_array()) bad_request("`tools` must be a list", "tools");
  if (tools.empty()) bad_request("`tools` must not be an empty array", "tools");
  for (size_t i = 0; i < tools.size(); ++i) {
    std::string path = "tools[" + std::to_string(i) + "]";
    Fields tool(tools[i], path);
    if (tool.string("type").value_or("function") != "function") tool.invalid("type", "must be \"function\"");
    const Json* function = tool.object("function");
    if (!function) tool.invalid("function", "is required");
    Fields fn(*function, path + ".function");
    if (!fn.string("name")) fn.invalid("name", "is required");
    fn.string("description");
    fn.object("parameters");
  }
}

// A message's content, as vLLM accepts it: a string, a list of content parts, or (assistant messages,
// whose content may be only tool calls) null. Parts are {"type": "text", "text": "..."} and
// {"type": "image_url", "image_url": {"url": "..."}} (docs/vision.md); the other part types (input_audio,
// video_url, file, ...) carry media sparrow cannot read, and are refused rather than dropped.
void check_content(const Json& message_json, const Fields& message, const std::string& role) {
  auto given = message_json.find("content");
  if (given == message_json.end() || given->is_string()) return;
  if (given->is_null() && role == "assistant") return;
  const Json* content = &*given;
  const std::string must = role == "assistant" ? "must be a string, a list of content parts or null"
                                               : "must be a string or a list of content parts";
  if (!content->is_array()) message.invalid("content", must + ", not " + content->type_name());
  for (size_t j = 0; j < content->size(); ++j) {
    const Json& part = (*content)[j];
    std::string where = message.param("content") + "[" + std::to_string(j) + "]";
    if (!part.is_object()) bad_request("`" + where + "` must be a content part object, not " + part.type_name(), where);
    Fields fields(part, where);
    auto type = fields.string("type");
    if (!type) fields.invalid("type", "is required (\"text\" or \"image_url\")");
    if (*type == "image_url") {
      const Json* image = fields.object("image_url");
      if (!image) fields.invalid("image_url", "is required: {\"url\": \"data:image/...;base64,...\"}");
      if (!Fields(*image, where + ".image_url").string("url"))
        bad_request("`" + where + ".image_url.url` is required and must be a string", where + ".image_url.url");
      continue;
    }
    if (*type != "text")
      bad_request("`" + where + "`: content parts of type '" + *type +
                      "' are not supported (sparrow reads text and images; audio, video and files are not "
                      "supported)",
                  where + ".type");
    if (!fields.string("text")) fields.invalid("text", "is required and must be a string");
  }
}

// The request's `messages`: a non-empty list of objects with a string `role` and a content vLLM accepts.
const Json* check_messages(const Fields& f) {
  const Json* messages = f.get("messages");
  if (!messages) bad_request("`messages` is required", "messages");
  if (!messages->is_array() || messages->empty()) f.invalid("messages", "must be a non-empty list of messages");
  for (size_t i = 0; i < messages->size(); ++i) {
    Fields message((*messages)[i], "messages[" + std::to_string(i) + "]");
    auto role = message.string("role");
    if (!role) message.invalid("role", "is required and must be a string");
    check_content((*messages)[i], message, *role);
  }
  return messages;
}

bool tool_named(const Json& tools, const std::string& name) {
  for (const Json& tool : tools)
    if (tool["function"]["name"] == name) return true;
  return false;
}

}  // namespace

ChatRequest parse_chat_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs) {
  Fields f(body);
  ChatRequest out;
  parse_generation_fields(f, out, defaults, max_logprobs);

  const Json* messages = check_messages(f);

  out.logprobs = f.boolean("logprobs").value_or(false);
  if (auto k = f.integer("top_logprobs")) {
    if (*k < 0 || *k > max_logprobs) f.invalid("top_logprobs", "must be in [0, " + std::to_string(max_logprobs) + "]");
    if (*k > 0 && !out.logprobs)
      bad_request("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs");
    out.top_logprobs = *k;
  }
  if (out.logprobs) out.sampling.logprobs = out.top_logprobs;

  // Tools: the default tool_choice is "auto" with tools and "none" without (vLLM check_tool_usage).
  if (const Json* tools = f.get("tools")) {
    check_tools(*tools);
    out.tools = *tools;
  }
  out.tool_choice = parse_tool_choice(f.get("tool_choice"));
  if (!f.has("tool_choice") && !out.tools.is_null()) out.tool_choice.mode = ToolChoice::Mode::Auto;
  if (out.tool_choice.mode != ToolChoice::Mode::None && out.tools.is_null())
    bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice");
  if (out.tool_choice.mode == ToolChoice::Mode::Named && !tool_named(out.tools, out.tool_choice.function_name))
    bad_request("The tool specified in `tool_choice` (" + out.tool_choice.function_name +
                    ") does not match any of the specified `tools`",
                "tool_choice.function.name");
  out.parallel_tool_calls = f.boolean("parallel_tool_calls").value_or(true);
  out.include_reasoning = f.boolean("include_reasoning").value_or(true);
  // vLLM chat_completion/serving.py: with echo, a last message in the response's role (a message the
  // model continues, continue_final_message) is put in front of the content; text parts are joined by
  // newlines. vLLM's response role is the last message's when add_generation_prompt is false; sparrow's
  // is always "assistant", so only an assistant message is echoed.
  if (f.boolean("echo").value_or(false)) {
    const Json& last = messages->back();
    auto content = last.find("content");
    if (last["role"] == "assistant" && content != last.end()) {
      if (content->is_string()) {
        out.echo_text = content->get<std::string>();
      } else if (content->is_array()) {
        bool first = true;  // text parts only: an image part has no text to echo
        for (const Json& part : *content)
          if (part["type"] == "text") {
            out.echo_text += (first ? "" : "\n") + part["text"].get<std::string>();
            first = false;
          }
      }
    }
  }

  // What the chat template sees (template/chat_template.h reads these keys).
  bool add_generation_prompt = f.boolean("add_generation_prompt").value_or(true);
  bool continue_final_message = f.boolean("continue_final_message").value_or(false);
  if (add_generation_prompt && continue_final_message)
    bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
  Json kwargs = Json::object();
  if (const Json* k = f.object("chat_template_kwargs")) kwargs = *k;
  // vLLM hands reasoning_effort to the template as a keyword argument.
  if (auto effort = f.string("reasoning_effort"); effort && !kwargs.contains("reasoning_effort"))
    kwargs["reasoning_effort"] = *effort;
  out.template_input = {{"messages", template_messages(*messages, out.images)},
                        {"add_generation_prompt", add_generation_prompt},
                        {"continue_final_message", continue_final_message},
                        {"chat_template_kwargs", kwargs}};
  if (!out.tools.is_null()) out.template_input["tools"] = out.tools;
  if (const Json* documents = f.get("documents")) out.template_input["documents"] = *documents;
  return out;
}

CompletionRequest parse_completion_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs,
                                           int64_t max_prompts) {
  Fields f(body);
  CompletionRequest out;
  parse_generation_fields(f, out, defaults, max_logprobs);

  // prompt: a string, a list of strings, a list of token ids, or a list of token-id lists.
  const Json* prompt = f.get("prompt");
  if (!prompt) bad_request("`prompt` is required", "prompt");
  auto token_ids = [&](const Json& list) {
    std::vector<int32_t> ids;
    for (const Json& id : list) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
        f.invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists");
      ids.push_back(id.get<int32_t>());
    }
    return ids;
  };
  if (prompt->is_string()) {
    out.prompts.push_back(prompt->get<std::string>());
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
    out.prompts.push_back(token_ids(*prompt));
  } else if (prompt->is_array()) {
    for (const Json& p : *prompt) {
      if (p.is_string())
        out.prompts.push_back(p.get<std::string>());
      else if (p.is_array())
        out.prompts.push_back(token_ids(p));
      else
        f.invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists");
    }
  } else {
    f.invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists");
  }
  if (out.prompts.empty()) bad_request("`prompt` must not be empty", "prompt");
  for (const Prompt& p : out.prompts)
    if (std::visit([](const auto& v) { return v.empty(); }, p)) bad_request("`prompt` must not be empty", "prompt");
  if (int64_t(out.prompts.size()) > max_prompts)
    bad_request("at most " + std::to_string(max_prompts) + " prompts per request", "prompt");

  if (!out.max_tokens) out.max_tokens = 16;  // the OpenAI default for completions; null counts as not given
  if (auto k = f.integer("logprobs")) {
    if (*k < 0 || *k > max_logprobs) f.invalid("logprobs", "must be in [0, " + std::to_string(max_logprobs) + "]");
    out.logprobs = *k;
    out.sampling.logprobs = *k;
  }
  out.echo = f.boolean("echo").value_or(false);
  out.add_special_tokens = f.boolean("add_special_tokens").value_or(true);
  if (auto suffix = f.string("suffix"); suffix && !suffix->empty()) f.invalid("suffix", "is not supported");
  return out;
}

}  // namespace sparrow::server
