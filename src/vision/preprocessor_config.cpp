#include "vision/preprocessor_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json_input.h"

namespace sparrow::vision {

std::optional<PreprocessorConfig> PreprocessorConfig::load(const std::string& dir) {
  const std::filesystem::path path = std::filesystem::path(dir) / "preprocessor_config.json";
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  JsonInput<nlohmann::json> parsed = parse_json_input<nlohmann::json>(text.str());
  SPARROW_CHECK(parsed.ok() && parsed.value.is_object(), path.string(), ": not a JSON object");
  return PreprocessorConfig(std::move(parsed.value), path.string());
}

const nlohmann::json* PreprocessorConfig::find(const char* key) const {
  auto it = json_.find(key);
  return it == json_.end() || it->is_null() ? nullptr : &*it;
}

bool PreprocessorConfig::has(const char* key) const { return find(key) != nullptr; }

PreprocessorConfig PreprocessorConfig::section(const char* key) const {
  const nlohmann::json* value = find(key);
  if (!value) return PreprocessorConfig(nlohmann::json::object(), where_ + " " + key);
  SPARROW_CHECK(value->is_object(), where_, ": ", key, " must be an object, got ", value->dump());
  return PreprocessorConfig(*value, where_ + " " + key);
}

void PreprocessorConfig::read_positive(const char* key, int64_t& into) const {
  const nlohmann::json* value = find(key);
  if (!value) return;
  SPARROW_CHECK(value->is_number_integer() && value->get<int64_t>() > 0, where_, ": ", key,
                " must be a positive integer, got ", value->dump());
  into = value->get<int64_t>();
}

void PreprocessorConfig::read_positive_or_first(const char* key, int64_t& into) const {
  const nlohmann::json* value = find(key);
  if (value && value->is_array()) {
    SPARROW_CHECK(!value->empty() && value->front().is_number_integer() && value->front().get<int64_t>() > 0, where_,
                  ": ", key, " must be a positive integer or a list of them, got ", value->dump());
    into = value->front().get<int64_t>();
    return;
  }
  read_positive(key, into);
}

void PreprocessorConfig::read_triple(const char* key, std::array<float, 3>& into) const {
  const nlohmann::json* value = find(key);
  if (!value) return;
  SPARROW_CHECK(value->is_array() && value->size() == 3 &&
                    std::all_of(value->begin(), value->end(), [](const nlohmann::json& v) { return v.is_number(); }),
                where_, ": ", key, " must be three numbers, got ", value->dump());
  for (size_t c = 0; c < 3; ++c) into[c] = (*value)[c].get<float>();
}

}  // namespace sparrow::vision
