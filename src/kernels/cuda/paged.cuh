// Where a token's row lives in the paged cache, as every kernel that writes one addresses it (cache/: one
// pool row per block of block_size tokens holds all layers' pages; a sequence's page-table row gives, per
// block, the byte offset of this layer's page in the pool): position pos is slot pos % block_size of the
// page of block pos / block_size. Device code only: include from .cu files.
#pragma once
#include <cstdint>

namespace sparrow::cuda {

struct PagedSlot {
  uint8_t* page;  // the page's first byte in the pool
  int64_t slot;   // the token's slot in it
};

__device__ __forceinline__ PagedSlot paged_slot(uint8_t* pool, const int64_t* page_table, int64_t stride, int seq,
                                                int64_t pos, int block_size) {
  return {pool + __ldg(page_table + int64_t(seq) * stride + pos / block_size), pos % block_size};
}

// log2(block_size) when it is a power of two (the usual 64), else -1: kernels that locate many keys a thread
// (the DSA indexer's decode, the sparse MLA gather) shift instead of dividing, ~20 instructions each.
inline int block_shift_of(int block_size) {
  return (block_size & (block_size - 1)) == 0 ? __builtin_ctz(unsigned(block_size)) : -1;
}

// The page and slot of `key` (keys fit in 31 bits) with block_shift_of(block_size).
__device__ __forceinline__ void locate_key(uint32_t key, int block_size, int block_shift, uint32_t& page,
                                           uint32_t& slot) {
  if (block_shift >= 0) {
    page = key >> block_shift;
    slot = key & uint32_t(block_size - 1);
  } else {
    page = key / uint32_t(block_size);
    slot = key - page * uint32_t(block_size);
  }
}

}  // namespace sparrow::cuda
