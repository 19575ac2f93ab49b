// Typed access to the fields of a JSON request body. A field of the wrong type or out of range is a
// 400 ApiError naming the field (`param`), the way vLLM's pydantic validation answers; a field that is
// absent or null reads as "not given". Unknown fields are ignored, as vLLM does.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace sparrow::server {

// Request and response bodies keep their keys in order: a tool's JSON schema reaches the chat template
// in the order the client wrote it (as Python's json.loads keeps it), and responses read naturally.
using Json = nlohmann::ordered_json;

class Fields {
 public:
  // `path` prefixes field names in error messages and `param` (e.g. "stream_options").
  explicit Fields(const Json& object, std::string path = {});

  bool has(const std::string& name) const;         // present and not null
  const Json* get(const std::string& name) const;  // nullptr when absent or null

  std::optional<bool> boolean(const std::string& name) const;
  std::optional<int64_t> integer(const std::string& name) const;
  std::optional<double> number(const std::string& name) const;
  std::optional<std::string> string(const std::string& name) const;
  // A JSON object, or nullptr.
  const Json* object(const std::string& name) const;
  // A list of integers; a single integer when `allow_single`.
  std::optional<std::vector<int64_t>> integers(const std::string& name) const;
  // A string or a list of strings (OpenAI's `stop`).
  std::optional<std::vector<std::string>> strings(const std::string& name) const;

  // The field's full name for messages and `param`: path.name.
  std::string param(const std::string& name) const;
  [[noreturn]] void invalid(const std::string& name, const std::string& message) const;

 private:
  const Json& object_;
  std::string path_;
};

// Parses a request body (core/json_input.h): 400 unless it is a JSON object nested at most kMaxJsonDepth
// levels.
Json parse_json_object(const std::string& body);

}  // namespace sparrow::server
