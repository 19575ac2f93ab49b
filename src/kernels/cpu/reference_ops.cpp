#include "kernels/cpu/reference_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/stored_weights.h"

namespace sparrow::cpu {
namespace {
// OpenBLAS takes every core unless told otherwise; it gets the pool's threads (SPARROW_NUM_THREADS, or a
// share of the cores for each rank of a tensor-parallel run on one machine), so that ranks do not contend.
void size_blas_threads() {
  static const bool sized = (openblas_set_num_threads(num_threads()), true);
  (void)sized;
}

// Products are batch-invariant by construction: a row's result must not depend on how many rows share
// its call (a request's tokens are the same alone or in a batch of 64: tests/server/test_concurrency.py).
// BLAS libraries do not promise that: OpenBLAS picks its kernels, remainder paths and small-matrix code
// by the call's shape and by the CPU. So every call here has exactly kRowTile rows; a last partial tile
// runs on a zero-padded copy. Each row then meets the same kernel in every batch, on any CPU.
constexpr int64_t kRowTile = 8;

using Sgemm = void (*)(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, float beta);

void in_row_tiles(Sgemm tile_product, int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w,
                  int64_t ldw, float* y, int64_t ldy, float beta) {
  if (m == 0 || n == 0) return;
  size_blas_threads();
  int64_t full = m / kRowTile * kRowTile;
  for (int64_t r = 0; r < full; r += kRowTile) tile_product(kRowTile, n, k, x + r * ldx, ldx, w, ldw, y + r * ldy, ldy, beta);
  if (full == m) return;
  int64_t rest = m - full;
  std::vector<float> x_tile(kRowTile * k, 0.0f), y_tile(kRowTile * n, 0.0f);
  for (int64_t r = 0; r < rest; ++r) {
    std::copy_n(x + (full + r) * ldx, k, x_tile.data() + r * k);
    if (beta != 0.0f) std::copy_n(y + (full + r) * ldy, n, y_tile.data() + r * n);
  }
  tile_product(kRowTile, n, k, x_tile.data(), k, w, ldw, y_tile.data(), n, beta);
  for (int64_t r = 0; r < rest; ++r) std::copy_n(y_tile.data() + r * n, n, y + (full + r) * ldy);
}
}  // namespace

void gemm_nt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
             int64_t ldy, float beta) {
  in_row_tiles([](int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                  int64_t ldy, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, ldx, w, ldw, beta, y, ldy);
  }, m, n, k, x, ldx, w, ldw, y, ldy, beta);
}

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
             int64_t ldy, float beta) {
  in_row_tiles([](int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                  int64_t ldy, float beta) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, x, ldx, w, ldw, beta, y, ldy);
  }, m, n, k, x, ldx, w, ldw, y, ldy, beta);
}

void linear_into(const Tensor& x, const Tensor& w, Tensor& y) {
  SPARROW_CHECK(w.ndim() == 2, "linear: weight must be 2-D, got ", shape_str(w.shape()));
  int64_t in = stored_cols(w), out = w.dim(0);
  SPARROW_CHECK(x.numel() % in == 0, "linear: input ", shape_str(x.shape()), " does not match weight ",
                shape_str(w.shape()));
  int64_t m = x.numel() / in;
  SPARROW_CHECK(y.numel() == m * out, "linear: output size mismatch");
  std::vector<float> widened;  // the weight in fp32 when it is stored otherwise (stored_weights.h)
  gemm_nt(m, out, in, x.data(), in, widened_matrix(w, 0, widened), in, y.data(), out);
}

Tensor linear(const Tensor& x, const Tensor& w) {
  int64_t in = stored_cols(w);
  Tensor y = Tensor::empty({x.numel() / in, w.dim(0)});
  linear_into(x, w, y);
  return y;
}

void rms_normalize(float* x, int64_t n, float eps) {
  double ss = 0;  // accumulate in double: the reference sums n fp32 squares; this is at least as exact
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  float inv = 1.0f / std::sqrt(float(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void rms_norm_inplace(Tensor& x, const Tensor& w, float eps, bool unit_offset) {
  int64_t d = w.numel();
  SPARROW_CHECK(d > 0 && x.numel() % d == 0, "rms_norm: ", shape_str(x.shape()), " not divisible by ", d);
  int64_t groups = x.numel() / d;
  float* p = x.data();
  const float* wp = w.data();
  parallel_for(groups, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      float* r = p + g * d;
      rms_normalize(r, d, eps);
      for (int64_t i = 0; i < d; ++i) r[i] *= unit_offset ? 1.0f + wp[i] : wp[i];
    }
  });
}

Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool unit_offset) {
  Tensor y = x.clone();
  rms_norm_inplace(y, w, eps, unit_offset);
  return y;
}

Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
  int64_t d = w.numel();
  SPARROW_CHECK(d > 0 && x.numel() % d == 0, "layer_norm: size mismatch");
  Tensor y = Tensor::empty(x.shape());
  for (int64_t g = 0; g < x.numel() / d; ++g) {
    const float* r = x.data() + g * d;
    float* o = y.data() + g * d;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mean += r[i];
    mean /= d;
    for (int64_t i = 0; i < d; ++i) var += (r[i] - mean) * (r[i] - mean);
    var /= d;
    float inv = 1.0f / std::sqrt(float(var) + eps);
    for (int64_t i = 0; i < d; ++i) o[i] = float(r[i] - mean) * inv * w.data()[i] + b.data()[i];
  }
  return y;
}

void glu(Glu kind, const float* gate, const float* up, float* out, int64_t n, float alpha, float limit) {
  switch (kind) {
    case Glu::SiluGlu:
      for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
      return;
    case Glu::ClampedSwiglu:
      for (int64_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
        out[i] = (u + 1.0f) * (g * sigmoid(g * alpha));
      }
      return;
    case Glu::Situ:
      for (int64_t i = 0; i < n; ++i) {
        const float u = limit > 0.0f ? limit * std::tanh(up[i] / limit) : up[i];
        out[i] = alpha * std::tanh(gate[i] / alpha) * sigmoid(gate[i]) * u;
      }
      return;
  }
}

void attn_res_mix(std::span<const float* const> sources, const float* norm, const float* proj, float eps, float* out,
                  int64_t rows, int64_t width) {
  SPARROW_CHECK(!sources.empty(), "attn_res_mix: no sources");
  std::vector<float> weight(sources.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < sources.size(); ++i) {
      const float* v = sources[i] + r * width;
      double dot = 0, ss = 0;
      for (int64_t c = 0; c < width; ++c) {
        dot += double(v[c]) * double(norm[c] * proj[c]);
        ss += double(v[c]) * v[c];
      }
      weight[i] = float(dot / std::sqrt(ss / double(width) + double(eps)));
    }
    softmax_inplace(weight.data(), int64_t(weight.size()));
    float* o = out + r * width;
    for (int64_t c = 0; c < width; ++c) {
      float acc = 0.0f;
      for (size_t i = 0; i < sources.size(); ++i) acc += weight[i] * sources[i][r * width + c];
      o[c] = acc;
    }
  }
}

void softmax_inplace(float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  if (mx == -std::numeric_limits<float>::infinity()) {
    std::fill(x, x + n, 0.0f);
    return;
  }
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

std::vector<int32_t> top_k(const float* scores, int64_t n, int64_t k) {
  k = std::min(k, n);
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [scores](int32_t a, int32_t b) {
    float sa = scores[a], sb = scores[b];
    // NaN ranks last; ties go to the smaller index.
    bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return a < b;
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(k);
  return idx;
}

Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids) {
  int64_t vocab = table.dim(0), d = table.dim(1);
  Tensor out = Tensor::empty({int64_t(ids.size()), d});
  for (size_t i = 0; i < ids.size(); ++i) {
    SPARROW_CHECK(ids[i] >= 0 && ids[i] < vocab, "token id ", ids[i], " out of range [0, ", vocab, ")");
    std::memcpy(out.row(i), table.row(ids[i]), sizeof(float) * d);
  }
  return out;
}

void add_inplace(Tensor& y, const Tensor& x) {
  SPARROW_CHECK(y.numel() == x.numel(), "add: size mismatch ", shape_str(y.shape()), " vs ", shape_str(x.shape()));
  float* p = y.data();
  const float* q = x.data();
  for (int64_t i = 0; i < y.numel(); ++i) p[i] += q[i];
}

void apply_rope_neox(float* x, const float* cos, const float* sin, int rot_dim) {
  int half = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

void apply_rope_neox_narrow_head(float* x, const float* cos, const float* sin, int head_dim, int rot_dim) {
  const int half = head_dim / 2, frequencies = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    const int fa = i % frequencies, fb = (i + half) % frequencies;
    x[i] = a * cos[fa] - b * sin[fa];           // rotate_half(x)[i] = -x[i + half]
    x[i + half] = b * cos[fb] + a * sin[fb];    // rotate_half(x)[i + half] = x[i]
  }
}

void apply_rope_interleaved(float* x, const float* cos, const float* sin, int rot_dim) {
  int half = rot_dim / 2;
  float tmp[1024];
  SPARROW_CHECK(rot_dim <= 1024, "rotary dimension ", rot_dim, " too large");
  for (int i = 0; i < half; ++i) {
    float a = x[2 * i], b = x[2 * i + 1];
    tmp[i] = a * cos[i] - b * sin[i];
    tmp[i + half] = b * cos[i] + a * sin[i];
  }
  for (int i = 0; i < rot_dim; ++i) x[i] = tmp[i];
}

}  // namespace sparrow::cpu
