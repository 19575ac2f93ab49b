#include "core/sequence_cache.h"

#include "core/error.h"

namespace sparrow {

float* SequenceCache::snapshot(int layer, StateKind kind) {
  fail("this sequence cache keeps no state snapshots (layer ", layer, ", ", state_kind_name(kind), ")");
}

const std::vector<int32_t>& SequenceCache::block_table() const {
  static const std::vector<int32_t> none;
  return none;
}

}  // namespace sparrow
