// Token choice on the GPU: greedy (argmax_rows) and the full draw of kernels/sampling_rule.h (temperature,
// top-k, min-p, top-p, Gumbel-max with a per-row key), giving the CPU reference's token
// (kernels/cpu/reference_sampling.h), so that only the chosen ids cross to the host. sampling.cu says how.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/sampling_rule.h"

namespace sparrow::cuda {

// ids[r] = argmax_v logits[r, v] (ties to the smaller id, NaN last, as the CPU sampler).
void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids, cudaStream_t stream);

// Applies adjustments[0 .. count) (device array) in place, as cpu::adjust_logits: entry a changes
// logits[a.row * ld + a.token] with the same fp32 operations in the same order. Entries whose token is
// outside [0, vocab) or whose row is negative are ignored. Preconditions: the (row, token) pairs are
// distinct (entries run in parallel), and every row is a row of the logits array.
void adjust_logits(float* logits, int64_t ld, const LogitAdjustment* adjustments, int64_t count, int64_t vocab,
                   cudaStream_t stream);

// Token bitmasks (kernels/sampling_rule.h): for k < num_rows, every token t < vocab of row rows[k] whose bit
// in words[k * words_per_row ..] is clear gets logit -inf. rows, words: device arrays; words_per_row >=
// ceil(vocab / 32). token_bitmask.cu.
void apply_token_bitmask(float* logits, int64_t ld, int64_t vocab, const int32_t* rows, int64_t num_rows,
                         const uint32_t* words, int64_t words_per_row, cudaStream_t stream);

// tokens[r] = the token drawn from row r of logits ([rows, ld] fp32, the first `vocab` of each row) with
// draws[r] (device arrays), exactly as cpu::draw_token: the same fp32 scaling, the same double weights
// and Gumbel keys, the same order and ties. Only where a cumulative weight of the top-p step lands
// within floating-point rounding of its threshold may the kept prefix differ (the sums run in another
// order). vocab < 2^31; no workspace; one launch.
void draw_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t ld, const TokenDraw* draws,
                 int32_t* tokens, cudaStream_t stream);

}  // namespace sparrow::cuda
