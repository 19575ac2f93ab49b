#include "core/tensor.h"

#include <cstring>

#include "core/error.h"

namespace sparrow {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor Tensor::empty(Shape shape) {
  Tensor t;
  int64_t n = shape_numel(shape);
  SPARROW_CHECK(n >= 0, "tensor with negative size ", shape_str(shape));
  auto storage = std::shared_ptr<float[]>(new float[n > 0 ? n : 1]);
  t.data_ = storage.get();
  t.storage_ = std::shared_ptr<void>(storage, storage.get());
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::zeros(Shape shape) {
  Tensor t = empty(std::move(shape));
  std::memset(t.data_, 0, sizeof(float) * t.numel());
  return t;
}

Tensor Tensor::view(float* data, Shape shape, std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.storage_ = std::move(keep_alive);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  SPARROW_CHECK(shape_numel(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  SPARROW_CHECK(!shape_.empty() && begin >= 0 && begin <= end && end <= shape_[0], "rows [", begin, ", ", end,
                ") out of range for ", shape_str(shape_));
  Tensor t = *this;
  t.data_ = data_ + begin * row_size();
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_);
  if (numel() > 0) std::memcpy(t.data_, data_, sizeof(float) * numel());
  return t;
}

}  // namespace sparrow
