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

}  // namespace sparrow::cuda
