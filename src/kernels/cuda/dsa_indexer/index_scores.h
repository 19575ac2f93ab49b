// DeepSeek Sparse Attention (DSA) lightning indexer on Hopper: index keys in the paged cache (FP8, MXFP4
// or NVFP4), FP8 queries, index scores on the tensor cores.
//
//   score[t, s] = sum_h w[t, h] * relu(q[t, h] · k[s])            (src/kernels/cpu/dsa_reference.cpp)
//
// The caller folds 1/sqrt(head_dim) and 1/sqrt(heads) into w. Queries are quantised per (token, head) to
// e4m3 with one fp32 scale amax / 448, folded into w (relu(a * x) = a * relu(x) for a > 0); a key's own
// factor (FP8: its fp32 scale; MXFP4: a power of two, fp4_keys.cuh) factors out of the head sum, so the
// kernels compute   score = kfactor[s] * sum_h (w[t,h] * qscale[t,h]) * relu(q8[t,h] · k[s]).
//
// Paged cache (docs/cache.md, notes/helper_context.md): sequence `seq`'s token j lives in the page at
// byte offset page_table[seq * page_table_stride + j / block_size] of `pool`, slot j % block_size. A page
// of B tokens holds, by key format ("values then scales", so a key's values are one aligned line):
//   Fp8   (PageFormat::Fp8IndexKey, 132 B): [B x 128 e4m3][B x fp32 scale], scale = amax / 448;
//   Mxfp4 (PageFormat::Mxfp4Rows, 68 B):    [B x 64 B of e2m1 codes][B x 4 E8M0 scales, one per 32 values];
//   Nvfp4 (PageFormat::Nvfp4Rows, 72 B):    [B x 64 B of e2m1 codes][B x 8 E4M3 scales, one per 16 values],
//                                           second-level scale 1.0 (kKvTensorScale, cache/page_codec.h);
// codes two a byte, element 2i in the low nibble; the bytes are those of the CPU codecs
// (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h, cache/page_codec.cpp). Page offsets must be multiples of 16 bytes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/kv_layout.h"

namespace sparrow::cuda {

enum class DsaDType { F32, BF16 };

// The index-key page formats (core/kv_layout.h) the kernels read and write in place: Fp8IndexKey,
// Mxfp4Rows, Nvfp4Rows.
inline constexpr bool dsa_reads_key_format(PageFormat format) {
  return format == PageFormat::Fp8IndexKey || format == PageFormat::Mxfp4Rows || format == PageFormat::Nvfp4Rows;
}

inline constexpr int kDsaIndexDim = 128;      // index_head_dim of both models
inline constexpr int kDsaKeyPageBytes = 132;  // FP8, per token: 128 e4m3 values + one fp32 scale

// Bytes per token of a key format: 132 (FP8), 68 (MXFP4: 64 + 4), 72 (NVFP4: 64 + 8).
constexpr int dsa_key_bytes(PageFormat format) {
  return format == PageFormat::Fp8IndexKey ? kDsaKeyPageBytes : format == PageFormat::Mxfp4Rows ? 68 : 72;
}
const char* dsa_key_format_name(PageFormat format);  // "fp8", "mxfp4", "nvfp4"

// Quantises `count` keys (keys: [count, 128] fp32 or bf16, row-major) into their page rows in `format`,
// in the same launch, byte for byte as the CPU codec: token i belongs to sequence token_seq[i] at
// position token_pos[i] (device arrays).
void dsa_write_keys(const void* keys, DsaDType type, int64_t count, const int32_t* token_seq,
                    const int32_t* token_pos, const int64_t* page_table, int64_t page_table_stride,
                    int block_size, PageFormat format, uint8_t* pool, cudaStream_t stream);

// q: [rows, heads, 128] (fp32 or bf16), weights: [rows, heads] fp32. Writes q_fp8 [rows, heads, 128] e4m3
// and w_folded [rows, heads] = fp32(weights * weight_scale) * (amax(q[t,h]) / 448): a constant factor of the
// weights (the indexer's head_dim^-0.5) multiplied in here, rounded as a separate scaling launch would.
void dsa_quantize_queries(const void* q, DsaDType type, const float* weights, int64_t rows, int heads,
                          uint8_t* q_fp8, float* w_folded, cudaStream_t stream, float weight_scale = 1.0f);

// Index scores over keys in `format`. Query row r belongs to sequence row_seq[r] and sees its keys
// 0 .. row_visible[r]-1 (the causal bound). Writes scores[r * ld + s] for s < max_visible: the score where
// s < row_visible[r], -inf after it. max_visible (host) must be >= every row_visible[r]; ld >= max_visible,
// ld even. heads: 32 or 64. Two kernels, chosen by `kernel`:
//   Wgmma (decode_scores.cu, decode_scores_fp4.cu): one query row (or two) per CTA over a range of its
//     keys on the wgmma tensor cores, keys streamed through a cp.async pipeline: for decode batches (a
//     row per sequence, or two with speculative verification). 4-bit keys are widened in registers
//     (fp4_keys.cuh) and the product takes them from there.
//   Tiles (this file): rows of a CTA share each key tile through L1, e4m3 mma.sync: for FP8 prefill (many
//     consecutive rows of one sequence); also reads MXFP4 keys (widened to e4m3 in registers), not NVFP4.
// Auto: FP8 keys take Wgmma up to kDsaWgmmaMaxRows rows, else Tiles. 4-bit keys take Wgmma for every row
// count: their 16-bit (NVFP4) queries would need twice the tiled kernel's registers, and the wgmma
// products run at the tensor cores' rate where the tiled kernel's e4m3 mma.sync is emulated; prefill rows
// then go in pairs (rows_per_sequence 2: N = 2 x heads per product, each key read once per two rows).
// rows_per_sequence: a hint for the wgmma kernel that requests bring that many consecutive rows each (2:
// speculative verification, or prefill chunks), so that pairs of rows share their key reads; any value
// gives the same scores (a pair of rows of two sequences is scored one sequence after the other).
enum class DsaScoreKernel { Auto, Tiles, Wgmma };
inline constexpr int64_t kDsaWgmmaMaxRows = 256;
void dsa_index_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads,
                      const int32_t* row_seq, const int32_t* row_visible, const uint8_t* pool,
                      const int64_t* page_table, int64_t page_table_stride, int block_size, PageFormat format,
                      float* scores, int64_t ld, int64_t max_visible, cudaStream_t stream,
                      DsaScoreKernel kernel = DsaScoreKernel::Auto, int rows_per_sequence = 1);

// x -> e4m3 with __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), n values (for tests of the CPU
// codec in kernels/cpu/fp8_codec.h).
void fp8_e4m3_encode(const float* x, int64_t n, uint8_t* out, cudaStream_t stream);

}  // namespace sparrow::cuda
