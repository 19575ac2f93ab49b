// The offline SequenceCache: one growable fp32 buffer per (layer, page kind) and one per (layer, state
// kind), owned by the sequence. ModelRunner::new_sequence() hands these out for tests, `sparrow score` and
// `sparrow generate`; the serving engine uses the paged cache (cache/kv_cache.h) instead.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/sequence_cache.h"
#include "model/model.h"

namespace sparrow {

class DenseSequenceCache : public SequenceCache {
 public:
  explicit DenseSequenceCache(std::vector<LayerCacheSpec> spec);

  // Writes may overwrite cached tokens or append right after the last one; a gap is an error.
  void write(int layer, PageKind page, int64_t pos, int64_t count, const float* rows) override;
  void read(int layer, PageKind page, int64_t begin, int64_t end, float* rows) const override;
  float* state(int layer, StateKind kind) override;

  // Tokens held in `layer`'s page of `kind` (tests).
  int64_t tokens(int layer, PageKind page) const;

 private:
  struct Buffer {
    int64_t width = 0;  // floats per token (pages) or in all (states); 0 = the layer has none
    std::vector<float> data;
  };
  Buffer& page_buffer(int layer, PageKind kind);
  const Buffer& page_buffer(int layer, PageKind kind) const;

  std::vector<LayerCacheSpec> spec_;
  std::vector<Buffer> pages_;   // [layer * kNumPageKinds + kind]
  std::vector<Buffer> states_;  // [layer * kNumStateKinds + kind]
};

// A sequence with its own growable fp32 cache for layers cached as `spec` says (what
// ModelRunner::new_sequence gives on the CPU; tests of a single block use it directly).
SequenceState standalone_sequence(std::vector<LayerCacheSpec> spec);

}  // namespace sparrow
