// Grouped-query attention (MiniMax-M3, src/model/gqa_attention.h) on the GPU over the paged K/V cache,
// dense causal or restricted to the key blocks MiniMax's MSA selector keeps (src/model/msa_indexer.h).
//
// Cache (PageKind::GqaKeyValue, docs/cache.md): token j of a sequence lives at
//   pool + page_table[seq * stride + j / block_size] + (j % block_size) * row_bytes,
//   row = [K of kv head 0 .. kv_heads-1 | V of kv head 0 .. kv_heads-1], each head head_dim bf16,
//   row_bytes = 2 * kv_heads * head_dim * 2.
// Page offsets and the q / k / v / out pointers must be multiples of 16 bytes (16-byte copies).
//
// Attention of row r (query head h, kv head kvh(h) = h / (heads / kv_heads)):
//   out[r, h, :] = sum_s softmax_s(scale * q[r, h] . K[s, kvh(h)]) V[s, kvh(h)]
// over the keys s of sequence row_seq[r] with s <= row_pos[r] (causal) and, when `blocks` is given, only
// those in the row's kept blocks of index head g = h / (heads / index_heads): block b holds the keys
// b * index_block_size .. (b+1) * index_block_size - 1. fp32 softmax and accumulation; bf16 q, K, V, out.
//
// bf16 tensors are passed as void pointers to their bit patterns (this header is included from plain C++).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sparrow::cuda {

// Writes the new tokens' K and V into their cache rows: row i of k and v ([rows, kv_heads * head_dim]
// bf16 each) goes to sequence row_seq[i], position row_pos[i] (device arrays). Byte-exact copies.
void gqa_write_kv(const void* k_bf16, const void* v_bf16, int64_t rows, int kv_heads, int head_dim,
                  const int32_t* row_seq, const int32_t* row_pos, const int64_t* page_table, int64_t stride,
                  int block_size, uint8_t* pool, cudaStream_t stream);

// Bytes of device workspace gqa_attention needs for these sizes (0 when the keys are not split across
// blocks). Depends only on its arguments and the device; pass the same values as to gqa_attention
// (blocks null there <=> max_blocks 0 here).
size_t gqa_attention_workspace_bytes(int64_t rows, int heads, int kv_heads, int head_dim, int64_t max_visible,
                                     int index_heads, int max_blocks, int index_block_size);

// GQA attention of `rows` query rows.
//   q, out       [rows, heads, head_dim] bf16; head_dim a multiple of 16, at most 256
//   row_seq      [rows] int32 (device): the row's sequence (its page_table row)
//   row_pos      [rows] int32 (device): the row's position; it sees keys 0 .. row_pos[r]
//   max_visible  (host) >= every row_pos[r] + 1 (may be larger): sizes the split of the keys only
//   blocks       null (dense) or [rows, index_heads, max_blocks] int32 (device): kept block ids of each
//                row and index head, ascending, padded with -1 (MSA); index_block_size keys per block
//   heads % kv_heads == 0 and, when sparse, heads % index_heads == 0.
// Decode (one or a few rows per sequence) and prefill (many consecutive rows of one sequence) use the
// same kernel; long key ranges are split across blocks and merged by log-sum-exp weights in `workspace`.
void gqa_attention(const void* q_bf16, void* out_bf16, int64_t rows, int heads, int kv_heads, int head_dim,
                   float scale, const int32_t* row_seq, const int32_t* row_pos, int64_t max_visible,
                   const int32_t* blocks, int index_heads, int max_blocks, int index_block_size,
                   const int64_t* page_table, int64_t stride, int block_size, const uint8_t* pool, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace sparrow::cuda
