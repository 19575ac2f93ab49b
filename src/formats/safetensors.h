// safetensors files (https://github.com/huggingface/safetensors, format: 8-byte little-endian header
// length, JSON header, raw little-endian data), memory-mapped read-only. A file that is truncated, whose
// header is not valid JSON, or whose offsets fall outside the data gives a one-line sparrow::Error.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sparrow {

// The safetensors dtypes a checkpoint may contain. Only the float types convert to fp32 (to_float32);
// the others may sit in a file as long as no one takes them. F8_E8M0 (a power-of-two exponent byte) is
// how some FP8 checkpoints store their block scales ("scale_fmt": "ue8m0").
enum class DType { F32, F16, BF16, F8_E4M3, I32, I64, U8, I8, BOOL, F64, F8_E5M2, F8_E8M0, I16, U16, U32, U64 };
const char* dtype_name(DType t);
// The dtype a safetensors header spells `name` ("BF16", "F32", ...); false for another name.
bool parse_dtype(const std::string& name, DType* out);
size_t dtype_size(DType t);

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  const uint8_t* data;  // inside the mapping
  size_t nbytes;
  std::string file;  // for error messages
};

class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
};

// Converts any float tensor (F32, F16, BF16, F8_E4M3, F8_E8M0) to fp32, exactly. F32 data is returned
// as a view of the read-only mapping (zero copy, kept alive by `keep_alive`): clone() it before writing
// in place. Other types are converted into a new buffer; any other dtype is a one-line error.
Tensor to_float32(const TensorInfo& info, std::shared_ptr<void> keep_alive);

// Writes host tensors as a safetensors file, each in its own dtype (FP4 codes as U8, E8M0 scales as
// F8_E8M0; used by `sparrow score` and by tests).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors);

}  // namespace sparrow
