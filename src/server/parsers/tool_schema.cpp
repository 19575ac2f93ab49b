#include "server/parsers/tool_schema.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "core/json_input.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

using nlohmann::json;

ToolSchemas::ToolSchemas(const json& tools) {
  if (!tools.is_array()) return;
  for (const json& tool : tools) {
    if (!tool.is_object()) continue;
    const json& function = tool.contains("function") && tool["function"].is_object() ? tool["function"] : tool;
    if (!function.contains("name") || !function["name"].is_string()) continue;
    json properties = json::object();
    if (function.contains("parameters") && function["parameters"].is_object()) {
      const json& parameters = function["parameters"];
      if (parameters.contains("properties") && parameters["properties"].is_object()) properties = parameters["properties"];
    }
    parameters_[function["name"].get<std::string>()] = std::move(properties);
  }
}

bool ToolSchemas::accepts(std::string_view name) const {
  return parameters_.empty() || parameters_.find(name) != parameters_.end();
}

const json* ToolSchemas::parameter(std::string_view tool, std::string_view parameter) const {
  auto it = parameters_.find(tool);
  if (it == parameters_.end()) return nullptr;
  auto p = it->second.find(std::string(parameter));
  return p == it->second.end() ? nullptr : &*p;
}

namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// vLLM's _TYPE_ALIASES: type names models and hand-written schemas use instead of JSON Schema's.
std::string normalise_type(std::string_view name) {
  static const std::map<std::string, std::string, std::less<>> aliases = {
      {"str", "string"},     {"text", "string"},    {"varchar", "string"}, {"char", "string"},
      {"enum", "string"},    {"int", "integer"},    {"int32", "integer"},  {"int64", "integer"},
      {"uint", "integer"},   {"uint32", "integer"}, {"uint64", "integer"}, {"long", "integer"},
      {"short", "integer"},  {"unsigned", "integer"}, {"float", "number"}, {"float32", "number"},
      {"float64", "number"}, {"double", "number"},  {"bool", "boolean"},   {"dict", "object"},
      {"arr", "array"},      {"list", "array"},     {"sequence", "array"}};
  std::string key = lower(trim(name));
  auto it = aliases.find(key);
  return it == aliases.end() ? key : it->second;
}

// `level`: how many anyOf / oneOf / allOf branches lead here. Request schemas nest at most
// kMaxJsonDepth levels (the request body is checked), and a schema given some other way stops there too.
void collect_types(const json& schema, std::set<std::string>& types, int level) {
  if (!schema.is_object() || level > kMaxJsonDepth) return;
  if (schema.contains("type")) {
    const json& type = schema["type"];
    if (type.is_string()) types.insert(normalise_type(type.get<std::string>()));
    if (type.is_array())
      for (const json& t : type)
        if (t.is_string()) types.insert(normalise_type(t.get<std::string>()));
  }
  if (schema.contains("enum") && schema["enum"].is_array()) {
    for (const json& value : schema["enum"]) {
      if (value.is_null()) types.insert("null");
      else if (value.is_boolean()) types.insert("boolean");
      else if (value.is_number_integer()) types.insert("integer");
      else if (value.is_number()) types.insert("number");
      else if (value.is_string()) types.insert("string");
      else if (value.is_array()) types.insert("array");
      else if (value.is_object()) types.insert("object");
    }
  }
  for (const char* branch : {"anyOf", "oneOf", "allOf"})
    if (schema.contains(branch) && schema[branch].is_array())
      for (const json& choice : schema[branch]) {
        std::set<std::string> inner;
        collect_types(choice, inner, level + 1);
        if (inner.empty()) inner.insert("string");  // as schema_types() says of a schema that says nothing
        types.insert(inner.begin(), inner.end());
      }
}

bool all_finite(const json& value) {
  if (value.is_number_float()) return std::isfinite(value.get<double>());
  if (value.is_structured())
    for (const json& item : value)
      if (!all_finite(item)) return false;
  return true;
}

// Python's json.loads, keeping only finite results (inf/nan cannot be written back as JSON). Text
// nested deeper than kMaxJsonDepth is not parsed (it stays a string): the model wrote it, and nothing
// that walks the value may recurse that deep.
std::optional<json> parse_finite_json(const std::string& text) {
  JsonInput<json> parsed = parse_json_input<json>(text);
  if (parsed.ok() && all_finite(parsed.value)) return std::move(parsed.value);
  return std::nullopt;
}

// Python's int(text): optional sign and decimal digits, surrounding whitespace allowed.
std::optional<int64_t> parse_integer(std::string_view text) {
  text = trim(text);
  if (!text.empty() && text[0] == '+') text.remove_prefix(1);
  if (text.empty() || text[0] == '+') return std::nullopt;
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// Python's float(text) for finite decimal numbers: [sign] digits [. digits] [e [sign] digits], at
// least one digit before the exponent.
std::optional<double> parse_number(std::string_view text) {
  text = trim(text);
  size_t i = 0, digits = 0;
  auto skip_digits = [&] {
    size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    return i - start;
  };
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  digits += skip_digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    digits += skip_digits();
  }
  if (digits == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    if (skip_digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  double value = std::strtod(std::string(text).c_str(), nullptr);
  if (!std::isfinite(value)) return std::nullopt;
  return value;
}

}  // namespace

std::set<std::string> schema_types(const json& schema) {
  std::set<std::string> types;
  collect_types(schema, types, 0);
  if (types.empty()) types.insert("string");
  return types;
}

json coerce_value(const std::string& text, const std::set<std::string>& types) {
  // The order of vLLM's coerce_to_schema_type: the most specific type first, string last.
  for (const char* type : {"null", "integer", "number", "boolean", "object", "array", "string"}) {
    if (!types.count(type)) continue;
    std::string_view t = type;
    if (t == "null") {
      if (lower(text) == "null") return nullptr;
    } else if (t == "integer") {
      if (auto value = parse_integer(text)) return *value;
    } else if (t == "number") {
      if (auto value = parse_number(text)) {
        double whole = std::trunc(*value);
        bool integral = whole == *value && std::fabs(whole) < 9.2e18;
        return integral ? json(static_cast<int64_t>(whole)) : json(*value);
      }
    } else if (t == "boolean") {
      std::string word = lower(trim(text));
      if (word == "true" || word == "1") return true;
      if (word == "false" || word == "0") return false;
    } else if (t == "object" || t == "array") {
      if (auto value = parse_finite_json(text)) return *value;
    } else {
      return text;
    }
  }
  if (auto value = parse_finite_json(text)) return *value;
  return text;
}

}  // namespace sparrow::parsers
