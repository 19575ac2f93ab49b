// What the GPU kernels need to know about a batch, built once per forward pass by the runner
// (runner/step_inputs.h) and shared by every layer: the tokens and positions, each row's sequence and causal bound, the rows whose logits are
// returned, and the paged cache's addresses (one page table for all layers and page kinds,
// docs/cache.md). All of it is laid out in one host buffer and uploaded with one copy.
//
// A token's page of (layer, kind) starts at storage->pool() + storage->page(layer, kind).offset +
// page_table[seq, token / block_size], so a layer passes `page_base(layer, kind)` as the kernels' pool
// and the same page_table.
//
// The launch shape (table_stride, max_visible) may be padded beyond what the batch needs: the kernels
// bound each row by row_visible, so a larger shape gives the same result. CUDA graphs rely on that to
// replay one capture for a range of context lengths (runner/decode_graphs.h).
#pragma once
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "core/tensor.h"
#include "model/model.h"

namespace sparrow {

struct DeviceStep {
  const PagedStorage* storage = nullptr;  // every sequence of the batch lives in this paged cache
  Tensor token_ids;         // int32 [T]
  Tensor positions;         // int64 [T]
  Tensor logit_rows;        // int32 [R]: the rows that get logits (each sequence's last SeqSlice::logits)
  Tensor page_table;        // int64 [num_seqs, table_stride]: block_table[i] * row_bytes, 0 beyond
  Tensor row_seq;           // int32 [T]: the row's sequence (index into batch.seqs)
  Tensor row_pos;           // int32 [T]: its position
  Tensor row_visible;       // int32 [T]: position + 1 (the causal bound)
  int64_t table_stride = 0;
  int64_t max_visible = 0;  // at least the largest row_visible

  // Recurrent layers (model/kda_mixer.h). Sequence s owns rows seq_rows[s] .. seq_rows[s+1]-1; when the
  // cache wants a prefix-cache snapshot inside the step (SequenceCache::snapshot_position), the rows
  // before seq_split[s] run first, the states are copied to snapshot_slots[s], then the rest runs;
  // otherwise seq_split[s] = seq_rows[s+1] and snapshot_slots[s] is 0 (a snapshot at the step's end
  // needs no second part: decode steps never have one).
  Tensor seq_rows;          // int32 [S + 1]
  Tensor seq_split;         // int32 [S]
  Tensor state_slots;       // int64 [S]: device address of the sequence's state slot (0: none)
  Tensor snapshot_slots;    // int64 [S]: device address of its pending snapshot slot (0: none)
  int64_t max_seq_rows = 0;        // the largest row count of a sequence
  bool rows_after_snapshot = false;  // some sequence has rows after its split

  uint8_t* page_base(int layer, PageKind kind) const {
    return reinterpret_cast<uint8_t*>(storage->pool() + storage->page(layer, kind).offset);
  }
  PageFormat format(int layer, PageKind kind) const { return storage->page(layer, kind).format; }
  int block_size() const { return int(storage->block_size()); }
};

// The step's inputs of a batch on a GPU: the ones the runner attached (runner/step_inputs.h builds and
// uploads them before the forward pass, once for every layer).
inline const DeviceStep& device_step(const Batch& batch) {
  SPARROW_CHECK(batch.device_step != nullptr, "a GPU forward pass without its step's inputs: run the batch "
                "through a ModelRunner (runner/model_runner.h), which uploads them");
  return *batch.device_step;
}

}  // namespace sparrow
