#include "template/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json_input.h"
#include "template/jinja_limits.h"
#include "template/py_text.h"

namespace sparrow {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using jinja::Value;

namespace {

// transformers' marker for continue_final_message (render_jinja_template).
const std::string kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK(in, path.string(), ": cannot open");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A tokenizer_config.json value that transformers treats as a token: a string or an AddedToken
// object {"content": ...}.
std::optional<std::string> token_text(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  return std::nullopt;
}

// vLLM's _postprocess_messages: assistant tool-call arguments given as JSON text become objects,
// and missing or empty arguments become {}.
void parse_tool_call_arguments(json& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    json& message = messages[i];
    if (!message.is_object() || message.value("role", json()) != "assistant") continue;
    if (!message.contains("tool_calls") || !message["tool_calls"].is_array()) continue;
    for (size_t j = 0; j < message["tool_calls"].size(); ++j) {
      json& call = message["tool_calls"][j];
      std::string where = cat("request: messages[", i, "].tool_calls[", j, "]");
      SPARROW_CHECK(call.is_object() && call.contains("function") && call["function"].is_object(), where,
                    " needs a \"function\" object");
      json& function = call["function"];
      json arguments = function.value("arguments", json());
      bool empty = arguments.is_null() || (arguments.is_string() && arguments.get<std::string>().empty()) ||
                   ((arguments.is_object() || arguments.is_array()) && arguments.empty()) ||
                   (arguments.is_boolean() && !arguments.get<bool>()) || (arguments.is_number() && arguments == 0);
      if (empty) {
        function["arguments"] = json::object();
      } else if (arguments.is_string()) {
        JsonInput<json> parsed = parse_json_input<json>(arguments.get<std::string>());
        SPARROW_CHECK(parsed.status != JsonInput<json>::Status::TooDeep, where,
                      ".function.arguments nests arrays and objects more than ", kMaxJsonDepth,
                      " levels deep (the limit)");
        SPARROW_CHECK(parsed.ok(), where, ".function.arguments is not valid JSON");
        function["arguments"] = std::move(parsed.value);
      } else {
        SPARROW_CHECK(arguments.is_object() || arguments.is_array(), where,
                      ".function.arguments must be a JSON string or an object");
      }
    }
  }
}

// transformers' continue_final_message preparation: appends the tag to the final message's text
// (the last text part when the content is a list) and returns that text as it was.
std::string mark_final_message(json& messages, const std::string& template_source) {
  SPARROW_CHECK(!messages.empty() && messages.back().is_object(),
                "request: continue_final_message needs a final message to continue");
  json& last = messages.back();
  SPARROW_CHECK(last.contains("content") && !last["content"].is_null(),
                "continue_final_message is set but the final message has no \"content\" to continue!");
  SPARROW_CHECK(template_source.find("content") != std::string::npos,
                "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template");
  json& content = last["content"];
  if (content.is_array()) {
    for (auto it = content.rbegin(); it != content.rend(); ++it) {
      if (!it->is_object() || !it->contains("text")) continue;
      SPARROW_CHECK((*it)["text"].is_string(), "request: the final message's text part is not a string");
      std::string text = (*it)["text"].get<std::string>();
      (*it)["text"] = text + kContinueTag;
      return text;
    }
    fail("continue_final_message is set but we could not find any text to continue in the final message!");
  }
  SPARROW_CHECK(content.is_string(), "request: the final message's content must be a string or a list of parts");
  std::string text = content.get<std::string>();
  content = text + kContinueTag;
  return text;
}

// transformers cuts the prompt at the tag: right before it when the template kept the tag's
// trailing space, else before it with trailing whitespace removed.
std::string cut_at_final_message(const std::string& rendered, const std::string& final_text) {
  std::string tag = jinja::strip(kContinueTag, std::nullopt, true, true);
  SPARROW_CHECK(rendered.find(jinja::strip(final_text, std::nullopt, true, true)) != std::string::npos &&
                    rendered.find(tag) != std::string::npos,
                "continue_final_message is set but the final message does not appear in the chat after applying "
                "the chat template (the template changes the final message)");
  size_t at = rendered.rfind(tag);
  if (rendered.compare(at, kContinueTag.size(), kContinueTag) == 0) return rendered.substr(0, at);
  return jinja::strip(rendered.substr(0, at), std::nullopt, false, true);
}

// `j` sits inside `level` arrays / objects; its own nesting is refused before it is walked.
Value to_jinja_value_at(const json& j, int level) {
  SPARROW_CHECK(!j.is_structured() || level < jinja::kMaxValueDepth, "request: a value nested more than ",
                jinja::kMaxValueDepth, " levels deep (the template limit)");
  switch (j.type()) {
    case json::value_t::null:
      return Value::none();
    case json::value_t::boolean:
      return Value(j.get<bool>());
    case json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      SPARROW_CHECK(u <= static_cast<uint64_t>(INT64_MAX), "request: the integer ", u, " is too large");
      return Value(static_cast<int64_t>(u));
    }
    case json::value_t::number_float:
      return Value(j.get<double>());
    case json::value_t::string:
      return Value(j.get<std::string>());
    case json::value_t::array: {
      jinja::ValueList items;
      for (const json& item : j) items.push_back(to_jinja_value_at(item, level + 1));
      return Value::list(std::move(items));
    }
    case json::value_t::object: {
      jinja::Dict d;
      for (const auto& [key, value] : j.items()) d.set(Value(key), to_jinja_value_at(value, level + 1));
      return Value::dict(std::move(d));
    }
    default:
      fail("request: unsupported JSON value");
  }
}

}  // namespace

Value to_jinja_value(const json& j) { return to_jinja_value_at(j, 0); }

ChatTemplate ChatTemplate::load(const std::string& model_dir, const std::string& template_file) {
  fs::path dir(model_dir);
  fs::path config_path = dir / "tokenizer_config.json";
  json config = json::object();
  if (fs::exists(config_path)) {
    config = json::parse(read_file(config_path), nullptr, /*allow_exceptions=*/false);
    SPARROW_CHECK(!config.is_discarded() && config.is_object(), config_path.string(), ": not a JSON object");
  }

  std::vector<Named> templates;
  if (!template_file.empty()) {
    SPARROW_CHECK(fs::is_regular_file(template_file), template_file, ": chat template file not found");
    templates.push_back({"default", read_file(template_file)});
  }
  // Separate template files win over tokenizer_config.json (transformers' from_pretrained).
  if (templates.empty() && fs::exists(dir / "chat_template.jinja")) templates.push_back({"default", read_file(dir / "chat_template.jinja")});
  if (template_file.empty() && fs::is_directory(dir / "additional_chat_templates")) {
    std::vector<fs::path> extra;
    for (const auto& entry : fs::directory_iterator(dir / "additional_chat_templates"))
      if (entry.path().extension() == ".jinja") extra.push_back(entry.path());
    std::sort(extra.begin(), extra.end());
    for (const fs::path& p : extra) templates.push_back({p.stem().string(), read_file(p)});
  }
  if (templates.empty() && config.contains("chat_template")) {
    const json& t = config["chat_template"];
    if (t.is_string()) {
      templates.push_back({"default", t.get<std::string>()});
    } else {
      SPARROW_CHECK(t.is_array(), config_path.string(),
                    ": \"chat_template\" must be a string or a list of {\"name\", \"template\"}");
      for (const json& entry : t) {
        SPARROW_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                          entry.contains("template") && entry["template"].is_string(),
                      config_path.string(), ": each \"chat_template\" entry needs a string name and template");
        templates.push_back({entry["name"].get<std::string>(), entry["template"].get<std::string>()});
      }
    }
  }
  SPARROW_CHECK(!templates.empty(), model_dir,
                ": no chat template (expected chat_template.jinja or \"chat_template\" in tokenizer_config.json)");

  // transformers passes special_tokens_map: the named special tokens and any other *_token entry.
  jinja::Dict tokens;
  for (const auto& [key, value] : config.items()) {
    if (key.size() < 6 || key.compare(key.size() - 6, 6, "_token") != 0) continue;
    if (auto text = token_text(value)) tokens.set(Value(key), Value(*text));
  }
  if (config.contains("extra_special_tokens") && config["extra_special_tokens"].is_object())
    for (const auto& [key, value] : config["extra_special_tokens"].items())
      if (auto text = token_text(value)) tokens.set(Value(key), Value(*text));
  return ChatTemplate(std::move(templates), std::move(tokens));
}

ChatTemplate::ChatTemplate(std::vector<Named> templates, jinja::Dict special_tokens)
    : special_tokens_(std::move(special_tokens)) {
  for (Named& t : templates) {
    std::string label = templates.size() == 1 ? "chat template" : "chat template '" + t.name + "'";
    jinja::Template parsed(t.source, label);
    templates_.push_back(Parsed{std::move(t.name), std::move(t.source), std::move(parsed)});
  }
}

const ChatTemplate::Parsed& ChatTemplate::select(bool has_tools) const {
  if (templates_.size() == 1) return templates_[0];
  // transformers' get_chat_template: "tool_use" when tools are given, else "default".
  auto named = [&](const std::string& name) {
    return std::find_if(templates_.begin(), templates_.end(), [&](const Parsed& p) { return p.name == name; });
  };
  if (has_tools && named("tool_use") != templates_.end()) return *named("tool_use");
  if (named("default") != templates_.end()) return *named("default");
  std::string names;
  for (const Parsed& p : templates_) names += (names.empty() ? "" : ", ") + p.name;
  fail("the model has several chat templates (", names, ") and none is named \"default\"");
}

std::string ChatTemplate::render(const json& request) const {
  SPARROW_CHECK(request.is_object(), "request: expected a JSON object");
  SPARROW_CHECK(request.contains("messages") && request["messages"].is_array(),
                "request: \"messages\" must be a list of messages");
  auto flag = [&](const char* key, bool def) {
    if (!request.contains(key) || request[key].is_null()) return def;
    SPARROW_CHECK(request[key].is_boolean(), "request: \"", key, "\" must be true or false");
    return request[key].get<bool>();
  };
  bool add_generation_prompt = flag("add_generation_prompt", true);  // vLLM's default
  bool continue_final_message = flag("continue_final_message", false);
  const json no_value;
  const json& tools = request.contains("tools") ? request["tools"] : no_value;
  const json& documents = request.contains("documents") ? request["documents"] : no_value;
  const json& kwargs = request.contains("chat_template_kwargs") ? request["chat_template_kwargs"] : no_value;
  SPARROW_CHECK(tools.is_null() || tools.is_array(), "request: \"tools\" must be a list");
  SPARROW_CHECK(documents.is_null() || documents.is_array(), "request: \"documents\" must be a list");
  SPARROW_CHECK(kwargs.is_null() || kwargs.is_object(), "request: \"chat_template_kwargs\" must be an object");
  SPARROW_CHECK(!kwargs.contains("messages"), "request: chat_template_kwargs may not set \"messages\"");
  if (kwargs.contains("add_generation_prompt") && kwargs["add_generation_prompt"].is_boolean())
    add_generation_prompt = kwargs["add_generation_prompt"].get<bool>();
  SPARROW_CHECK(!(continue_final_message && add_generation_prompt),
                "request: continue_final_message and add_generation_prompt cannot both be true");

  const Parsed& chosen = select(!tools.is_null());
  json messages = request["messages"];
  parse_tool_call_arguments(messages);
  std::string final_text;
  if (continue_final_message) final_text = mark_final_message(messages, chosen.source);

  jinja::Dict variables = special_tokens_;
  variables.set("messages", to_jinja_value(messages));
  variables.set("tools", to_jinja_value(tools));
  variables.set("documents", to_jinja_value(documents));
  variables.set("add_generation_prompt", add_generation_prompt);
  if (kwargs.is_object())
    for (const auto& [key, value] : kwargs.items()) variables.set(Value(key), to_jinja_value(value));

  std::string rendered = chosen.parsed.render(variables);
  return continue_final_message ? cut_at_final_message(rendered, final_text) : rendered;
}

}  // namespace sparrow
