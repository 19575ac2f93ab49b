#include "model/vision_encoder.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/reference_ops.h"
#include "model/model.h"

namespace sparrow {

Tensor attend_within_images(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                            const std::vector<int64_t>& rows_per_image) {
  const int64_t n = q.dim(0), width = q.dim(1), D = width / heads;
  SPARROW_CHECK(q.on_cpu() && k.on_cpu() && v.on_cpu() && k.shape() == q.shape() && v.shape() == q.shape() &&
                    width % heads == 0,
                "vision attention: q, k and v must be [rows, heads * head_dim] on the host, got ",
                shape_str(q.shape()), ", ", shape_str(k.shape()), ", ", shape_str(v.shape()), " for ", heads, " heads");
  Tensor out = Tensor::zeros({n, width});
  const float scale = 1.0f / std::sqrt(float(D));
  int64_t first = 0;
  for (const int64_t count : rows_per_image) {
    std::vector<float> logits(size_t(count * count));
    for (int64_t h = 0; h < heads; ++h) {
      cpu::gemm_nt(count, count, D, q.row(first) + h * D, width, k.row(first) + h * D, width, logits.data(), count);
      for (int64_t i = 0; i < count; ++i) {
        float* l = logits.data() + i * count;
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < count; ++j) top = std::max(top, l[j] * scale);
        for (int64_t j = 0; j < count; ++j) total += (l[j] = std::exp(l[j] * scale - top));
        for (int64_t j = 0; j < count; ++j) l[j] /= total;
      }
      cpu::gemm_nn(count, D, count, logits.data(), count, v.row(first) + h * D, width, out.row(first) + h * D, width);
    }
    first += count;
  }
  SPARROW_CHECK(first == n, "vision attention: the images hold ", first, " rows, q has ", n);
  return out;
}

void gelu_(Tensor& x, bool tanh_form) {
  float* p = x.data();
  if (tanh_form) {
    // torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
    for (int64_t i = 0; i < x.numel(); ++i)
      p[i] = 0.5f * p[i] * (1.0f + std::tanh(0.7978845608028654f * (p[i] + 0.044715f * p[i] * p[i] * p[i])));
  } else {
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = 0.5f * p[i] * (1.0f + std::erf(p[i] * 0.70710678118654752f));
  }
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
