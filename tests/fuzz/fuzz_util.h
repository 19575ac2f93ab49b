// What the fuzz targets share: where the repository's test data is, files in a scratch folder, and the
// one rule every target follows: bad input may be refused with sparrow::Error (the one-line error a user
// sees), nothing else. Any other exception escapes LLVMFuzzerTestOneInput, which libFuzzer reports as a
// crash, as it does for a broken property (`require`).
#pragma once
#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "core/error.h"

namespace sparrow::fuzz {

// A file of the source tree (SPARROW_SOURCE_DIR is set by tests/fuzz/CMakeLists.txt).
inline std::string source_path(const std::string& relative) { return std::string(SPARROW_SOURCE_DIR) + "/" + relative; }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz target: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz target: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// One scratch folder per fuzzing process, for the code that reads files (model folders, safetensors),
// removed when the process exits normally.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "sparrow_fuzz_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline const std::string& scratch_dir() {
  static const ScratchDir dir;
  return dir.path();
}

// Runs `f`, accepting a sparrow::Error as the expected refusal of bad input.
template <typename F>
void refusing_only_with_errors(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

// A property the code under test promises: a broken one is a finding, reported as a crash.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz target: broken property: %s\n", what);
  std::abort();
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace sparrow::fuzz
