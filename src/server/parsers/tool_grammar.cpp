// Grammars that force a tool call in the model's own markup (tool_choice "required" or a named
// function): one EBNF grammar per request, compiled and cached by the structured-output path like any
// other (StructuredOutputSpec::Kind::Grammar), with the markup's special tokens listed so the model can
// write them as the single tokens it was trained on. One builder per format, each following markers.h
// and the matching tool_*.cpp parser, so that whatever the grammar admits parses into calls to the
// offered tools:
//   - argument values that the format carries as JSON (Kimi K2's arguments object, DSML string="false",
//     Kimi K3's non-string arguments, MiniMax's non-string values) use the JSON Schema front end's
//     grammar of the tool's schema (or of one property of it), printed as GBNF (structured::to_gbnf);
//   - string values that the format carries as raw text (DSML string="true", Kimi K3 type="string",
//     MiniMax) are text without '<', so they cannot contain the closing tag (every closing tag begins
//     with '<', MiniMax-M3's namespace token too); a string `enum` is a choice of its values.
// Parameters of the raw-text formats come one element per declared property, in the schema's order:
// required ones always, optional ones may be left out (as xgrammar orders JSON object properties).
// JSON text is compact: vLLM's disable_any_whitespace separators ", " and ": ", as the templates render.
#include <set>

#include "core/error.h"
#include "server/parsers/markers.h"
#include "server/parsers/parser.h"
#include "server/parsers/tool_schema.h"
#include "structured/front_ends.h"
#include "structured/grammar.h"

namespace sparrow::parsers {

namespace {

using Json = nlohmann::ordered_json;
using structured::gbnf_literal;

struct Tool {
  std::string name;
  Json parameters;  // an object schema
};

std::string lit(std::string_view text) { return gbnf_literal(text); }

// Names written inside the markup's attributes or tags: the parsers read up to '"' / '>', so a name
// holding markup characters could not round-trip.
void check_markup_name(const std::string& tool, const std::string& name, std::string_view what) {
  for (char c : name)
    if (c == '"' || c == '<' || c == '>' || c == '&' || uint8_t(c) < 0x20)
      fail("tool '", tool, "': ", what, " '", name, "' holds a character the tool-call markup cannot carry (",
           "one of \" < > & or a control character)");
  if (name.empty()) fail("tool '", tool, "': an empty ", what, " cannot be written in the tool-call markup");
}

std::vector<Tool> offered_tools(const Json& tools, const ToolGrammarOptions& options) {
  std::vector<Tool> out;
  if (!tools.is_array()) return out;
  for (const Json& entry : tools) {
    const Json& function = entry.contains("function") ? entry["function"] : entry;
    if (!function.is_object() || !function.contains("name") || !function["name"].is_string()) continue;
    Tool tool{function["name"].get<std::string>(), Json::object()};
    if (!options.only_function.empty() && tool.name != options.only_function) continue;
    if (function.contains("parameters") && function["parameters"].is_object()) tool.parameters = function["parameters"];
    if (!tool.parameters.contains("type") && !tool.parameters.contains("properties") &&
        !tool.parameters.contains("$ref") && !tool.parameters.contains("anyOf"))
      tool.parameters["type"] = "object";  // {} or a bare description: an object, as the parsers produce
    out.push_back(std::move(tool));
  }
  if (out.empty())
    fail(options.only_function.empty() ? "no tool to call: `tools` lists no function"
                                       : "tool_choice names '" + options.only_function + "', which `tools` does not list");
  return out;
}

// The rules of one grammar being written, and the special tokens it uses.
class Builder {
 public:
  explicit Builder(const ToolGrammarOptions& options) : options_(options) {}

  // Adds `name ::= body`.
  void rule(const std::string& name, const std::string& body) { rules_ += name + " ::= " + body + "\n"; }
  std::string fresh(std::string_view hint) { return std::string(hint) + "-" + std::to_string(next_++); }
  void special(std::string_view token) { specials_.emplace_back(token); }

  // The rule of the JSON text of `schema` (compact), embedded from the JSON Schema front end.
  std::string json_value(const Tool& tool, const Json& schema) {
    structured::Grammar g = compile(tool, schema);
    // Every closing tag and marker of the formats begins with '<' (markers.h), and the parsers end a value
    // at the first one, also inside a JSON string: JSON text here holds no raw '<' (a string can still
    // carry one as the escape \u003c). JSON's own syntax has none, so only string characters lose it.
    for (structured::CharClass& c : g.classes) {
      c = c.minus(structured::CharClass::of('<'));
      if (c.empty())
        fail("tool '", tool.name, "': a constant holding '<' cannot be forced in the tool-call markup");
    }
    const std::string prefix = fresh("json") + "-";
    rules_ += structured::to_gbnf(g, prefix);
    return prefix + "0";
  }

  // The JSON text of property `key` of the tool's parameters, resolved against the whole parameters
  // schema (so its $refs into "#/$defs/..." still point where they did).
  std::string json_property(const Tool& tool, const std::string& key) {
    return json_at(tool, "#/properties/" + pointer_token(key));
  }
  // The JSON text of the schema at `pointer` inside the tool's parameters.
  std::string json_at(const Tool& tool, const std::string& pointer) { return json_value(tool, schema_at(tool, pointer)); }
  static std::string pointer_token(const std::string& key) {
    std::string out;
    for (char c : key) {
      if (c == '~') out += "~0";
      else if (c == '/') out += "~1";
      else out += c;
    }
    return out;
  }

  // Raw text of a string value: no '<' (the closing tag starts with one), or one of a string enum's values.
  // The property's schema must still be one the JSON Schema front end takes (the same refusals as
  // response_format), though only its enum is enforced on raw text.
  std::string raw_string(const Tool& tool, const std::string& key) {
    return raw_string_at(tool, "#/properties/" + pointer_token(key), tool.parameters["properties"][key]);
  }
  std::string raw_string_at(const Tool& tool, const std::string& pointer, const Json& schema) {
    compile(tool, schema_at(tool, pointer));  // refused keywords are refused here too
    Json values;
    if (schema.contains("const")) values = Json::array({schema["const"]});
    else if (schema.contains("enum") && schema["enum"].is_array()) values = schema["enum"];
    // A string enum (or const) is a choice of its raw values. One mixing types is not enforced on raw
    // text: the formats' raw text cannot say which type a value such as 3 or "3" is.
    if (!values.empty()) {
      std::string body;
      bool all_plain = true;
      for (const Json& v : values) {
        if (!v.is_string() || v.get<std::string>().find('<') != std::string::npos) all_plain = false;
        else body += (body.empty() ? "" : " | ") + lit(v.get<std::string>());
      }
      if (all_plain) return "(" + body + ")";
    }
    return "raw-text";
  }

  std::string finish(const std::string& root_body) {
    std::string out = "root ::= " + root_body + "\n" + rules_;
    out += "raw-text ::= [^<]*\n";
    return out;
  }
  std::vector<std::string> specials() const { return specials_; }
  const ToolGrammarOptions& options() const { return options_; }

 private:
  // The tool's parameters schema entered at `pointer` (a $ref the JSON Schema front end follows first), so
  // the $refs inside the part still resolve against the whole schema.
  static Json schema_at(const Tool& tool, const std::string& pointer) {
    Json schema = tool.parameters;
    schema["$ref"] = pointer;
    return schema;
  }
  static structured::Grammar compile(const Tool& tool, const Json& schema) {
    try {
      return structured::grammar_from_json_schema(schema.dump(), {.any_whitespace = false});
    } catch (const Error& e) {
      fail("tool '", tool.name, "': its parameters schema is not supported for a forced call: ", e.what());
    }
  }

  const ToolGrammarOptions& options_;
  std::string rules_;
  std::vector<std::string> specials_;
  int next_ = 0;
};

// The declared properties of a tool's parameters, in schema order, and whether each is required.
std::vector<std::pair<std::string, bool>> properties_of(const Tool& tool) {
  std::vector<std::pair<std::string, bool>> out;
  const Json& p = tool.parameters;
  if (!p.contains("properties") || !p["properties"].is_object()) return out;
  std::set<std::string> required;
  if (p.contains("required") && p["required"].is_array())
    for (const Json& r : p["required"])
      if (r.is_string()) required.insert(r.get<std::string>());
  for (auto it = p["properties"].begin(); it != p["properties"].end(); ++it) out.push_back({it.key(), required.count(it.key()) > 0});
  return out;
}

// True when the parser of a raw-text format reads this property's value as raw text: its schema allows
// a string (tool_schema.h: schema_types; a value typed "string" among others is kept verbatim when no
// other type fits it).
bool string_valued(const Json& property_schema) {
  return schema_types(nlohmann::json::parse(property_schema.dump())).count("string") > 0;
}

// `item` once, or (parallel calls) one or more times, with `separator` between.
std::string calls(const Builder& b, const std::string& item, const std::string& separator = "") {
  if (!b.options().parallel_tool_calls) return item;
  return item + " (" + (separator.empty() ? "" : separator + " ") + item + ")*";
}

// A sequence of parameter elements: required ones as they are, optional ones with `?`.
std::string parameter_sequence(Builder& b, const std::vector<std::pair<std::string, std::string>>& elements,
                               const std::vector<std::pair<std::string, bool>>& properties) {
  std::string body;
  for (size_t i = 0; i < elements.size(); ++i) {
    const std::string name = b.fresh("param");
    b.rule(name, elements[i].second);
    body += " " + name + (properties[i].second ? "" : "?");
  }
  return body.empty() ? "\"\"" : body;
}

// Kimi K2 (markers.h kimi_k2; tool_kimi_k2.cpp): a section of calls, each
// <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>.
std::string kimi_k2_grammar(Builder& b, const std::vector<Tool>& tools) {
  using namespace kimi_k2;
  for (std::string_view t : {kSectionBegin, kSectionEnd, kCallBegin, kArgumentBegin, kCallEnd}) b.special(t);
  std::string call_body;
  for (const Tool& tool : tools) {
    // The parser reads the name up to the last ':'; a name with ':' would still round-trip, but '<'
    // could start a marker.
    check_markup_name(tool.name, tool.name, "name");
    const std::string call = b.fresh("call");
    b.rule(call, lit(std::string(kCallBegin) + "functions." + tool.name + ":") + " [0-9]{1,3} " + lit(kArgumentBegin) +
                     " " + b.json_value(tool, tool.parameters) + " " + lit(kCallEnd));
    call_body += (call_body.empty() ? "" : " | ") + call;
  }
  b.rule("call", call_body);
  return lit(kSectionBegin) + " " + calls(b, "call") + " " + lit(kSectionEnd);
}

// The XML-like formats of DeepSeek-V3.2 (DSML) and MiniMax-M2 (markers.h; tool_xml.cpp): a section of
// invokes, one parameter element per property.
std::string xml_grammar(Builder& b, const std::vector<Tool>& tools, bool dsml) {
  std::string_view section_begin = dsml ? deepseek_v32::kSectionBegin : minimax_m2::kSectionBegin;
  std::string_view section_end = dsml ? deepseek_v32::kSectionEnd : minimax_m2::kSectionEnd;
  std::string_view invoke_begin = dsml ? deepseek_v32::kInvokeBegin : minimax_m2::kInvokeBegin;
  std::string_view invoke_end = dsml ? deepseek_v32::kInvokeEnd : minimax_m2::kInvokeEnd;
  std::string_view parameter_begin = dsml ? deepseek_v32::kParameterBegin : minimax_m2::kParameterBegin;
  std::string_view parameter_end = dsml ? deepseek_v32::kParameterEnd : minimax_m2::kParameterEnd;
  // DSML's tags hold the special token ｜DSML｜; MiniMax-M2's tokenizer has its section tags as tokens.
  if (dsml) b.special(deepseek_v32::kDsml);
  else for (std::string_view t : {section_begin, section_end}) b.special(t);
  std::string invoke_body;
  for (const Tool& tool : tools) {
    check_markup_name(tool.name, tool.name, "name");
    const auto properties = properties_of(tool);
    std::vector<std::pair<std::string, std::string>> elements;
    for (const auto& [key, required] : properties) {
      check_markup_name(tool.name, key, "parameter name");
      const Json& schema = tool.parameters["properties"][key];
      // DSML: string="true" is raw text, string="false" JSON typed by the schema (tool_xml.cpp
      // deepseek_v32_types); MiniMax-M2: the schema alone says how the text is read (minimax_m2_types).
      const bool raw = string_valued(schema);
      std::string head = std::string(parameter_begin) + " name=\"" + key + "\"";
      if (dsml) head += raw ? " string=\"true\"" : " string=\"false\"";
      head += ">";
      const std::string value = raw ? b.raw_string(tool, key) : b.json_property(tool, key);
      elements.push_back({key, lit(head) + " " + value + " " + lit(std::string(parameter_end) + "\n")});
    }
    const std::string invoke = b.fresh("invoke");
    b.rule(invoke, lit(std::string(invoke_begin) + " name=\"" + tool.name + "\">\n") + " " +
                       parameter_sequence(b, elements, properties) + " " + lit(std::string(invoke_end) + "\n"));
    invoke_body += (invoke_body.empty() ? "" : " | ") + invoke;
  }
  b.rule("invoke", invoke_body);
  return lit(std::string(section_begin) + "\n") + " " + calls(b, "invoke") + " " + lit(section_end);
}

bool m3_tag_name(const std::string& key) {
  return !key.empty() && key.find_first_of(" /\t\n\"<>&") == std::string::npos && key != "item";
}

// A MiniMax-M3 value of the schema at `pointer`: raw text for strings, JSON text for other scalars, and
// for an object with required properties, or an array of unbounded length, either JSON text or the nested
// tags the template renders (to_xml in minimax-m3.jinja: NS<key>value NS</key> per property, in order;
// NS<item>value NS</item> per element), which the parser reads by the schema (tool_minimax_m3.cpp
// to_json). An object with no required property and an empty array stay JSON: their nested form would be
// empty text, which the parser cannot type.
std::string m3_value(Builder& b, const Tool& tool, const Json& schema, const std::string& pointer, int depth) {
  if (string_valued(schema)) return b.raw_string_at(tool, pointer, schema);
  const std::string json = b.json_at(tool, pointer);
  const std::string ns(minimax_m3::kNamespace);
  const auto types = schema_types(nlohmann::json::parse(schema.dump()));
  if (depth >= 8 || !schema.is_object() || schema.contains("$ref") || types.size() != 1) return json;
  if (*types.begin() == "object" && schema.contains("properties") && schema["properties"].is_object()) {
    std::set<std::string> required;
    if (schema.contains("required") && schema["required"].is_array())
      for (const Json& r : schema["required"])
        if (r.is_string() && schema["properties"].contains(r.get<std::string>())) required.insert(r.get<std::string>());
    if (required.empty()) return json;
    std::string nested;
    for (auto it = schema["properties"].begin(); it != schema["properties"].end(); ++it) {
      if (!m3_tag_name(it.key())) return json;
      const std::string element = b.fresh("m3-field");
      b.rule(element, lit(ns + "<" + it.key() + ">") + " " +
                          m3_value(b, tool, it.value(), pointer + "/properties/" + Builder::pointer_token(it.key()), depth + 1) +
                          " " + lit(ns + "</" + it.key() + ">"));
      nested += " " + element + (required.count(it.key()) ? "" : "?");
    }
    return "(" + json + " |" + nested + ")";
  }
  if (*types.begin() == "array" && schema.contains("items") && schema["items"].is_object() &&
      !schema.contains("minItems") && !schema.contains("maxItems") && !schema.contains("prefixItems")) {
    const std::string item = b.fresh("m3-item");
    b.rule(item, lit(ns + "<item>") + " " + m3_value(b, tool, schema["items"], pointer + "/items", depth + 1) + " " +
                     lit(ns + "</item>"));
    return "(" + json + " | " + item + "+)";
  }
  return json;
}

// MiniMax-M3 (markers.h minimax_m3; tool_minimax_m3.cpp): every tag after the namespace token NS, a
// parameter is a tag named after its key. Values are text typed by the schema as MiniMax-M2's; objects
// and arrays as JSON text or nested tags (m3_value).
std::string minimax_m3_grammar(Builder& b, const std::vector<Tool>& tools) {
  using namespace minimax_m3;
  b.special(kNamespace);
  const std::string ns(kNamespace);
  std::string invoke_body;
  for (const Tool& tool : tools) {
    check_markup_name(tool.name, tool.name, "name");
    const auto properties = properties_of(tool);
    std::vector<std::pair<std::string, std::string>> elements;
    for (const auto& [key, required] : properties) {
      check_markup_name(tool.name, key, "parameter name");
      if (key.find_first_of(" /\t\n") != std::string::npos)
        fail("tool '", tool.name, "': parameter name '", key, "' cannot be a MiniMax-M3 tag name");
      const Json& schema = tool.parameters["properties"][key];
      const std::string value = m3_value(b, tool, schema, "#/properties/" + Builder::pointer_token(key), 0);
      elements.push_back({key, lit(ns + "<" + key + ">") + " " + value + " " + lit(ns + "</" + key + ">")});
    }
    const std::string invoke = b.fresh("invoke");
    b.rule(invoke, lit(ns + "<invoke name=\"" + tool.name + "\">") + " " + parameter_sequence(b, elements, properties) +
                       " " + lit(ns + "</invoke>\n"));
    invoke_body += (invoke_body.empty() ? "" : " | ") + invoke;
  }
  b.rule("invoke", invoke_body);
  return lit(std::string(kSectionBegin) + "\n") + " " + calls(b, "invoke") + " " + lit(kSectionEnd);
}

// Kimi K3 XTML (markers.h kimi_k3; tool_kimi_k3.cpp): the response channel (empty), then the tools
// channel of calls, one argument element per property: type="string" raw text, any other type JSON.
// The message close is optional: the end-of-message token may follow the tools channel directly.
std::string kimi_k3_grammar(Builder& b, const std::vector<Tool>& tools) {
  using namespace kimi_k3;
  for (std::string_view t : {kOpen, kClose, kSep}) b.special(t);
  auto escape = [](const std::string& value) {  // attribute values escape '&' and '"' (tool_kimi_k3.cpp)
    std::string out;
    for (char c : value) out += c == '&' ? "&amp;" : c == '"' ? "&quot;" : std::string(1, c);
    return out;
  };
  std::string call_body;
  for (const Tool& tool : tools) {
    if (tool.name.empty()) fail("a tool with an empty name cannot be called");
    const auto properties = properties_of(tool);
    std::vector<std::pair<std::string, std::string>> elements;
    for (const auto& [key, required] : properties) {
      const Json& schema = tool.parameters["properties"][key];
      const bool raw = string_valued(schema);
      std::string type = "string";
      if (!raw) {
        auto types = schema_types(nlohmann::json::parse(schema.dump()));
        type = types.size() == 1 ? *types.begin() : "json";
      }
      const std::string head = std::string(kOpen) + "argument key=\"" + escape(key) + "\" type=\"" + type + "\"" +
                               std::string(kSep);
      const std::string value = raw ? b.raw_string(tool, key) : b.json_property(tool, key);
      elements.push_back({key, lit(head) + " " + value + " " + lit(std::string(kClose) + "argument" + std::string(kSep))});
    }
    const std::string call = b.fresh("call");
    b.rule(call, lit(std::string(kOpen) + "call tool=\"" + escape(tool.name) + "\" index=\"") + " [1-9] [0-9]? " +
                     lit("\"" + std::string(kSep)) + " " + parameter_sequence(b, elements, properties) + " " +
                     lit(kCallEnd));
    call_body += (call_body.empty() ? "" : " | ") + call;
  }
  b.rule("call", call_body);
  const std::string response = b.options().output_opens_response
                                   ? lit(kResponseEnd)
                                   : lit(std::string(kResponseBegin) + std::string(kResponseEnd));
  return response + " " + lit(kToolsBegin) + " " + calls(b, "call") + " " + lit(kToolsEnd) + " " + lit(kMessageEnd) + "?";
}

}  // namespace

std::vector<std::string> tool_call_tokens(std::string_view parser_name) {
  std::vector<std::string_view> tokens;
  if (parser_name == "kimi_k2")
    tokens = {kimi_k2::kSectionBegin, kimi_k2::kSectionEnd, kimi_k2::kSectionBeginSingular, kimi_k2::kSectionEndSingular,
              kimi_k2::kCallBegin, kimi_k2::kArgumentBegin, kimi_k2::kCallEnd};
  else if (parser_name == "deepseek_v32") tokens = {deepseek_v32::kDsml};
  else if (parser_name == "minimax_m2") tokens = {minimax_m2::kSectionBegin, minimax_m2::kSectionEnd};
  else if (parser_name == "minimax_m3") tokens = {minimax_m3::kNamespace};
  // kimi_k3: <|open|>, <|close|> and <|sep|> frame the response channel too.
  return {tokens.begin(), tokens.end()};
}

ToolGrammar tool_call_grammar(std::string_view parser_name, const nlohmann::ordered_json& tools,
                              const ToolGrammarOptions& options) {
  const std::vector<Tool> offered = offered_tools(tools, options);
  Builder b(options);
  std::string root;
  if (parser_name == "kimi_k2") root = kimi_k2_grammar(b, offered);
  else if (parser_name == "kimi_k3") root = kimi_k3_grammar(b, offered);
  else if (parser_name == "minimax_m2") root = xml_grammar(b, offered, /*dsml=*/false);
  else if (parser_name == "minimax_m3") root = minimax_m3_grammar(b, offered);
  else if (parser_name == "deepseek_v32") root = xml_grammar(b, offered, /*dsml=*/true);
  else fail("no tool-call grammar for parser '", parser_name, "'");
  return {b.finish(root), b.specials()};
}

}  // namespace sparrow::parsers
