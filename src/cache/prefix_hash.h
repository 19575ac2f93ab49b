// The prefix cache's key for a full block: a 64-bit hash of the block's tokens chained to the key of
// the block before it, so two blocks get the same key only when the whole prefixes up to their ends
// are equal (barring a 64-bit collision, about n^2 / 2^65 for n cached blocks). xxHash's XXH3 with the
// parent key as its seed: deterministic across runs and machines.
#pragma once
#include <cstdint>
#include <vector>

namespace sparrow {

inline constexpr uint64_t kRootBlockHash = 0;  // the "parent" of a sequence's first block

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count);

// A run of a sequence's tokens whose rows depend on more than the tokens: an image's placeholders (all the same
// id), keyed by the image's content (vision/image_input.h). A block that overlaps such runs mixes each one's key and
// where it starts relative to the block into its own (vLLM's extra keys: the mm hashes of the items a block
// overlaps), so the same placeholders over another image never match.
struct HashedSpan {
  int64_t offset = 0, length = 0;
  uint64_t key = 0;
};

// The key of the block of tokens [first, first + count) (`tokens` points at the block's first): block_hash above
// when no span overlaps it.
uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t first, int64_t count,
                    const std::vector<HashedSpan>& spans);

}  // namespace sparrow
