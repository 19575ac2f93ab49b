// The request's tools as the tool parsers need them: which tool names exist, and the JSON schema of
// each parameter, used to give untyped argument text (MiniMax's XML values, DeepSeek's string="false"
// values) its JSON type the way vLLM does (vllm/tool_parsers/utils.py extract_types_from_schema and
// coerce_to_schema_type).
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>
#include <string_view>

namespace sparrow::parsers {

class ToolSchemas {
 public:
  // `tools`: the request's list, [{"type": "function", "function": {"name", "parameters"}}] (a bare
  // {"name", "parameters"} entry is accepted too), or null.
  explicit ToolSchemas(const nlohmann::json& tools);
  // A call to `name` is accepted: the tool was offered, or no tools were given at all.
  bool accepts(std::string_view name) const;
  // The schema of parameter `parameter` of tool `tool`, or nullptr when not declared.
  const nlohmann::json* parameter(std::string_view tool, std::string_view parameter) const;

 private:
  std::map<std::string, nlohmann::json, std::less<>> parameters_;  // tool name -> its "properties"
};

// The JSON types a schema allows: "type" (a name or a list), the types of "enum" values, and those of
// "anyOf"/"oneOf"/"allOf" branches; {"string"} when the schema says nothing. Common aliases ("int",
// "float", "bool", "list", "dict", ...) are normalised.
std::set<std::string> schema_types(const nlohmann::json& schema);

// Converts untyped argument text to a JSON value of one of `types`, trying them in the order null
// (only the text "null"), integer, number (finite), boolean ("true"/"1", "false"/"0"), object, array,
// string (the text verbatim). When none fits, or `types` is empty (unknown), the text is parsed as JSON
// if it is finite JSON, else kept as a string.
nlohmann::json coerce_value(const std::string& text, const std::set<std::string>& types);

}  // namespace sparrow::parsers
