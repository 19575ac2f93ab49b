// A checkpoint's preprocessor_config.json as the image processors read it (minimax_m3_vl_processor.h,
// kimi_k3_processor.h): typed reads of the keys they take, with one-line errors naming the file and the key.
// Keys that are absent (or null) leave the caller's default.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace sparrow::vision {

class PreprocessorConfig {
 public:
  // dir/preprocessor_config.json; nothing when the folder has none.
  static std::optional<PreprocessorConfig> load(const std::string& dir);

  bool has(const char* key) const;
  // A nested object (Kimi's media_proc_cfg); an error when `key` is there but not an object.
  PreprocessorConfig section(const char* key) const;
  void read_positive(const char* key, int64_t& into) const;
  // A positive integer, or a list of them whose first is taken (Kimi's merge_kernel_size [2, 2]).
  void read_positive_or_first(const char* key, int64_t& into) const;
  void read_triple(const char* key, std::array<float, 3>& into) const;
  const std::string& where() const { return where_; }

 private:
  PreprocessorConfig(nlohmann::json json, std::string where) : json_(std::move(json)), where_(std::move(where)) {}
  const nlohmann::json* find(const char* key) const;  // null when absent or null
  nlohmann::json json_;
  std::string where_;  // the file, and the section's key inside it
};

}  // namespace sparrow::vision
