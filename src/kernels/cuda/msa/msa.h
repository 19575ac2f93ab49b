// MiniMax-M3's MSA block selector on Hopper (the GPU form of select_blocks / MsaIndexer::select in
// src/model/msa_indexer.{h,cpp}): bf16, FP8 (E4M3), NVFP4 or MXFP4 index keys in the paged cache, bf16
// index queries, block scores on the bf16 tensor cores, the selection per (query row, index head) on the
// device.
//
//   block score  B_g[b] = max over keys s of block b with s <= pos of  q_g · k_s     (raw dot, no scale)
//   blocks b = 0 .. pos / ib of a query at position pos; the forced newest blocks newest - l
//   (l < local_blocks, clamped at 0) count as +inf; the kept blocks are the top_k of these scores
//   (all of them when the query sees <= topk_blocks blocks), ties to the smaller block id, NaN last,
//   minus blocks whose score is -inf: exactly cpu::top_k as select_blocks calls it.
//
// Precision: products of bf16 values are exact in fp32 and summed in fp32 on the tensor cores
// (mma.sync m16n8k16, fp32 accumulators), in the tensor core's order, so a score may differ from the
// CPU's fp32 BLAS dot in the last bits and a near-tie may then go the other way; equal inputs give
// equal scores (same order every time: the selection is deterministic). A NaN product is ignored by the
// max-pool (fmaxf, like std::max(acc, NaN) on the CPU), so a block score is never NaN; a block none of
// whose visible products is a number scores -inf and is dropped unless forced.
//
// Narrow keys: every E4M3 value, and every NVFP4 / MXFP4 value (E2M1 times its block scale, within fp32's
// range), is a bf16 value, so the selector widens the raw key bytes exactly to bf16 in registers
// (kernels/cuda/gqa/kv_widen.cuh) and feeds the same bf16 products: its scores are those of bf16 keys
// holding the dequantised values, up to the tensor core's summation order (the narrow paths give each
// lane 16 contiguous raw bytes, so the dims are dealt to the k-steps in another order than the bf16
// path's); exactly equal for values whose dot products are exact in fp32. Exception: an E4M3 NaN code
// (written only for a NaN input) reads as +-480.
//
// Paged cache (docs/cache.md, cache/page_codec.h): sequence `seq`'s token j lives in the page at byte
// offset page_table[seq * page_table_stride + j / block_size] of `pool`, slot s = j % block_size; a page
// of B tokens holds, per PageFormat:
//   BFloat16 (PageFormat::BFloat16):  B rows of dim bf16, consecutive (dim * 2 bytes a token);
//   Fp8      (PageFormat::Fp8Rows):   B rows of dim E4M3 bytes, e4m3(x / kKvTensorScale) with that per-layer
//            scale fixed at 1.0 (MiniMax's own MSA kernels keep their index keys as scale-free E4M3 too):
//            128 bytes a token at dim 128;
//   Nvfp4    (PageFormat::Nvfp4Rows): "values then scales": B x dim/2 bytes of E2M1 codes (value 2i in the
//            low nibble of byte i), then B x ceil(dim/16) E4M3 block scales; second-level scale
//            kKvTensorScale = 1.0: 64 + 8 = 72 bytes a token at dim 128 (the MiniMax seed's NVFP4 keys);
//   Mxfp4    (PageFormat::Mxfp4Rows): the same with ceil(dim/32) E8M0 block scales (OCP MX v1.0 section
//            6.3): 64 + 4 = 68 bytes a token at dim 128.
// Token s's codes (or row) start at page + s * (its code bytes), its scales at page + B * dim/2 +
// s * (its scale bytes). A dim that is no multiple of the block ends in a shorter block (kernels/cpu/fp4_codec.h).
// Page offsets must be multiples of 16 bytes. The cache's block_size (tokens per page) is unrelated to
// the MSA index block size `ib` (index_block_size: 128 in MiniMax-M3.1).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/kv_layout.h"

namespace sparrow::cuda {

inline constexpr int kMsaMaxDim = 256;         // index_head_dim (multiple of 8): 128 in MiniMax-M3.1
inline constexpr int kMsaMaxHeads = 64;        // index heads per launch (MiniMax-M3.1: 4 per GPU under TP4)
inline constexpr int kMsaMaxTopkBlocks = 64;   // index_topk_blocks (MiniMax-M3.1: 16)

// The per-layer scale of FP8 keys and NVFP4's second-level scale, as the kernels apply it: cache/page_codec.h's
// kKvTensorScale, a fixed 1.0 (tests/cuda/msa_test.cpp checks that they agree).
inline constexpr float kMsaKeyTensorScale = 1.0f;

// How the index keys are stored in their pages (see the top of the file).
// (core/kv_layout.h's PageFormat):
//   BFloat16   dim bf16 values a token: 256 bytes at MiniMax-M3.1's dim 128
//   Fp8Rows    dim E4M3 values a token, no scale: 128 bytes
//   Nvfp4Rows  E2M1 codes then E4M3 scales per 16: 72 bytes
//   Mxfp4Rows  E2M1 codes then E8M0 scales per 32: 68 bytes
inline constexpr bool msa_reads_key_format(PageFormat format) {
  return format == PageFormat::BFloat16 || format == PageFormat::Fp8Rows || format == PageFormat::Nvfp4Rows ||
         format == PageFormat::Mxfp4Rows;
}

// Bytes a token's key takes in its page (codes and scales).
int64_t msa_key_bytes(PageFormat format, int dim);

// Stores `count` index keys (keys_bf16: [count, dim] bf16, row-major, 16-byte aligned; dim a multiple
// of 8) in their page slots: row i is token token_pos[i] of sequence token_seq[i] (device arrays).
// Rows with token_pos[i] < 0 are skipped (padding). The narrow formats are quantised in the same launch,
// byte for byte what the CPU page codec (page_codec(dtype, MsaIndexKey)) stores: Fp8 rounds each value
// (kernels/cpu/fp8_codec.h: to nearest even, saturating at ±448, NaN -> 0x7F); Nvfp4 and Mxfp4 quantise each
// block (kernels/cpu/fp4_codec.h nvfp4_quantize with global scale 1.0, mxfp4_quantize).
void msa_write_keys(const void* keys_bf16, int64_t count, int dim, const int32_t* token_seq,
                    const int32_t* token_pos, const int64_t* page_table, int64_t page_table_stride,
                    int block_size, uint8_t* pool, PageFormat format, cudaStream_t stream);

// How the block-score kernel tiles the (row, head) query vectors over warps (msa.cu says how each
// works). Both are exact; tests run both on every case.
//   Decode:  8 vectors per warp, the 4 warps of a CTA walk different key ranges: few rows, typically
//            one per sequence (a warp whose rows belong to different sequences walks each in turn).
//   Prefill: 32 vectors per warp (16 when dim > 128), the 4 warps of a CTA walk the same keys, which
//            they share through L1: many consecutive rows of one sequence.
//   Auto:    Decode up to kMsaDecodeMaxRows rows, else Prefill.
enum class MsaScoreKernel { Auto, Decode, Prefill };
inline constexpr int64_t kMsaDecodeMaxRows = 256;

// Device scratch msa_select_blocks needs (block scores of up to a bounded number of rows at a time:
// larger launches are processed in row chunks, so this stays below ~64 MiB plus one row's worth).
size_t msa_select_workspace_bytes(int64_t rows, int index_heads, int64_t max_position, int ib);

// The kept blocks of every (query row, index head).
//   q_bf16:     [rows, index_heads, dim] bf16 index queries (normed and rotated by the caller), 16-byte
//               aligned.
//   row_seq, row_pos (device, [rows]): query row r belongs to sequence row_seq[r] at position
//               row_pos[r] and sees that sequence's keys 0 .. row_pos[r] (already written to the cache).
//               A row with row_pos < 0 keeps nothing (padding rows).
//   max_position (host): >= every row_pos (it sizes the grid and the workspace; may be padded larger).
//   ib: index_block_size (keys per index block, >= 1); topk_blocks: 1 .. kMsaMaxTopkBlocks;
//   local_blocks >= 0 newest blocks and init_blocks >= 0 first blocks (sparse_init_block) always kept;
//   dim: multiple of 8, <= kMsaMaxDim; index_heads: 1 .. kMsaMaxHeads.
//   blocks (out, [rows, index_heads, topk_blocks] int32): the kept block ids in ASCENDING order (so the
//               attention kernel walks keys monotonically), then -1 up to topk_blocks.
//   counts (out, optional, [rows, index_heads] int32): how many ids each entry of `blocks` holds.
//   workspace: >= msa_select_workspace_bytes(rows, index_heads, max_position, ib) bytes of device memory
//               (any contents).
//   key_format: how `pool`'s key pages are stored (what msa_write_keys wrote).
void msa_select_blocks(const void* q_bf16, int64_t rows, int index_heads, int dim, const int32_t* row_seq,
                       const int32_t* row_pos, int64_t max_position, const uint8_t* pool, PageFormat key_format,
                       const int64_t* page_table, int64_t page_table_stride, int block_size, int ib,
                       int topk_blocks, int local_blocks, int init_blocks, int32_t* blocks, int32_t* counts,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream,
                       MsaScoreKernel kernel = MsaScoreKernel::Auto);

}  // namespace sparrow::cuda
