// What a layer keeps between steps, and the one door through which it reads and writes it.
//
// Layers never own their cache. Each sequence comes with a SequenceCache; a layer writes the rows of
// its new tokens, gathers the rows a step needs into a contiguous fp32 buffer, and reaches its
// recurrent state through it. Two implementations exist:
//   - DenseSequenceCache (runner/dense_sequence_cache.h): growable fp32 buffers owned by the sequence,
//     for offline use (Model::new_sequence: tests, `sparrow score`, `sparrow generate`);
//   - the serving engine's paged cache (cache/kv_cache.h): rows packed into block rows of a shared
//     pool in the cache dtype, state in per-request slots.
// The model math is the same on both: only where the rows live differs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/kv_layout.h"

namespace sparrow {

// One sequence's cache, as the model sees it. Positions are absolute token positions of the sequence.
class SequenceCache {
 public:
  virtual ~SequenceCache() = default;

  // Stores the rows (count x width floats, row-major) of tokens pos .. pos+count-1 in `layer`'s page.
  virtual void write(int layer, PageKind page, int64_t pos, int64_t count, const float* rows) = 0;
  // Gathers the rows of tokens begin .. end-1 into `rows` ((end-begin) x width floats), as fp32.
  virtual void read(int layer, PageKind page, int64_t begin, int64_t end, float* rows) const = 0;
  // The layer's state of `kind` (size floats from the spec; zeros for a fresh sequence), read and
  // updated in place.
  virtual float* state(int layer, StateKind kind) = 0;

  // Recurrent layers and prefix caching. A prefix-cache hit can only resume a recurrent layer where
  // its state was saved, so while the model runs positions [begin, end) the cache may ask for a copy
  // of every recurrent state as it stands after position p-1, for one p in (begin, end]:
  // snapshot_position returns that p, or -1 (the default: no snapshot). It answers the same for every
  // layer of a step. A recurrent layer then runs up to p, copies its state into snapshot(layer, kind),
  // and continues.
  virtual int64_t snapshot_position(int64_t begin, int64_t end) { return -1; }
  virtual float* snapshot(int layer, StateKind kind);

  // Paged caches: the storage and this sequence's block table, for kernels that address pages
  // directly (the GPU path); null / empty for caches without pages (DenseSequenceCache).
  virtual const PagedStorage* paged() const { return nullptr; }
  virtual const std::vector<int32_t>& block_table() const;
  // Paged caches with recurrent layers: the start of this sequence's state slot, and of the snapshot
  // slot this step's snapshot_position reserved (null when there is none), on the storage's device; a
  // layer's state lies paged()->state_offset(layer, kind) bytes in. Kernels update states through them.
  virtual std::byte* state_slot() { return nullptr; }
  virtual std::byte* snapshot_slot() { return nullptr; }
  // The same slots by index in the storage (-1: none), for a tensor-parallel worker that mirrors this
  // sequence in its own cache (runner/step_plan.h).
  virtual int32_t state_slot_index() const { return -1; }
  virtual int32_t snapshot_slot_index() const { return -1; }
  // Makes room for tokens 0 .. tokens-1 where the cache allocates on demand (standalone sequences
  // of a paged cache); the serving engine allocates ahead of each step and this is then a check.
  virtual void reserve(int64_t tokens) {}
};

}  // namespace sparrow
