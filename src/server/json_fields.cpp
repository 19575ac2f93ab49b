#include "server/json_fields.h"

#include "core/json_input.h"
#include "server/api_error.h"

namespace sparrow::server {

Fields::Fields(const Json& object, std::string path) : object_(object), path_(std::move(path)) {
  if (!object_.is_object())
    bad_request(path_.empty() ? "the request body must be a JSON object" : "`" + path_ + "` must be an object", path_);
}

std::string Fields::param(const std::string& name) const { return path_.empty() ? name : path_ + "." + name; }

void Fields::invalid(const std::string& name, const std::string& message) const {
  bad_request("`" + param(name) + "` " + message, param(name));
}

const Json* Fields::get(const std::string& name) const {
  auto it = object_.find(name);
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

bool Fields::has(const std::string& name) const { return get(name) != nullptr; }

std::optional<bool> Fields::boolean(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) invalid(name, "must be a boolean");
  return v->get<bool>();
}

std::optional<int64_t> Fields::integer(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  // pydantic accepts floats with no fractional part (2.0) for int fields.
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (d >= -9.2e18 && d <= 9.2e18 && d == double(int64_t(d))) return int64_t(d);
  }
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX)) invalid(name, "is too large");
  if (!v->is_number_integer()) invalid(name, "must be an integer");
  return v->get<int64_t>();
}

std::optional<double> Fields::number(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_number()) invalid(name, "must be a number");
  return v->get<double>();
}

std::optional<std::string> Fields::string(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_string()) invalid(name, "must be a string");
  return v->get<std::string>();
}

const Json* Fields::object(const std::string& name) const {
  const Json* v = get(name);
  if (v && !v->is_object()) invalid(name, "must be an object");
  return v;
}

std::optional<std::vector<int64_t>> Fields::integers(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_array()) invalid(name, "must be a list of integers");
  std::vector<int64_t> out;
  for (const auto& x : *v) {
    if (!x.is_number_integer()) invalid(name, "must be a list of integers");
    out.push_back(x.get<int64_t>());
  }
  return out;
}

std::optional<std::vector<std::string>> Fields::strings(const std::string& name) const {
  const Json* v = get(name);
  if (!v) return std::nullopt;
  if (v->is_string()) return std::vector<std::string>{v->get<std::string>()};
  if (!v->is_array()) invalid(name, "must be a string or a list of strings");
  std::vector<std::string> out;
  for (const auto& x : *v) {
    if (!x.is_string()) invalid(name, "must be a string or a list of strings");
    out.push_back(x.get<std::string>());
  }
  return out;
}

Json parse_json_object(const std::string& body) {
  JsonInput<Json> parsed = parse_json_input<Json>(body);
  if (parsed.status == JsonInput<Json>::Status::TooDeep)
    bad_request("the request body nests arrays and objects more than " + std::to_string(kMaxJsonDepth) +
                " levels deep (the limit)");
  if (!parsed.ok()) bad_request("the request body is not valid JSON");
  if (!parsed.value.is_object()) bad_request("the request body must be a JSON object");
  return std::move(parsed.value);
}

}  // namespace sparrow::server
