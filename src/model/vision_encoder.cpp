#include "model/vision_encoder.h"

#include <algorithm>

#include "core/error.h"
#include "model/model.h"

namespace sparrow {

void ImageRows::add(int64_t row, int64_t start, int64_t count, int64_t offset, const Tensor& embeddings) {
  SPARROW_CHECK(embeddings.on_cpu() && embeddings.type() == ScalarType::F32 && embeddings.ndim() == 2 &&
                    (width_ == 0 || embeddings.dim(1) == width_),
                "image rows: embeddings must be fp32 [tokens, hidden] on the host, got ", shape_str(embeddings.shape()));
  width_ = embeddings.dim(1);
  const int64_t first = std::max(start, offset), end = std::min(start + count, offset + embeddings.dim(0));
  for (int64_t p = first; p < end; ++p) {
    rows_.push_back(row + p - start);
    const float* values = embeddings.row(p - offset);
    values_.insert(values_.end(), values, values + width_);
  }
}

void ImageRows::attach_to(Batch& batch) {
  if (rows_.empty()) return;
  batch.embedded = Tensor::empty({int64_t(rows_.size()), width_});
  std::copy(values_.begin(), values_.end(), batch.embedded.data());
  batch.embedded_rows = std::move(rows_);
  rows_.clear();
  values_.clear();
}

}  // namespace sparrow
