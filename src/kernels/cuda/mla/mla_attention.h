// MLA (multi-head latent attention) on Hopper, in the absorbed-weight form of src/model/mla.cpp:
//   logits_s   = q_abs[t,h] · row_s * softmax_scale      (q_abs and row_s: 576 = [512 latent | 64 rope])
//   out[t,h]   = sum_s softmax(logits)_s * c_s              (c_s: the 512 latent values of row_s)
//   lse[t,h]   = log sum_s exp(logits_s)                    (natural log; -inf when no key is valid)
// Sparse (DSA): row t attends to the tokens listed in indices[t, 0..topk) (-1 = unused slot).
// Dense: row t attends to tokens 0..row_lens[t]-1 of its sequence (causal decode / prefill).
//
// The cache is the paged pool of docs/cache.md: token j of sequence s lives at
//   pool + page_offsets[s * pages_stride + j / block_size] + (j % block_size) * row_bytes
// with one of two row formats:
//   kFp8   (656 B, the FlashMLA layout): [512 e4m3 latent][4 fp32 scales, one per 128 values][64 bf16 rope]
//          latent value = e4m3 * scale, scale = amax/448 of its 128 values (written by mla_cache_write).
//   kBf16  (1152 B): [512 bf16 latent | 64 bf16 rope].
// Page offsets must be multiples of 16 bytes (rows are copied with 16-byte asynchronous copies).
//
// bf16 tensors are passed as uint16_t bit patterns (this header is included from plain C++).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sparrow::cuda {

inline constexpr int kMlaLatent = 512;
inline constexpr int kMlaRope = 64;
inline constexpr int kMlaRow = kMlaLatent + kMlaRope;  // 576 values per query head / cached token

enum class MlaCacheFormat { kFp8, kBf16 };

inline constexpr int64_t mla_row_bytes(MlaCacheFormat format) {
  return format == MlaCacheFormat::kFp8 ? 512 + 16 + 128 : 2 * kMlaRow;
}

// One layer's MLA latent pages.
struct MlaPagedCache {
  uint8_t* pool = nullptr;                 // device
  const int64_t* page_offsets = nullptr;   // device, [num_seqs, pages_stride] byte offsets into pool
  int64_t pages_stride = 0;                // entries per sequence in page_offsets
  int block_size = 64;                     // tokens per page
  MlaCacheFormat format = MlaCacheFormat::kFp8;
};

enum class MlaSourceType { kFloat32, kBf16 };

// Writes `count` latent rows (src: [count, 576] fp32 or bf16, [c | k_rot]) into the cache: row i goes to
// sequence row_seq[i] (or seq0 when row_seq is null) at position row_pos[i] (or start_pos + i when
// row_pos is null). FP8: per 128 latent values scale = amax/448 and e4m3 = round-to-nearest-even of
// value/scale (saturating), fused in the write; the rope part is stored as bf16 in both formats.
void mla_cache_write(const MlaPagedCache& cache, const void* src, MlaSourceType src_type, int64_t count,
                     const int32_t* row_seq, const int32_t* row_pos, int32_t seq0, int64_t start_pos,
                     cudaStream_t stream);

// Bytes of device workspace the attention launchers need (0 when they run without splitting the keys).
// Depends only on these sizes and the device, so it may be queried once per shape.
size_t mla_attention_workspace_bytes(int64_t rows, int heads, int64_t max_keys);

// Sparse MLA attention over DSA-selected keys.
//   q        [rows, heads, 576] bf16 (q_abs)      row_seq [rows] int32: the row's sequence
//   indices  [rows, topk] int32 token positions in the row's sequence; -1 = unused
//   out      [rows, heads, 512] bf16              lse [rows, heads] fp32 (may be null)
// Decode (1-2 rows per sequence) and prefill (many rows) use the same kernel; long key lists are split
// across blocks (flash-decoding) and merged by a combine kernel, using `workspace`.
void mla_sparse_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                          const int32_t* indices, int64_t rows, int heads, int topk, float softmax_scale,
                          uint16_t* out, float* lse, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

// Dense MLA attention: row t attends to tokens 0..row_lens[t]-1 of sequence row_seq[t]
// (row_lens[t] <= max_len; max_len sizes the split of the keys).
void mla_dense_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                         const int32_t* row_lens, int64_t rows, int heads, int64_t max_len, float softmax_scale,
                         uint16_t* out, float* lse, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace sparrow::cuda
