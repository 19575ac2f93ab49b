// Grouped-query attention (MiniMax-M3, src/model/gqa_mixer.h) on the GPU over the paged K/V cache,
// dense causal or restricted to the key blocks MiniMax's MSA selector keeps (src/model/msa_indexer.h).
//
// Cache (PageKind::GqaKeyValue, docs/cache.md, cache/page_codec.h): a token's row holds W = 2 * kv_heads *
// head_dim values, [K of kv head 0 .. kv_heads-1 | V of kv head 0 .. kv_heads-1], each head head_dim
// values; token j of a sequence lives in the page at pool + page_table[seq * stride + j / block_size],
// slot s = j % block_size, stored in one of three formats (PageFormat):
//   BFloat16 (PageFormat::BFloat16): rows of W bf16, token after token: the row at page + s * 2W.
//   Fp8      (PageFormat::Fp8Rows, --kv-cache-dtype fp8 / fp8_per_tensor): rows of W E4M3 bytes,
//            e4m3(x / kKvTensorScale) with that per-layer scale fixed at 1.0: the row at page + s * W.
//   Nvfp4    (PageFormat::Nvfp4Rows, --kv-cache-dtype nvfp4): "values then scales" inside the page of B =
//            block_size tokens: [B x W/2 bytes of E2M1 codes, value 2i in the low nibble of byte i]
//            [B x W/16 E4M3 block scales, one per 16 consecutive values of the row]; the second-level
//            scale is kKvTensorScale = 1.0. Token s's codes at page + s * W/2, its scales at
//            page + B * W/2 + s * W/16. With head_dim a multiple of 16 no block spans two heads (nor K
//            and V). 4 kv heads x 128: 512 + 64 = 576 bytes a token (the MiniMax seed's figure).
// The quantised values are exactly the CPU page codec's (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h): the write
// below produces its bytes, and attention reads them in place, widening them to bf16 exactly in the kernel.
// Page offsets and the q / k / v / out pointers must be multiples of 16 bytes (16-byte copies).
//
// Attention of row r (query head h, kv head kvh(h) = h / (heads / kv_heads)):
//   out[r, h, :] = sum_s softmax_s(scale * q[r, h] . K[s, kvh(h)]) V[s, kvh(h)]
// over the keys s of sequence row_seq[r] with s <= row_pos[r] (causal) and, when `blocks` is given, only
// those in the row's kept blocks of index head g = h / (heads / index_heads): block b holds the keys
// b * index_block_size .. (b+1) * index_block_size - 1. fp32 softmax and accumulation; bf16 q, out, and
// K, V as bf16 (exact for the narrow formats: every E4M3 and NVFP4 value is a bf16 value; an E4M3 NaN
// code, which the write produces only for a NaN input, reads as +-480: kv_widen.cuh).
//
// bf16 tensors are passed as void pointers to their bit patterns (this header is included from plain C++).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/kv_layout.h"

namespace sparrow::cuda {

// The per-layer scale of FP8 rows and NVFP4's second-level scale, as the kernels apply it: cache/page_codec.h's
// kKvTensorScale, a fixed 1.0 (tests/cuda/gqa_attention_test.cpp checks that they agree).
inline constexpr float kGqaKvTensorScale = 1.0f;

// How the K/V pages are stored (core/kv_layout.h's PageFormat; see the top of the file):
//   BFloat16   2 bytes a value (4 kv heads x 128: 2,048 B a token)
//   Fp8Rows    1 byte a value (1,024 B a token)
//   Nvfp4Rows  half a byte a value + 1 byte per 16 (576 B a token)
// The head widths the kernel takes (its tiles are 16 wide, its registers hold up to 256 a head).
inline constexpr bool gqa_takes_head_dim(int64_t head_dim) {
  return head_dim >= 16 && head_dim <= 256 && head_dim % 16 == 0;
}

inline constexpr bool gqa_reads_kv_format(PageFormat format) {
  return format == PageFormat::BFloat16 || format == PageFormat::Fp8Rows || format == PageFormat::Nvfp4Rows;
}

// Writes the new tokens' K and V into their cache rows: row i of k and v ([rows, kv_heads * head_dim]
// bf16 each) goes to sequence row_seq[i], position row_pos[i] (device arrays). BFloat16: byte-exact
// copies; Fp8 / Nvfp4: quantised in the same launch, byte for byte what the CPU page codec
// (page_codec(fp8 | nvfp4, GqaKeyValue)) stores for the same values. head_dim a multiple of 16 for Nvfp4
// (8 otherwise).
void gqa_write_kv(const void* k_bf16, const void* v_bf16, int64_t rows, int kv_heads, int head_dim,
                  const int32_t* row_seq, const int32_t* row_pos, const int64_t* page_table, int64_t stride,
                  int block_size, uint8_t* pool, PageFormat format, cudaStream_t stream);

// Bytes of device workspace gqa_attention needs for these sizes (0 when the keys are not split across
// blocks). Depends only on its arguments and the device; pass the same values as to gqa_attention
// (blocks null there <=> max_blocks 0 here).
size_t gqa_attention_workspace_bytes(int64_t rows, int heads, int kv_heads, int head_dim, int64_t max_visible,
                                     int index_heads, int max_blocks, int index_block_size, PageFormat format);

// GQA attention of `rows` query rows.
//   q, out       [rows, heads, head_dim] bf16; head_dim a multiple of 16, at most 256
//   row_seq      [rows] int32 (device): the row's sequence (its page_table row)
//   row_pos      [rows] int32 (device): the row's position; it sees keys 0 .. row_pos[r]
//   max_visible  (host) >= every row_pos[r] + 1 (may be larger): sizes the split of the keys only
//   blocks       null (dense) or [rows, index_heads, max_blocks] int32 (device): kept block ids of each
//                row and index head, ascending, padded with -1 (MSA); index_block_size keys per block
//   heads % kv_heads == 0 and, when sparse, heads % index_heads == 0.
//   format       how `pool`'s K/V pages are stored (what gqa_write_kv wrote).
//   row_first    null, or [rows] int32 (device), dense only: the row's first visible key (a sliding window);
//                it then sees keys row_first[r] .. row_pos[r]. (A non-causal row passes the last key it sees
//                as its row_pos.)
// Decode (one or a few rows per sequence) and prefill (many consecutive rows of one sequence) use the
// same kernel; long key ranges are split across blocks and merged by log-sum-exp weights in `workspace`.
void gqa_attention(const void* q_bf16, void* out_bf16, int64_t rows, int heads, int kv_heads, int head_dim,
                   float scale, const int32_t* row_seq, const int32_t* row_pos, int64_t max_visible,
                   const int32_t* blocks, int index_heads, int max_blocks, int index_block_size,
                   const int64_t* page_table, int64_t stride, int block_size, const uint8_t* pool,
                   PageFormat format, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   const int32_t* row_first = nullptr);

}  // namespace sparrow::cuda
