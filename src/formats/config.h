// Typed, checked access to a Hugging Face config.json. Every getter names the field in its error,
// so a bad checkpoint gives one line such as:
//   config.json: field 'hidden_size' must be an integer, found "abc"
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sparrow {

class Config {
 public:
  Config() = default;
  // `where` prefixes error messages ("config.json", "config.json: text_config").
  Config(nlohmann::json json, std::string where);
  static Config load(const std::string& path);  // parses the file; errors name the file

  const nlohmann::json& json() const { return json_; }
  const std::string& where() const { return where_; }
  bool has(const std::string& key) const;  // present and not null

  // Required fields: missing → "config.json: missing field 'x'".
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::string> get_string_list(const std::string& key) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;
  // Optional fields: absent or null → the default.
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key, double def) const;
  bool get_bool(const std::string& key, bool def) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  Config get_object(const std::string& key) const;  // a nested object (e.g. text_config)

  // The rotary-embedding parameters as transformers standardizes them (modeling_rope_utils.py,
  // convert_rope_params_to_dict and standardize_rope_params, transformers 5.17): `rope_scaling` when it
  // is a non-empty object, else `rope_parameters`, else {}; then, where the dict lacks them, rope_type
  // (its legacy `type`, else "default"), rope_theta (the top-level field, else the family's
  // `default_theta`), partial_rotary_factor (the top-level field, when given) and, for the scaled types
  // llama3 / yarn / longrope, original_max_position_embeddings (the top-level field always wins; else
  // `max_position_embeddings`). The one parser of these fields: families pass their defaults.
  nlohmann::json rope_parameters(double default_theta, int64_t max_position_embeddings) const;

  // Unsupported-value errors: "config.json: unsupported hidden_act 'gelu' (supported: silu)".
  [[noreturn]] void unsupported(const std::string& key, const std::string& value, const std::string& supported) const;
  // Range check: throws "config.json: field 'x' must be ..." unless ok.
  void require(bool ok, const std::string& key, const std::string& requirement) const;

 private:
  const nlohmann::json& at(const std::string& key) const;
  nlohmann::json json_;
  std::string where_;
};

// The model's context length as vLLM derives max_model_len: the smallest of the length keys a config.json
// has (in text_config for vision-language configs), and which key that was; nullopt when it has none. The
// one context-length rule (the commands' model_context_length, the Python API's LLM).
struct ModelPositions {
  int64_t tokens = 0;
  std::string key;  // "max_position_embeddings", "model_max_length", ...
};
std::optional<ModelPositions> model_positions(const nlohmann::json& config);

}  // namespace sparrow
