#include "kernels/cpu/dsa_reference.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cpu/reference_ops.h"

namespace sparrow::cpu {

namespace {

// x -> e4m3(x / s) * s with s = amax / 448: one FP8 vector with its scale, as the GPU quantises each
// (token, head) index query (kernels/cuda/dsa_indexer).
void round_like_fp8(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / kE4m3Max;
  for (int64_t i = 0; i < n; ++i) x[i] = scale > 0.0f ? e4m3_to_float(float_to_e4m3(x[i] / scale)) * scale : 0.0f;
}

// The GPU scores MXFP4 keys on the FP8 tensor cores (kernels/cuda/dsa_indexer/fp4_keys.cuh): a key's values
// are stored as e4m3(v / 2^(eref - 127)), eref = max(emax, 7) - 6 with emax the largest of its E8M0 block
// exponents, and 2^(eref - 127) multiplies the key's score. That is exact for every block within 14
// binades of the key's largest (all keys the codec writes from LayerNorm'd rows); a block further below
// rounds to nearest even in e4m3, and this does the same to one decoded key of n values.
// emax comes from the decoded values: the encoder's block exponent is floor(log2(amax)) - 2 (OCP MX v1.0
// section 6.3), whose largest code is then 4 or 6, so the decoded block amax has the exponent e_b - 127 + 2;
// all-zero and clamped blocks (amax < 2^-125) have e_b = 0, below every other, and a key whose largest
// block is one of them gets eref = 1 either way.
void round_mxfp4_key_like_gpu(float* key, int64_t n) {
  constexpr int kMaxBlocks = 64;
  const int64_t blocks = fp4_num_blocks(n, kMxfp4Block);
  if (blocks > kMaxBlocks) return;  // wider than any model's index key
  int exponent[kMaxBlocks];  // E8M0 code of each block, -1 for an all-zero one
  int emax = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (int64_t i = b * kMxfp4Block; i < std::min<int64_t>(n, (b + 1) * kMxfp4Block); ++i) {
      if (std::isnan(key[i])) return;  // a NaN block: the key (and its score) is NaN on both devices
      amax = std::max(amax, std::fabs(key[i]));
    }
    exponent[b] = amax > 0.0f ? std::clamp(std::ilogb(amax) - 2 + 127, 0, 254) : -1;
    emax = std::max(emax, exponent[b]);
  }
  const int eref = std::max(emax, 7) - 6;
  for (int64_t b = 0; b < blocks; ++b) {
    if (exponent[b] < 0 || exponent[b] - eref >= -8) continue;  // zeros, or exact in e4m3: unchanged
    for (int64_t i = b * kMxfp4Block; i < std::min<int64_t>(n, (b + 1) * kMxfp4Block); ++i)
      key[i] = std::ldexp(e4m3_to_float(float_to_e4m3(std::ldexp(key[i], 127 - eref))), eref - 127);
  }
}

}  // namespace

std::vector<float> dsa_scores(const DsaShape& shape, const float* query, const float* head_weights,
                              const float* keys, int64_t n) {
  const int64_t heads = shape.heads, dim = shape.head_dim;
  const float scale = 1.0f / std::sqrt(float(dim));
  // Per-head logits [heads, n] = q · kᵀ, then relu(logit * scale) as DeepseekV32Indexer.forward.
  std::vector<float> per_head(heads * n);
  gemm_nt(heads, n, dim, query, dim, keys, dim, per_head.data(), n);
  for (float& s : per_head) s = std::max(s * scale, 0.0f);
  // Weighted sum over heads: [1, heads] · [heads, n].
  std::vector<float> total(n);
  gemm_nn(1, n, heads, head_weights, heads, per_head.data(), n, total.data(), n);
  return total;
}

void round_dsa_keys_like_gpu(float* keys, int64_t n, int64_t head_dim, DsaKeyRounding rounding) {
  if (rounding != DsaKeyRounding::Mxfp4) return;
  for (int64_t j = 0; j < n; ++j) round_mxfp4_key_like_gpu(keys + j * head_dim, head_dim);
}

std::vector<float> dsa_query_scores(const DsaShape& shape, const float* query, const float* head_weights,
                                    const float* keys, int64_t n, DsaKeyRounding rounding) {
  if (rounding == DsaKeyRounding::None) return dsa_scores(shape, query, head_weights, keys, n);
  std::vector<float> rounded(query, query + shape.heads * shape.head_dim);
  for (int64_t h = 0; h < shape.heads; ++h) round_like_fp8(rounded.data() + h * shape.head_dim, shape.head_dim);
  return dsa_scores(shape, rounded.data(), head_weights, keys, n);
}

void dsa_select(const DsaShape& shape, const float* queries, int64_t ld_queries, const float* head_weights,
                int64_t ld_weights, int64_t count, int64_t start, float* keys, DsaKeyRounding rounding,
                int32_t* selected, const float* exact_keys, int32_t* exact_selected) {
  const int64_t dim = shape.head_dim, k = shape.topk;
  SPARROW_CHECK(!exact_keys || start == 0, "dsa_select: exact keys are only those of a prefill from position 0");
  auto write = [&](int32_t* row, std::vector<int32_t> positions) {
    std::sort(positions.begin(), positions.end());
    std::fill(row, row + k, -1);
    std::copy(positions.begin(), positions.end(), row);
  };
  if (start + count > k) round_dsa_keys_like_gpu(keys, start + count, dim, rounding);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t visible = start + i + 1;
    int32_t* row = selected + i * k;
    if (visible <= k) {  // every visible key is selected: the causal prefix
      std::fill(row, row + k, -1);
      for (int64_t s = 0; s < visible; ++s) row[s] = int32_t(s);
      if (exact_selected) std::copy(row, row + k, exact_selected + i * k);
      continue;
    }
    const float* q = queries + i * ld_queries;
    const float* w = head_weights + i * ld_weights;
    std::vector<float> score = dsa_query_scores(shape, q, w, keys, visible, rounding);
    write(row, top_k(score.data(), visible, k));
    if (exact_keys) {
      std::vector<float> exact_score = dsa_scores(shape, q, w, exact_keys, visible);
      write(exact_selected + i * k, top_k(exact_score.data(), visible, k));
    }
  }
}

}  // namespace sparrow::cpu
