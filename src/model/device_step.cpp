#include "model/device_step.h"

#include <algorithm>

#include "core/error.h"

namespace sparrow {

const DeviceStep& device_step(const Batch& batch, Device device) {
  if (batch.device_step) return *batch.device_step;
  auto step = std::make_shared<DeviceStep>();
  const int64_t num_seqs = int64_t(batch.seqs.size()), rows = batch.size();
  for (const SeqSlice& seq : batch.seqs) {
    const PagedStorage* storage = seq.cache().paged();
    SPARROW_CHECK(storage != nullptr && storage->device() == device, "a sequence's cache is not a paged cache on ",
                  device_name(device), " (make sequences with the model's new_sequence() or the engine)");
    SPARROW_CHECK(step->storage == nullptr || step->storage == storage,
                  "the sequences of one batch must share one paged cache");
    step->storage = storage;
    step->table_stride = std::max<int64_t>(step->table_stride, int64_t(seq.cache().block_table().size()));
  }
  step->table_stride = std::max<int64_t>(step->table_stride, 1);

  Tensor table = Tensor::zeros({num_seqs, step->table_stride}, ScalarType::I64);
  Tensor row_seq = Tensor::empty({rows}, ScalarType::I32), row_pos = Tensor::empty({rows}, ScalarType::I32);
  Tensor row_visible = Tensor::empty({rows}, ScalarType::I32);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqSlice& seq = batch.seqs[s];
    const std::vector<int32_t>& blocks = seq.cache().block_table();
    for (size_t i = 0; i < blocks.size(); ++i)
      table.as<int64_t>()[s * step->table_stride + int64_t(i)] = int64_t(blocks[i]) * step->storage->row_bytes();
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t row = seq.offset + i, pos = seq.start() + i;
      row_seq.as<int32_t>()[row] = int32_t(s);
      row_pos.as<int32_t>()[row] = int32_t(pos);
      row_visible.as<int32_t>()[row] = int32_t(pos + 1);
      step->max_visible = std::max(step->max_visible, pos + 1);
    }
  }
  step->page_table = table.to(device);
  step->row_seq = row_seq.to(device);
  step->row_pos = row_pos.to(device);
  step->row_visible = row_visible.to(device);
  batch.device_step = step;
  return *step;
}

}  // namespace sparrow
