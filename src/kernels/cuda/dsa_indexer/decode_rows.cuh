// The query rows of one decode-scores CTA, shared by both wgmma index-score kernels (decode_scores.cu: FP8
// keys; decode_scores_fp4.cu: MXFP4 / NVFP4 keys). ROWS consecutive rows share a CTA so that each key tile
// is read once for all of them when they are one request's tokens (speculative verification, prefill);
// rows of different sequences in one CTA are scored one sequence after the other, a pass per sequence.
// The row arrays stay the kernel's own locals (passed by reference): inside a struct, the query copy's
// runtime row index would send the whole struct to local memory. Device code only: include from .cu files.
#pragma once
#include <cstdint>

namespace sparrow::cuda::dsa {

// Row r of the CTA (row0 + r): whether it exists, its sequence (-1 if not) and the keys it may see (0).
template <int ROWS>
__device__ __forceinline__ void load_rows(int64_t row0, int64_t rows, const int32_t* row_seq,
                                          const int32_t* row_visible, bool (&valid)[ROWS], int (&seq)[ROWS],
                                          int64_t (&visible)[ROWS]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    valid[r] = row0 + r < rows;
    seq[r] = valid[r] ? row_seq[row0 + r] : -1;
    visible[r] = valid[r] ? row_visible[row0 + r] : 0;
  }
}

// This thread's head weights for D's columns 8j + 2q + {0, 1} (q = lane % 4), j < N / 8 with N = HEADS x
// ROWS: column n is head n % HEADS of row n / HEADS; an invalid row's weigh nothing.
template <int HEADS, int ROWS>
__device__ __forceinline__ void head_weights(const bool (&valid)[ROWS], const float* w, int64_t row0, int q,
                                             float (&w0)[HEADS * ROWS / 8], float (&w1)[HEADS * ROWS / 8]) {
#pragma unroll
  for (int j = 0; j < HEADS * ROWS / 8; ++j) {
    const int n = 8 * j + 2 * q, r = n / HEADS;
    w0[j] = valid[r] ? w[(row0 + r) * HEADS + n % HEADS] : 0.0f;
    w1[j] = valid[r] ? w[(row0 + r) * HEADS + n % HEADS + 1] : 0.0f;
  }
}

// Pass `pass` scores the rows of one sequence: the first valid row no earlier pass scored, and every row of
// its sequence (`active`). Keys in [k_begin, k_end) at or past an active row's bound are -inf, written here
// by the CTA's `threads` threads without reading them; `k_scored` is where the keys any active row sees end.
// False when there is nothing to score: the row was an earlier pass's, or no active row sees a key of the
// range.
template <int ROWS>
__device__ __forceinline__ bool begin_pass(int pass, const bool (&valid)[ROWS], const int (&seq)[ROWS],
                                           const int64_t (&visible)[ROWS], int64_t k_begin, int64_t k_end,
                                           int64_t row0, float* scores, int64_t ld, int tid, int threads,
                                           bool (&active)[ROWS], int64_t& k_scored) {
  bool first_of_seq = valid[pass];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
    if (r < pass && seq[r] == seq[pass]) first_of_seq = false;
  if (!first_of_seq) return false;
  const int pass_seq = seq[pass];
  k_scored = k_begin;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    active[r] = valid[r] && seq[r] == pass_seq;
    if (active[r]) k_scored = max(k_scored, min(k_end, visible[r]));
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (!active[r]) continue;
    float* out = scores + (row0 + r) * ld;
    for (int64_t s = max(k_begin, min(k_end, visible[r])) + tid; s < k_end; s += threads) out[s] = -INFINITY;
  }
  return k_scored > k_begin;
}

}  // namespace sparrow::cuda::dsa
