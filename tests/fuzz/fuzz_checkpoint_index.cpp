// A sharded checkpoint's model.safetensors.index.json ({"weight_map": {tensor: shard file}}): Checkpoint::open
// on a folder holding the DeepSeek-V3.2 FP8 test fixture's config and three shards, with the fuzzed index.
// A broken index must be refused with a sparrow::Error.
#include <cstdint>
#include <filesystem>

#include "formats/checkpoint.h"
#include "fuzz_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

const std::string& model_dir() {
  static const std::string dir = [] {
    const std::string fixture = fuzz::source_path("tests/fixtures/deepseek_v32_fp8");
    for (const char* name : {"config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                             "model-00003-of-00003.safetensors"})
      fs::create_symlink(fixture + "/" + name, fuzz::scratch_dir() + "/" + name);
    return fuzz::scratch_dir();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = model_dir();
  fuzz::write_file(dir + "/model.safetensors.index.json", fuzz::as_text(data, size));
  fuzz::refusing_only_with_errors([&] { Checkpoint::open(dir); });
  return 0;
}
