#include "kernels/cpu/mla_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

void mla_attention(const MlaShape& shape, const float* q_abs, int64_t count, int64_t start, const float* rows,
                   const int32_t* selected, int64_t topk, float* mixed) {
  const int64_t heads = shape.heads, latent = shape.latent, width = shape.row_width;
  std::vector<float> probs, gathered;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t visible = start + i + 1;
    const float* keys = rows;
    int64_t n = visible;
    if (selected) {
      const int32_t* list = selected + i * topk;
      const int64_t listed = std::find(list, list + topk, -1) - list;
      // A full list of a query that sees no more than topk keys is its causal prefix: read it in place.
      if (listed != visible) {
        n = listed;
        gathered.resize(n * width);
        for (int64_t j = 0; j < n; ++j)
          std::memcpy(gathered.data() + j * width, rows + list[j] * width, sizeof(float) * width);
        keys = gathered.data();
      }
    }
    probs.resize(heads * n);
    gemm_nt(heads, n, width, q_abs + i * heads * width, width, keys, width, probs.data(), n);
    for (int64_t h = 0; h < heads; ++h) {
      float* p = probs.data() + h * n;
      for (int64_t j = 0; j < n; ++j) p[j] *= shape.scale;
      softmax_inplace(p, n);
    }
    gemm_nn(heads, latent, n, probs.data(), n, keys, width, mixed + i * heads * latent, latent);
  }
}

void mla_attention_over(const MlaShape& shape, const float* q_abs, const float* keys, int64_t n, float* mixed,
                        float* lse) {
  const int64_t heads = shape.heads, latent = shape.latent, width = shape.row_width;
  if (n == 0) {
    std::fill(mixed, mixed + heads * latent, 0.0f);
    std::fill(lse, lse + heads, -INFINITY);
    return;
  }
  std::vector<float> probs(heads * n);
  gemm_nt(heads, n, width, q_abs, width, keys, width, probs.data(), n);
  for (int64_t h = 0; h < heads; ++h) {
    float* p = probs.data() + h * n;
    float top = -INFINITY;
    for (int64_t j = 0; j < n; ++j) top = std::max(top, p[j] *= shape.scale);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(p[j] - top);
    for (int64_t j = 0; j < n; ++j) p[j] = float(p[j] / sum);
    lse[h] = top + float(std::log(sum));
  }
  gemm_nn(heads, latent, n, probs.data(), n, keys, width, mixed, latent);
}

}  // namespace sparrow::cpu
