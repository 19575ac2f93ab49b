// A safetensors file (8-byte header length, JSON header, data): SafetensorsFile::open, then every float
// tensor converted to fp32 and read, so that an offset the header check let through shows up as an
// out-of-bounds read. A broken file must be refused with a sparrow::Error.
#include <cstdint>

#include "formats/safetensors.h"
#include "fuzz_util.h"

using namespace sparrow;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = fuzz::scratch_dir() + "/model.safetensors";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::refusing_only_with_errors([&] {
    std::shared_ptr<SafetensorsFile> file = SafetensorsFile::open(path);
    size_t total_bytes = 0;
    for (const auto& entry : file->tensors()) {
      const TensorInfo& info = entry.second;
      total_bytes += info.nbytes;
      fuzz::require(total_bytes <= size, "the tensors do not overlap and lie inside the file");
      fuzz::refusing_only_with_errors([&] {
        Tensor t = to_float32(info, file);
        volatile float sum = 0;
        for (int64_t i = 0; i < t.numel(); ++i) sum = sum + t.data()[i];
      });
    }
  });
  return 0;
}
