// What the GPU kernels need to know about a batch, built once per forward pass and shared by every
// layer: the paged cache's addresses (one page table for all layers and page kinds, docs/cache.md)
// and, per batch row, its sequence and position.
//
// A token's page of (layer, kind) starts at storage->pool() + storage->page(layer, kind).offset +
// page_table[seq, token / block_size], so a layer passes `page_base(layer, kind)` as the kernels' pool
// and the same page_table.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "model/model.h"

namespace sparrow {

struct DeviceStep {
  const PagedStorage* storage = nullptr;  // every sequence of the batch lives in this paged cache
  Tensor page_table;        // int64 [num_seqs, table_stride]: block_table[i] * row_bytes
  int64_t table_stride = 0;
  Tensor row_seq;           // int32 [T]: the row's sequence (index into batch.seqs)
  Tensor row_pos;           // int32 [T]: its position
  Tensor row_visible;       // int32 [T]: position + 1 (the causal bound)
  int64_t max_visible = 0;  // the largest row_visible

  uint8_t* page_base(int layer, PageKind kind) const {
    return reinterpret_cast<uint8_t*>(storage->pool() + storage->page(layer, kind).offset);
  }
  PageFormat format(int layer, PageKind kind) const { return storage->page(layer, kind).format; }
  int block_size() const { return int(storage->block_size()); }
};

// The batch's DeviceStep (made on first use and kept with the batch). Every sequence must have a
// paged cache on `device` (Model::new_sequence on a GPU model, or the engine's KvCache).
const DeviceStep& device_step(const Batch& batch, Device device);

}  // namespace sparrow
