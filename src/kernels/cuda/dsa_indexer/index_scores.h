// DeepSeek Sparse Attention (DSA) lightning indexer on Hopper: FP8 index keys in the paged cache,
// FP8 queries, index scores on the FP8 tensor cores.
//
//   score[t, s] = sum_h w[t, h] * relu(q[t, h] · k[s])            (src/model/dsa_indexer.cpp)
//
// The caller folds 1/sqrt(head_dim) and 1/sqrt(heads) into w. Keys are cached as e4m3 with one fp32
// scale per token (amax / 448), queries are quantised per (token, head) the same way and their scale
// is folded into w: relu(a * x) = a * relu(x) for a > 0, and the key scale factors out of the head sum,
// so the kernel computes   score = kscale[s] * sum_h (w[t,h] * qscale[t,h]) * relu(q8[t,h] · k8[s]).
//
// Paged cache (docs/cache.md, notes/helper_context.md): sequence `seq`'s token j lives in the page at
// byte offset page_table[seq * page_table_stride + j / block_size] of `pool`, slot j % block_size; a
// page of B tokens holds [B x 128 e4m3 values][B x fp32 scale] ("values then scales"). Page offsets must
// be multiples of 16 bytes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

enum class DsaDType { F32, BF16 };

inline constexpr int kDsaIndexDim = 128;      // index_head_dim of both models
inline constexpr int kDsaKeyPageBytes = 132;  // per token: 128 e4m3 values + one fp32 scale

// Quantises `count` keys (keys: [count, 128] fp32 or bf16, row-major) into their page rows: token i
// belongs to sequence token_seq[i] at position token_pos[i] (device arrays).
void dsa_write_keys(const void* keys, DsaDType type, int64_t count, const int32_t* token_seq,
                    const int32_t* token_pos, const int64_t* page_table, int64_t page_table_stride,
                    int block_size, uint8_t* pool, cudaStream_t stream);

// q: [rows, heads, 128] (fp32 or bf16), weights: [rows, heads] fp32 (constants already folded in).
// Writes q_fp8 [rows, heads, 128] e4m3 and w_folded [rows, heads] = weights * (amax(q[t,h]) / 448).
void dsa_quantize_queries(const void* q, DsaDType type, const float* weights, int64_t rows, int heads,
                          uint8_t* q_fp8, float* w_folded, cudaStream_t stream);

// Index scores. Query row r belongs to sequence row_seq[r] and sees its keys 0 .. row_visible[r]-1
// (the causal bound). Writes scores[r * ld + s] for s < max_visible: the score where s < row_visible[r],
// -inf after it. max_visible (host) must be >= every row_visible[r]; ld >= max_visible, ld even.
// heads: 32 or 64. Two kernels, chosen by `kernel` (Auto: Wgmma up to kDsaWgmmaMaxRows rows, else Tiles):
//   Wgmma (decode_scores.cu): one query row per CTA over a range of its keys, on the FP8 wgmma tensor
//     cores, keys streamed through a cp.async pipeline: for decode batches (a row per sequence, or two
//     with speculative verification);
//   Tiles (this file): rows of a CTA share each key tile through L1, e4m3 mma.sync: for prefill (many
//     consecutive rows of one sequence).
// rows_per_sequence: a hint for the wgmma kernel that requests bring that many consecutive rows each (2:
// speculative verification), so that pairs of rows share their key reads; any value gives the same scores.
enum class DsaScoreKernel { Auto, Tiles, Wgmma };
inline constexpr int64_t kDsaWgmmaMaxRows = 256;
void dsa_index_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads,
                      const int32_t* row_seq, const int32_t* row_visible, const uint8_t* pool,
                      const int64_t* page_table, int64_t page_table_stride, int block_size, float* scores,
                      int64_t ld, int64_t max_visible, cudaStream_t stream,
                      DsaScoreKernel kernel = DsaScoreKernel::Auto, int rows_per_sequence = 1);

// x -> e4m3 with __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), n values (for tests of the CPU
// codec in kernels/cpu/fp8.h).
void fp8_e4m3_encode(const float* x, int64_t n, uint8_t* out, cudaStream_t stream);

}  // namespace sparrow::cuda
