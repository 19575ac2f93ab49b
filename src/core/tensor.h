// A dense, row-major float32 tensor on the host: the CPU reference path computes everything in fp32.
// A Tensor either owns its storage or views storage kept alive by someone else (a memory-mapped
// checkpoint, a larger tensor); copying a Tensor copies the handle, not the data.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sparrow {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);  // "[4, 128]"
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(Shape shape);
  static Tensor zeros(Shape shape);
  // A view of memory owned elsewhere; `keep_alive` (may be null) holds that memory.
  static Tensor view(float* data, Shape shape, std::shared_ptr<void> keep_alive = nullptr);

  float* data() { return data_; }
  const float* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int64_t numel() const { return shape_numel(shape_); }
  bool defined() const { return data_ != nullptr || numel() == 0; }

  // Same storage, new shape (element counts must match).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const;
  // Pointer to row i along the first dimension.
  float* row(int64_t i) { return data_ + i * row_size(); }
  const float* row(int64_t i) const { return data_ + i * row_size(); }
  int64_t row_size() const { return shape_.empty() ? 1 : numel() / shape_[0]; }
  Tensor clone() const;

 private:
  float* data_ = nullptr;
  Shape shape_;
  std::shared_ptr<void> storage_;
};

}  // namespace sparrow
