// The prefix cache's key for a full block: a 64-bit hash of the block's tokens chained to the key of
// the block before it, so two blocks get the same key only when the whole prefixes up to their ends
// are equal (barring a 64-bit collision, about n^2 / 2^65 for n cached blocks). xxHash's XXH3 with the
// parent key as its seed: deterministic across runs and machines.
#pragma once
#include <cstdint>

namespace sparrow {

inline constexpr uint64_t kRootBlockHash = 0;  // the "parent" of a sequence's first block

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count);

}  // namespace sparrow
