#include "cache/prefix_hash.h"

#include <xxhash.h>

namespace sparrow {

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count) {
  return XXH3_64bits_withSeed(tokens, size_t(count) * sizeof(int32_t), parent);
}

}  // namespace sparrow
