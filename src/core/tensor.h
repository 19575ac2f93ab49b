// A dense, row-major tensor. On the CPU the reference path computes everything in float32; on a CUDA
// device a tensor may also hold bfloat16 (weights, activations) or int32 (token ids, selections).
// A Tensor either owns its storage or views storage kept alive by someone else (a memory-mapped
// checkpoint, a larger tensor); copying a Tensor copies the handle, not the data.
//
// data() and row() give float pointers for host float32 tensors (what CPU code reads and writes);
// raw() gives the address of any tensor, for kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sparrow {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);  // "[4, 128]"
int64_t shape_numel(const Shape& shape);

enum class Device { Cpu, Cuda };
// U8: raw bytes (workspaces, cache pools). F8E4M3: FP8 weights (OCP E4M3 "fn"), which carry their
// block scales (block_scales(): fp32, one per 128x128 block, DeepSeek's weight_scale_inv).
// F8E4M3 weights may instead carry E8M0 group scales (MXFP8, with_group_scales).
// E2M1x2: FP4 weights as released, two OCP E2M1 codes a byte (element 2i in the low nibble; the last
// dimension counts bytes), which carry their group scales (block_scales(): F8E4M3 one per 16 values =
// NVFP4, whose per-matrix weight_scale_2 are global_scales(); F8E8M0 one per 32 values = MXFP4).
// F8E8M0: OCP MX's power-of-two scales (2^(code - 127)).
enum class ScalarType { F32, BF16, I32, I64, U8, F8E4M3, E2M1x2, F8E8M0 };

const char* device_name(Device device);    // "cpu", "cuda"
Device parse_device(const std::string& name);  // "cpu" | "cuda"; anything else is an error
int64_t scalar_size(ScalarType type);
// "float32", "bfloat16", "int32", "int64", "uint8", "float8_e4m3fn", "float4_e2m1fn_x2", "float8_e8m0fnu"
const char* scalar_name(ScalarType type);

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(Shape shape, ScalarType type = ScalarType::F32, Device device = Device::Cpu);
  static Tensor zeros(Shape shape, ScalarType type = ScalarType::F32, Device device = Device::Cpu);
  // A host float32 view of memory owned elsewhere; `keep_alive` (may be null) holds that memory.
  static Tensor view(float* data, Shape shape, std::shared_ptr<void> keep_alive = nullptr);
  // The same of any type (e.g. the bf16 bytes of a memory-mapped checkpoint, read-only by contract).
  static Tensor view(void* data, Shape shape, ScalarType type, std::shared_ptr<void> keep_alive = nullptr);

  // The elements of an fp32 tensor (any other type is an error: its bytes are not floats; use as<T>()).
  float* data() {
    check_f32();
    return static_cast<float*>(data_);
  }
  const float* data() const {
    check_f32();
    return static_cast<const float*>(data_);
  }
  void* raw() { return data_; }
  const void* raw() const { return data_; }
  template <typename T>
  T* as() { return static_cast<T*>(data_); }
  template <typename T>
  const T* as() const { return static_cast<const T*>(data_); }

  const Shape& shape() const { return shape_; }
  ScalarType type() const { return type_; }
  Device device() const { return device_; }
  bool on_cpu() const { return device_ == Device::Cpu; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int64_t numel() const { return shape_numel(shape_); }
  int64_t nbytes() const { return numel() * scalar_size(type_); }
  bool defined() const { return data_ != nullptr || numel() == 0; }

  // Same storage, new shape (element counts must match).
  Tensor reshape(Shape shape) const;
  // A view of `shape` x `type` starting `byte_offset` bytes into this tensor's storage (one buffer
  // holding several arrays, e.g. a step's inputs uploaded with one copy).
  Tensor view_bytes(int64_t byte_offset, Shape shape, ScalarType type) const;
  // Rows [begin, end) along the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const;
  // Pointer to row i along the first dimension (host float32).
  float* row(int64_t i) { return data() + i * row_size(); }
  const float* row(int64_t i) const { return data() + i * row_size(); }
  int64_t row_size() const { return shape_.empty() ? 1 : numel() / shape_[0]; }
  Tensor clone() const;
  // Copies `src` (same type and element count, any device) into this tensor's storage.
  void copy_from(const Tensor& src);

  // A copy on `device` in `type` (float32 <-> bfloat16 conversions round to nearest even). Returns
  // *this when nothing changes.
  Tensor to(Device device, ScalarType type) const;
  Tensor to(Device device) const { return to(device, type_); }

  // FP8 weights: the fp32 block scales, row-major [ceil(rows / 128), ceil(cols / 128)] for a matrix
  // (stacked experts: Checkpoint::take_experts), an undefined tensor otherwise. with_block_scales returns the same handle with them attached; to() moves them
  // along.
  const Tensor& block_scales() const;
  Tensor with_block_scales(Tensor scales) const;
  // Group-scaled weights (the MX / NV formats as released), one scale per group of a row's values, the
  // scales row-major beside the codes: FP4 codes (E2M1x2 [..., rows, cols] bytes) with F8E4M3 scales
  // [..., rows, 2 cols / 16] (NVFP4) and fp32 `global` scales, one per stored matrix (stacked experts:
  // kernels/cuda/moe/moe.h says which), or F8E8M0 scales [..., rows, 2 cols / 32] (MXFP4); MXFP8 codes
  // (F8E4M3 [..., rows, cols]) with F8E8M0 scales [..., rows, cols / 32]. `global` is undefined but for
  // NVFP4. block_scales() then returns the group scales.
  Tensor with_group_scales(Tensor groups, Tensor global) const;
  const Tensor& global_scales() const;

 private:
  void check_f32() const {
    if (type_ != ScalarType::F32 && data_ != nullptr) fail_not_f32();
  }
  [[noreturn]] void fail_not_f32() const;
  void* data_ = nullptr;
  Shape shape_;
  ScalarType type_ = ScalarType::F32;
  Device device_ = Device::Cpu;
  std::shared_ptr<void> storage_;
  std::shared_ptr<const Tensor> block_scales_;
  std::shared_ptr<const Tensor> global_scales_;
};

}  // namespace sparrow
