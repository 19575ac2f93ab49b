#include "cache/prefix_hash.h"

#include <xxhash.h>

namespace sparrow {

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t count) {
  return XXH3_64bits_withSeed(tokens, size_t(count) * sizeof(int32_t), parent);
}

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int64_t first, int64_t count,
                    const std::vector<HashedSpan>& spans) {
  uint64_t key = block_hash(parent, tokens, count);
  for (const HashedSpan& span : spans) {
    if (span.offset >= first + count || span.offset + span.length <= first) continue;
    const int64_t record[2] = {int64_t(span.key), span.offset - first};
    key = XXH3_64bits_withSeed(record, sizeof(record), key);
  }
  return key;
}

}  // namespace sparrow
