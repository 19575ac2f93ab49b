// apply_token_bitmask (sampling.h): one thread per 32 tokens of a masked row, so each thread reads one
// mask word and writes -inf over the tokens whose bits are clear. A grid of (word blocks, masked rows).
#include "core/device/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/sampling/sampling.h"

namespace sparrow::cuda {
namespace {

__global__ void token_bitmask_kernel(float* logits, int64_t ld, int64_t vocab, const int32_t* rows,
                                     const uint32_t* words, int64_t words_per_row) {
  const int64_t k = blockIdx.y;
  const int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w * 32 >= vocab) return;
  const uint32_t bits = words[k * words_per_row + w];
  if (bits == 0xFFFFFFFFu) return;
  float* row = logits + int64_t(rows[k]) * ld;
  const int64_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
  for (int64_t t = w * 32; t < end; ++t)
    if (!((bits >> (t & 31)) & 1u)) row[t] = -INFINITY;
}

}  // namespace

void apply_token_bitmask(float* logits, int64_t ld, int64_t vocab, const int32_t* rows, int64_t num_rows,
                         const uint32_t* words, int64_t words_per_row, cudaStream_t stream) {
  SPARROW_CHECK(vocab > 0 && ld >= vocab && num_rows >= 0 && num_rows <= 65535 && words_per_row * 32 >= vocab,
                "apply_token_bitmask: bad sizes vocab=", vocab, " ld=", ld, " rows=", num_rows,
                " words_per_row=", words_per_row);
  if (num_rows == 0) return;
  SPARROW_CHECK(logits && rows && words, "apply_token_bitmask: null pointer");
  const int64_t row_words = (vocab + 31) / 32;
  const dim3 grid(unsigned((row_words + 255) / 256), unsigned(num_rows));
  token_bitmask_kernel<<<grid, 256, 0, stream>>>(logits, ld, vocab, rows, words, words_per_row);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
