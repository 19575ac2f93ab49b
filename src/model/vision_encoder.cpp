#include "model/vision_encoder.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace sparrow {

Tensor attend_within_images(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                            const std::vector<int64_t>& rows_per_image) {
  const int64_t n = q.dim(0), width = q.dim(1), D = width / heads;
  SPARROW_CHECK(q.ndim() == 2 && k.shape() == q.shape() && v.shape() == q.shape() && width % heads == 0 &&
                    k.device() == q.device() && v.device() == q.device(),
                "vision attention: q, k and v must be [rows, heads * head_dim] on one device, got ",
                shape_str(q.shape()), ", ", shape_str(k.shape()), ", ", shape_str(v.shape()), " for ", heads, " heads");
  Tensor out = Tensor::empty({n, width}, q.type(), q.device());
  int64_t first = 0;
  for (const int64_t count : rows_per_image) {
    // Head h's scores [count, count] at scores[h]: q_h k_h^T, heads `D` columns apart in q and k.
    const Tensor scores = Tensor::empty({heads * count, count}, ScalarType::F32, q.device());
    ops::batched_matmul_nt(heads, count, count, D, {&q, first * width, width, D}, {&k, first * width, width, D}, scores,
                           0, count, count * count);
    const Tensor probs = ops::softmax_rows(scores, 1.0f / std::sqrt(float(D)));
    ops::batched_matmul_nn(heads, count, D, count, {&probs, 0, count, count * count}, {&v, first * width, width, D},
                           out, first * width, width, D);
    first += count;
  }
  SPARROW_CHECK(first == n, "vision attention: the images hold ", first, " rows, q has ", n);
  return out;
}

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
