// Building a batch's step inputs (model/device_step.h) on a GPU: the launch shape, the one host buffer
// laid out for it, and its upload in one copy. The runner calls these before each GPU forward pass;
// decode graphs (decode_graphs.h) upload into their own buffers in a padded shape.
#pragma once
#include <cstdint>
#include <memory>

#include "core/tensor.h"
#include "model/device_step.h"

namespace sparrow {

// The least launch shape of a batch: table_stride = the longest block table, max_visible = the
// largest causal bound, rows_after_snapshot = some recurrent sequence has rows after its step's snapshot
// (the recurrent layers then run a second part, model/device_step.h). Every sequence must have a paged
// cache on `device`, all the same one.
struct StepShape {
  int64_t table_stride = 0;
  int64_t max_visible = 0;
  bool rows_after_snapshot = false;
};
StepShape step_shape(const Batch& batch, Device device);

// Bytes of the device buffer that holds a step of `rows` rows and `seqs` sequences with `shape`.
int64_t step_buffer_bytes(int64_t rows, int64_t seqs, const StepShape& shape);

// Fills `buffer` (uint8 on the device, at least step_buffer_bytes) with the batch's step in `shape`
// (at least step_shape(batch)) and returns views of it; attaches it to the batch (batch.device_step).
std::shared_ptr<const DeviceStep> upload_device_step(const Batch& batch, const StepShape& shape, const Tensor& buffer);

// Uploads the batch's step in its least shape into a fresh buffer and attaches it (what an eager GPU
// step does; tests of a single mixer call it before the mixer's forward).
const DeviceStep& attach_device_step(const Batch& batch, Device device);

}  // namespace sparrow
