#include "kernels/cpu/kda_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

namespace {

// transformers' kimi_linear l2norm (matching fla): x / sqrt(sum(x^2) + eps), eps added, not clamped.
void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// softplus as KimiLinearForgetGate writes it: x above 20, else log(1 + exp(x)).
float softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

}  // namespace

void kda_gates(const float* f, const float* dt_bias, const float* A_log, const float* b, float* g, float* beta,
               int64_t rows, int64_t heads, int64_t head_dim, float lower_bound) {
  const int64_t P = heads * head_dim;
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < P; ++c) {
        const float a = std::exp(A_log[c / head_dim]), s = f[t * P + c] + dt_bias[c];
        g[t * P + c] = lower_bound < 0.0f ? lower_bound * sigmoid(a * s) : -a * softplus(s);
      }
      for (int64_t h = 0; h < heads; ++h) beta[t * heads + h] = sigmoid(b[t * heads + h]);
    }
  });
}

void kda_short_conv(const float* history, const float* weight, int64_t kernel, int64_t count, int64_t heads,
                    int64_t head_dim, float* q, float* k, float* v, int64_t ld) {
  const int64_t P = heads * head_dim;
  const float q_scale = float(1.0 / std::sqrt(double(head_dim)));
  parallel_for(count, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* dst[3] = {q + i * ld, k + i * ld, v + i * ld};
      for (int64_t c = 0; c < 3 * P; ++c) {
        const float* taps = weight + c * kernel;
        float sum = 0.0f;
        for (int64_t j = 0; j < kernel; ++j) sum += taps[j] * history[(i + j) * 3 * P + c];
        dst[c / P][c % P] = silu(sum);
      }
      for (int64_t h = 0; h < heads; ++h) {
        l2_normalize(dst[0] + h * head_dim, head_dim, q_scale);
        l2_normalize(dst[1] + h * head_dim, head_dim, 1.0f);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The delta rule, token by token (transformers recurrent_kimi_delta_attention). Per head, per token:
//   S *= exp(g) (row k scaled by exp(g[k]));  u = beta (v - S^T k);  S += k u^T;  o = S^T q.
void delta_rule_recurrent(const DeltaRuleInputs& in, float* state, float* out) {
  const int64_t T = in.length, H = in.num_heads, D = in.head_dim;
  parallel_for(H, [&](int64_t head_begin, int64_t head_end) {
    std::vector<float> update(D);
    for (int64_t h = head_begin; h < head_end; ++h) {
      float* S = state + h * D * D;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (t * H + h) * D;
        const float *q = in.q + at, *k = in.k + at, *v = in.v + at, *g = in.log_decay + at;
        const float beta = in.beta[t * H + h];
        for (int64_t i = 0; i < D; ++i) {
          const float decay = std::exp(g[i]);
          for (int64_t j = 0; j < D; ++j) S[i * D + j] *= decay;
        }
        // update = beta * (v - S^T k)
        std::fill(update.begin(), update.end(), 0.0f);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) update[j] += k[i] * S[i * D + j];
        for (int64_t j = 0; j < D; ++j) update[j] = (v[j] - update[j]) * beta;
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) S[i * D + j] += k[i] * update[j];
        float* o = out + at;
        std::fill(o, o + D, 0.0f);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) o[j] += q[i] * S[i * D + j];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The delta rule, chunk-parallel (transformers chunk_kimi_delta_attention, the fla formulation).
// Within a chunk of n <= C tokens starting from state S, with G[r] = g[0] + ... + g[r] (per key
// channel) and decay(r, i) = exp(G[r] - G[i]) for i <= r:
//   A[r][i]   = -beta[r] * sum_d k[r][d] k[i][d] decay(r, i)[d]      (i < r, else 0)
//   T         = (I - A)^-1 by forward substitution, the rows of A rewritten in place
//   U         = T (beta * V),   W = T (beta * exp(G) * K)
//   Vn        = U - W S                          (the "new values" after the state's prediction)
//   Aqk[r][i] = sum_d q[r][d] k[i][d] decay(r, i)[d]                 (i <= r)
//   O         = (exp(G) * Q) S + Aqk Vn
//   S        <- exp(G[n-1]) * S + (exp(G[n-1] - G) * K)^T Vn
// Every exponent is a difference G[r] - G[i] with i <= r (or G[r] itself), so it is <= 0: the
// decays are computed directly and never as exp(G) * exp(-G), which would overflow. G is summed in
// double: with strong decays (Kimi K3's reach -5 a token) it runs to -100 and beyond within a chunk, where
// an fp32 running sum's rounding would put ~1e-5 relative error into every decay exp(G[r] - G[i]).
// A ragged last chunk is handled as is: transformers pads it with k = v = beta = g = 0 rows, which
// contribute nothing.
void delta_rule_chunked(const DeltaRuleInputs& in, float* state, float* out, int64_t chunk_size) {
  const int64_t T = in.length, H = in.num_heads, D = in.head_dim, C = chunk_size;
  SPARROW_CHECK(C > 0, "delta rule: chunk size must be positive");
  parallel_for(H, [&](int64_t head_begin, int64_t head_end) {
    // Per-chunk scratch, row-major: [C, D] and [C, C].
    std::vector<float> Q(C * D), K(C * D), V(C * D), beta(C);
    std::vector<double> G(C * D);
    std::vector<float> A(C * C), Aqk(C * C), row(C), KbG(C * D), U(C * D), W(C * D), Vn(C * D), last_decay(D);
    for (int64_t h = head_begin; h < head_end; ++h) {
      float* S = state + h * D * D;
      for (int64_t c0 = 0; c0 < T; c0 += C) {
        const int64_t n = std::min(C, T - c0);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t at = ((c0 + r) * H + h) * D;
          std::memcpy(&Q[r * D], in.q + at, sizeof(float) * D);
          std::memcpy(&K[r * D], in.k + at, sizeof(float) * D);
          std::memcpy(&V[r * D], in.v + at, sizeof(float) * D);
          for (int64_t d = 0; d < D; ++d) G[r * D + d] = (r ? G[(r - 1) * D + d] : 0.0) + in.log_decay[at + d];
          beta[r] = in.beta[(c0 + r) * H + h];
        }

        // A (strictly lower) and Aqk (lower, diagonal included) share the pairwise decays.
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t i = 0; i <= r; ++i) {
            float kk = 0.0f, qk = 0.0f;
            for (int64_t d = 0; d < D; ++d) {
              const float decay = std::exp(float(G[r * D + d] - G[i * D + d]));
              kk += K[r * D + d] * beta[r] * K[i * D + d] * decay;
              qk += Q[r * D + d] * K[i * D + d] * decay;
            }
            A[r * C + i] = i < r ? -kk : 0.0f;
            Aqk[r * C + i] = qk;
          }
        }
        // Forward substitution, row by row, each row using the rows above as already rewritten:
        // A[r][j] += sum_{j<m<r} A[r][m] A[m][j]; then T = A + I.
        for (int64_t r = 1; r < n; ++r) {
          for (int64_t j = 0; j < r; ++j) row[j] = A[r * C + j];
          for (int64_t j = 0; j < r; ++j) {
            float sum = row[j];
            for (int64_t m = j + 1; m < r; ++m) sum += row[m] * A[m * C + j];
            A[r * C + j] = sum;
          }
        }
        for (int64_t r = 0; r < n; ++r) A[r * C + r] = 1.0f;

        // U = T (beta V), W = T (beta exp(G) K); V and K are rescaled in place, no longer needed as they were.
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t d = 0; d < D; ++d) {
            V[i * D + d] *= beta[i];
            KbG[i * D + d] = K[i * D + d] * beta[i] * std::exp(float(G[i * D + d]));
          }
        }
        for (int64_t r = 0; r < n; ++r) {
          float* u = &U[r * D];
          float* w = &W[r * D];
          std::fill(u, u + D, 0.0f);
          std::fill(w, w + D, 0.0f);
          for (int64_t i = 0; i <= r; ++i) {
            const float t = A[r * C + i];
            for (int64_t d = 0; d < D; ++d) {
              u[d] += t * V[i * D + d];
              w[d] += t * KbG[i * D + d];
            }
          }
        }
        // Vn = U - W S
        for (int64_t r = 0; r < n; ++r) {
          float* vn = &Vn[r * D];
          std::fill(vn, vn + D, 0.0f);
          for (int64_t i = 0; i < D; ++i) {
            const float w = W[r * D + i];
            for (int64_t j = 0; j < D; ++j) vn[j] += w * S[i * D + j];
          }
          for (int64_t j = 0; j < D; ++j) vn[j] = U[r * D + j] - vn[j];
        }
        // O = (exp(G) Q) S + Aqk Vn
        for (int64_t r = 0; r < n; ++r) {
          float* o = out + ((c0 + r) * H + h) * D;
          std::fill(o, o + D, 0.0f);
          for (int64_t i = 0; i < D; ++i) {
            const float qd = Q[r * D + i] * std::exp(float(G[r * D + i]));
            for (int64_t j = 0; j < D; ++j) o[j] += qd * S[i * D + j];
          }
          for (int64_t i = 0; i <= r; ++i) {
            const float a = Aqk[r * C + i];
            for (int64_t j = 0; j < D; ++j) o[j] += a * Vn[i * D + j];
          }
        }
        // S <- exp(G[n-1]) S + (exp(G[n-1] - G) K)^T Vn
        const double* G_last = &G[(n - 1) * D];
        for (int64_t i = 0; i < D; ++i) last_decay[i] = std::exp(float(G_last[i]));
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) S[i * D + j] *= last_decay[i];
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t i = 0; i < D; ++i) {
            const float kd = K[r * D + i] * std::exp(float(G_last[i] - G[r * D + i]));
            for (int64_t j = 0; j < D; ++j) S[i * D + j] += kd * Vn[r * D + j];
          }
        }
      }
    }
  });
}

void kda_gated_rms_norm(Tensor& o, const Tensor& gate, const Tensor& weight, float eps) {
  rms_norm_inplace(o, weight, eps);
  const int64_t rows = o.dim(0), width = o.row_size();
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < width; ++c) o.row(t)[c] *= sigmoid(gate.row(t)[c]);
  });
}

}  // namespace sparrow::cpu
