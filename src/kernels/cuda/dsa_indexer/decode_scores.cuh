// The wgmma index-score kernels (decode_scores.cu: FP8 keys, decode-sized batches; decode_scores_fp4.cu:
// MXFP4 and NVFP4 keys, every row count); index_scores.cu's dsa_index_scores chooses them. Same arguments
// and contract as dsa_index_scores (index_scores.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa_indexer/index_scores.h"

namespace sparrow::cuda {

// What every index-score kernel reads (the dsa_index_scores contract, index_scores.h); each kernel's
// parameters add their own grid split to it.
struct IndexScoreArgs {
  const uint8_t* q;  // [rows, heads, 128] e4m3
  const float* w;    // [rows, heads], the head weights with the softmax scale folded in
  int64_t rows;
  const int32_t* row_seq;      // [rows]
  const int32_t* row_visible;  // [rows] keys each row sees
  const uint8_t* pool;
  const int64_t* page_table;  // [sequences, stride] byte offsets into pool
  int64_t stride;
  int block_size;
  float* scores;  // [rows, ld]
  int64_t ld;
  int64_t max_visible;
};

bool dsa_decode_scores_supported(int heads);

// Any key format (4-bit formats go to dsa_decode_scores_fp4).
void dsa_decode_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads, const int32_t* row_seq,
                       const int32_t* row_visible, const uint8_t* pool, const int64_t* page_table,
                       int64_t page_table_stride, int block_size, PageFormat format, float* scores, int64_t ld,
                       int64_t max_visible, int rows_per_sequence, int sms, cudaStream_t stream);

void dsa_decode_scores_fp4(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads,
                           const int32_t* row_seq, const int32_t* row_visible, const uint8_t* pool,
                           const int64_t* page_table, int64_t page_table_stride, int block_size,
                           PageFormat format, float* scores, int64_t ld, int64_t max_visible,
                           int rows_per_sequence, int sms, cudaStream_t stream);

}  // namespace sparrow::cuda
