// A measuring hook for `sparrow bench kv-quality` (issue 7, quality of the quantised index keys): while
// one is installed, the CPU indexers (DSA key top-k, MSA block top-k) also select with the exact fp32
// keys of the step and count how much of that exact selection the cache's (possibly rounded) keys kept.
// Only prefills from position 0 are probed: there the step's fresh fp32 keys are all the keys there are.
// Rows whose query sees no more keys (blocks) than the budget select everything and are not counted.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace sparrow {

struct SelectionProbe {
  double recall_sum = 0;  // sum over counted (row, layer[, head]) of |cache ∩ exact| / |exact|
  int64_t rows = 0;

  // Both lists ascending and duplicate-free.
  void add(const std::vector<int32_t>& from_cache, const std::vector<int32_t>& exact) {
    if (exact.empty()) return;
    std::vector<int32_t> common;
    std::set_intersection(from_cache.begin(), from_cache.end(), exact.begin(), exact.end(),
                          std::back_inserter(common));
    recall_sum += double(common.size()) / double(exact.size());
    ++rows;
  }
  double recall() const { return rows ? recall_sum / double(rows) : 1.0; }
};

// The installed probe (null: none, the normal case). Single-threaded use: the tool sets it around one
// forward and reads it after.
inline SelectionProbe*& selection_probe() {
  static SelectionProbe* probe = nullptr;
  return probe;
}

}  // namespace sparrow
