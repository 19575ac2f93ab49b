#include "formats/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace sparrow {

namespace {

// A JSON value as it appears in the file, shortened so that an error message stays one line.
std::string quote_value(const nlohmann::json& value) {
  std::string text = value.dump();
  constexpr size_t kMaxLength = 60;
  if (text.size() > kMaxLength) text = text.substr(0, kMaxLength) + "...";
  return text;
}

// JSON has one number type; an integer field may be written as 64 or 64.0, never as 64.5 or true.
bool to_int64(const nlohmann::json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return true;
  }
  if (value.is_number_float()) {
    double d = value.get<double>();
    // 2^63 is exactly representable; anything at or above it does not fit.
    if (!std::isfinite(d) || d != std::floor(d) || d < -0x1p63 || d >= 0x1p63) return false;
    *out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

}  // namespace

Config::Config(nlohmann::json json, std::string where) : json_(std::move(json)), where_(std::move(where)) {
  SPARROW_CHECK(json_.is_object(), where_, ": expected a JSON object, found ", quote_value(json_));
}

Config Config::load(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK(in, name, ": cannot open '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    fail(name, ": not valid JSON (syntax error at byte ", e.byte, ") in '", path, "'");
  }
  return Config(std::move(json), name);
}

bool Config::has(const std::string& key) const {
  if (!json_.is_object()) return false;
  auto it = json_.find(key);
  return it != json_.end() && !it->is_null();
}

const nlohmann::json& Config::at(const std::string& key) const {
  SPARROW_CHECK(has(key), where_, ": missing field '", key, "'");
  return *json_.find(key);
}

int64_t Config::get_int(const std::string& key) const {
  const nlohmann::json& value = at(key);
  int64_t result = 0;
  SPARROW_CHECK(to_int64(value, &result), where_, ": field '", key, "' must be an integer, found ", quote_value(value));
  return result;
}

double Config::get_float(const std::string& key) const {
  const nlohmann::json& value = at(key);
  SPARROW_CHECK(value.is_number(), where_, ": field '", key, "' must be a number, found ", quote_value(value));
  return value.get<double>();
}

bool Config::get_bool(const std::string& key) const {
  const nlohmann::json& value = at(key);
  SPARROW_CHECK(value.is_boolean(), where_, ": field '", key, "' must be true or false, found ", quote_value(value));
  return value.get<bool>();
}

std::string Config::get_string(const std::string& key) const {
  const nlohmann::json& value = at(key);
  SPARROW_CHECK(value.is_string(), where_, ": field '", key, "' must be a string, found ", quote_value(value));
  return value.get<std::string>();
}

std::vector<std::string> Config::get_string_list(const std::string& key) const {
  const nlohmann::json& value = at(key);
  std::vector<std::string> result;
  bool ok = value.is_array();
  for (size_t i = 0; ok && i < value.size(); ++i) {
    ok = value[i].is_string();
    if (ok) result.push_back(value[i].get<std::string>());
  }
  SPARROW_CHECK(ok, where_, ": field '", key, "' must be a list of strings, found ", quote_value(value));
  return result;
}

std::vector<int64_t> Config::get_int_list(const std::string& key) const {
  const nlohmann::json& value = at(key);
  std::vector<int64_t> result;
  bool ok = value.is_array();
  for (size_t i = 0; ok && i < value.size(); ++i) {
    int64_t element = 0;
    ok = to_int64(value[i], &element);
    if (ok) result.push_back(element);
  }
  SPARROW_CHECK(ok, where_, ": field '", key, "' must be a list of integers, found ", quote_value(value));
  return result;
}

int64_t Config::get_int(const std::string& key, int64_t def) const { return has(key) ? get_int(key) : def; }

double Config::get_float(const std::string& key, double def) const { return has(key) ? get_float(key) : def; }

bool Config::get_bool(const std::string& key, bool def) const { return has(key) ? get_bool(key) : def; }

std::string Config::get_string(const std::string& key, const std::string& def) const {
  return has(key) ? get_string(key) : def;
}

Config Config::get_object(const std::string& key) const {
  const nlohmann::json& value = at(key);
  SPARROW_CHECK(value.is_object(), where_, ": field '", key, "' must be an object, found ", quote_value(value));
  return Config(value, where_ + ": " + key);
}

nlohmann::json Config::rope_parameters(double default_theta, int64_t max_position_embeddings) const {
  const bool scaling = has("rope_scaling") && !(json_["rope_scaling"].is_object() && json_["rope_scaling"].empty());
  const char* key = scaling ? "rope_scaling" : "rope_parameters";
  nlohmann::json params = has(key) ? json_[key] : nlohmann::json::object();
  require(params.is_object(), key, "an object");
  const char* type_key = params.contains("rope_type") ? "rope_type" : "type";
  if (params.contains(type_key))
    require(params[type_key].is_string(), std::string(key) + "." + type_key, "a string");
  if (!params.contains("rope_type")) params["rope_type"] = params.contains("type") ? params["type"] : nlohmann::json("default");
  if (!params.contains("rope_theta")) params["rope_theta"] = get_float("rope_theta", default_theta);
  if (!params.contains("partial_rotary_factor") && has("partial_rotary_factor"))
    params["partial_rotary_factor"] = get_float("partial_rotary_factor");
  const std::string type = params["rope_type"].get<std::string>();
  if (type == "llama3" || type == "yarn" || type == "longrope") {
    if (has("original_max_position_embeddings"))
      params["original_max_position_embeddings"] = get_int("original_max_position_embeddings");
    else if (!params.contains("original_max_position_embeddings"))
      params["original_max_position_embeddings"] = max_position_embeddings;
  }
  return params;
}

void Config::unsupported(const std::string& key, const std::string& value, const std::string& supported) const {
  fail(where_, ": unsupported ", key, " '", value, "' (supported: ", supported, ")");
}

void Config::require(bool ok, const std::string& key, const std::string& requirement) const {
  if (ok) return;
  if (has(key)) fail(where_, ": field '", key, "' must be ", requirement, ", found ", quote_value(*json_.find(key)));
  fail(where_, ": field '", key, "' must be ", requirement);
}

std::optional<ModelPositions> model_positions(const nlohmann::json& config) {
  const nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  std::optional<ModelPositions> smallest;
  for (const char* key : {"max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                          "max_sequence_length", "max_seq_length", "seq_len"})
    if (text.contains(key) && text[key].is_number_integer() && text[key].get<int64_t>() > 0 &&
        (!smallest || text[key].get<int64_t>() < smallest->tokens))
      smallest = ModelPositions{text[key].get<int64_t>(), key};
  return smallest;
}

}  // namespace sparrow
