// MLA (multi-head latent attention) on Hopper, in the absorbed-weight form of src/kernels/cpu/mla_reference.cpp:
//   logits_s   = q_abs[t,h] · row_s * softmax_scale      (q_abs and row_s: 576 = [512 latent | 64 rope])
//   out[t,h]   = sum_s softmax(logits)_s * c_s              (c_s: the 512 latent values of row_s)
//   lse[t,h]   = log sum_s exp(logits_s)                    (natural log; -inf when no key is valid)
// Sparse (DSA): row t attends to the tokens listed in indices[t, 0..topk) (-1 = unused slot).
// Dense: row t attends to tokens 0..row_lens[t]-1 of its sequence (causal decode / prefill).
//
// The cache is the paged pool of docs/cache.md: token j of sequence s lives at
//   pool + page_offsets[s * pages_stride + j / block_size] + (j % block_size) * row_bytes
// with one of four row formats (the CPU page codecs of cache/page_codec.cpp define every byte; the
// write kernel reproduces them bit for bit, the attention kernel reads them in place):
//   kFp8     (656 B, --kv-cache-dtype fp8; FlashMLA README, "FP8 KV cache"): [512 e4m3 latent][4 fp32
//            scales, one per 128 values][64 bf16 rope]; latent value = e4m3 * scale, scale = amax/448.
//   kBf16    (1152 B): [512 bf16 latent | 64 bf16 rope].
//   kFp8Rows (576 B, fp8_per_tensor, PageFormat::Fp8Rows): 576 e4m3 values [512 latent | 64 rope], each
//            e4m3(x / kMlaTensorScale): FlashInfer's MLA layout (vLLM's "fp8" on Blackwell), the seed's
//            576-byte FP8 latent; the layer's scale stays outside the page.
//   kNvfp4   (352 B, nvfp4, PageFormat::Nvfp4Latent): [256 B: 512 e2m1 latent codes, two a byte, element
//            2i in the low nibble | 64 B: rope as e4m3(x / kMlaTensorScale) | 32 B: one e4m3 block scale
//            per 16 latent values]; latent value = e2m1 * scale * kMlaTensorScale (NVFP4). The seed's
//            352 bytes in the order of vLLM's nvfp4_ds_mla layout (latent, rope, scales); vLLM's Blackwell
//            kernels permute the 32 scales, ours stay in order (these kernels dequantise in registers).
// Page offsets must be multiples of 16 bytes (rows are copied with 16-byte asynchronous copies; every
// row size above is a multiple of 16).
//
// bf16 tensors are passed as uint16_t bit patterns (this header is included from plain C++).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/kv_layout.h"

namespace sparrow::cuda {

inline constexpr int kMlaLatent = 512;
inline constexpr int kMlaRope = 64;
inline constexpr int kMlaRow = kMlaLatent + kMlaRope;  // 576 values per query head / cached token

// The latent page formats (core/kv_layout.h) the kernels read and write in place: Fp8Latent (FlashMLA's
// 656 bytes), BFloat16, Fp8Rows (576 e4m3), Nvfp4Latent (352 bytes).

// The per-layer scale of the Fp8Rows values and the NVFP4 second-level scale: a fixed 1.0, the same
// constant as sparrow::kKvTensorScale in cache/page_codec.h (which says why it is fixed); repeated here
// because this library includes nothing above src/core. tests/cuda/mla_attention_test.cpp checks they agree.
inline constexpr float kMlaTensorScale = 1.0f;

// Bytes a token's latent takes; 0 for a format the kernels do not read.
inline constexpr int64_t mla_row_bytes(PageFormat format) {
  switch (format) {
    case PageFormat::Fp8Latent: return 512 + 16 + 128;   // e4m3 latent, fp32 scales, bf16 rope
    case PageFormat::BFloat16: return 2 * kMlaRow;       // 1152
    case PageFormat::Fp8Rows: return kMlaRow;            // 576 e4m3
    case PageFormat::Nvfp4Latent: return 256 + 64 + 32;  // e2m1 latent, e4m3 rope, e4m3 block scales
    default: return 0;
  }
}
inline constexpr bool mla_reads_latent_format(PageFormat format) { return mla_row_bytes(format) > 0; }
// The same as a constant device code may read (a host constexpr function cannot be called there).
template <PageFormat F>
struct MlaRowBytes {
  static constexpr int64_t value = mla_row_bytes(F);
};

// One layer's MLA latent pages.
struct MlaPagedCache {
  uint8_t* pool = nullptr;                 // device
  const int64_t* page_offsets = nullptr;   // device, [num_seqs, pages_stride] byte offsets into pool
  int64_t pages_stride = 0;                // entries per sequence in page_offsets
  int block_size = 64;                     // tokens per page
  PageFormat format = PageFormat::Fp8Latent;
};

enum class MlaSourceType { kFloat32, kBf16 };

// Writes `count` latent rows (src: [count, 576] fp32 or bf16, [c | k_rot]) into the cache: row i goes to
// sequence row_seq[i] (or seq0 when row_seq is null) at position row_pos[i] (or start_pos + i when
// row_pos is null), encoded in the cache's format in the same kernel (one launch, one 128-thread block a
// row): kFp8 per 128 latent values scale = amax/448 and e4m3 = RNE(value/scale), saturating, rope bf16;
// kFp8Rows e4m3(value / kMlaTensorScale) for all 576; kNvfp4 the NVFP4 rule of kernels/cpu/fp4_codec.h per 16
// latent values (block scale e4m3((amax/6)/kMlaTensorScale)) and the rope as kFp8Rows. The bytes equal
// the CPU page codec's encode of the same fp32 values (bf16 sources widened exactly).
void mla_cache_write(const MlaPagedCache& cache, const void* src, MlaSourceType src_type, int64_t count,
                     const int32_t* row_seq, const int32_t* row_pos, int32_t seq0, int64_t start_pos,
                     cudaStream_t stream);

// Bytes of device workspace the attention launchers need (0 when they run without splitting the keys).
// Depends only on these sizes and the device, so it may be queried once per shape.
size_t mla_attention_workspace_bytes(int64_t rows, int heads, int64_t max_keys);

// The kernels sparse attention can run: Wgmma, the warpgroup kernel (mla/wgmma_kernel.cuh: wgmma, a
// producer warpgroup gathering and dequantising, 64 heads a CTA), and MmaSync, the tiled mma.sync kernel
// (mla/attention_kernel.cuh, 16-64 heads a CTA), which dense attention uses. Auto takes the one
// mla_sparse_kernel_for(heads) names; the others are there so tests and `bench kernels` run both.
enum class MlaKernel { Auto, Wgmma, MmaSync };

// Auto's choice: the warpgroup kernel from 33 heads up. Below, most of its 64-row products would be
// padding: at Kimi K3.1 Pro's 12 heads a GPU the mma.sync kernel was faster at 11 of the 12 batch and
// query shapes measured at 32K (bench/results/kernels.md, "Sparse MLA decode on wgmma").
inline constexpr MlaKernel mla_sparse_kernel_for(int heads) { return heads > 32 ? MlaKernel::Wgmma : MlaKernel::MmaSync; }

// Sparse MLA attention over DSA-selected keys.
//   q        [rows, heads, 576] bf16 (q_abs)      row_seq [rows] int32: the row's sequence
//   indices  [rows, topk] int32 token positions in the row's sequence; -1 = unused
//   out      [rows, heads, 512] bf16              lse [rows, heads] fp32 (may be null)
// Decode (1-2 rows per sequence) and prefill (many rows) use the same kernel; long key lists are split
// across blocks (flash-decoding) and merged by a combine kernel, using `workspace`.
void mla_sparse_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                          const int32_t* indices, int64_t rows, int heads, int topk, float softmax_scale,
                          uint16_t* out, float* lse, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream, MlaKernel kernel = MlaKernel::Auto);

// Dense MLA attention: row t attends to tokens 0..row_lens[t]-1 of sequence row_seq[t]
// (row_lens[t] <= max_len; max_len sizes the split of the keys).
void mla_dense_attention(const MlaPagedCache& cache, const uint16_t* q, const int32_t* row_seq,
                         const int32_t* row_lens, int64_t rows, int heads, int64_t max_len, float softmax_scale,
                         uint16_t* out, float* lse, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace sparrow::cuda
