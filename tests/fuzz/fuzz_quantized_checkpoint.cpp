// A checkpoint whose one safetensors file is fuzzed, under a config declaring every quantized format
// (formats/quantization.h: FP8 block-scaled, MXFP8, NVFP4, MXFP4): every weight the file names is taken
// under its logical name, in the shape its stored tensors imply, so that a scale of the wrong shape or
// dtype, a missing sibling or a bad packed width is refused with a sparrow::Error, never read out of bounds.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "formats/checkpoint.h"
#include "fuzz_util.h"

using namespace sparrow;

namespace {

// Two folders for the same file: ModelOpt's MIXED_PRECISION declares NVFP4, MXFP8 and FP8 blocks;
// compressed-tensors declares MXFP4 and MXFP8.
const std::vector<std::string>& model_dirs() {
  static const std::vector<std::string> dirs = [] {
    const std::string modelopt = fuzz::scratch_dir() + "/modelopt", compressed = fuzz::scratch_dir() + "/compressed";
    std::filesystem::create_directories(modelopt);
    std::filesystem::create_directories(compressed);
    fuzz::write_file(modelopt + "/config.json", "{}");
    fuzz::write_file(modelopt + "/hf_quant_config.json",
                     R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
                         "a": {"quant_algo": "NVFP4"}, "b": {"quant_algo": "MXFP8"}, "c": {"quant_algo": "FP8_PB_WO"}}}})");
    fuzz::write_file(compressed + "/config.json", R"({"quantization_config": {"quant_method": "compressed-tensors",
        "config_groups": {"a": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}},
                          "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}}}}})");
    return std::vector<std::string>{modelopt, compressed};
  }();
  return dirs;
}

// The logical shape a stored weight implies: packed 4-bit weights hold two values a byte.
Shape logical_shape(const TensorInfo& info, bool packed) {
  Shape shape = info.shape;
  if (packed && !shape.empty()) shape.back() *= 2;
  return shape;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const std::string& dir : model_dirs()) {
    fuzz::write_file(dir + "/model.safetensors", fuzz::as_text(data, size));
    fuzz::refusing_only_with_errors([&] {
      std::unique_ptr<Checkpoint> checkpoint = Checkpoint::open(dir);
      auto file = SafetensorsFile::open(dir + "/model.safetensors");
      for (const auto& entry : file->tensors()) {
        const std::string& name = entry.first;
        const TensorInfo& info = entry.second;
        const bool packed = name.ends_with(".weight_packed") || info.dtype == DType::U8;
        const std::string logical = name.ends_with(".weight_packed") ? name.substr(0, name.size() - 7) : name;
        if (!checkpoint->has(logical)) continue;
        fuzz::refusing_only_with_errors([&] {
          Tensor t = checkpoint->take(logical, logical_shape(info, packed));
          volatile float sum = 0;
          for (int64_t i = 0; i < t.numel(); ++i) sum = sum + t.data()[i];
        });
      }
    });
  }
  return 0;
}
