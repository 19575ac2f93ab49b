#include "runner/step_inputs.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace sparrow {

namespace {

// The buffer's arrays in order, each 256-byte aligned (the kernels' vector loads need 16).
struct StepLayout {
  int64_t token_ids, positions, logit_rows, page_table, row_seq, row_pos, row_visible, seq_rows, seq_split,
      state_slots, snapshot_slots, bytes;
  StepLayout(int64_t rows, int64_t seqs, const StepShape& shape) {
    int64_t at = 0;
    auto take = [&](int64_t n) {
      const int64_t offset = at;
      at += (std::max<int64_t>(n, 1) + 255) / 256 * 256;
      return offset;
    };
    token_ids = take(rows * 4);
    positions = take(rows * 8);
    logit_rows = take(rows * 4);  // at most one a row
    page_table = take(seqs * shape.table_stride * 8);
    row_seq = take(rows * 4);
    row_pos = take(rows * 4);
    row_visible = take(rows * 4);
    seq_rows = take((seqs + 1) * 4);
    seq_split = take(seqs * 4);
    state_slots = take(seqs * 8);
    snapshot_slots = take(seqs * 8);
    bytes = at;
  }
};

}  // namespace

StepShape step_shape(const Batch& batch, Device device) {
  StepShape shape;
  const PagedStorage* storage = nullptr;
  for (const SeqSlice& seq : batch.seqs) {
    const PagedStorage* paged = seq.cache().paged();
    SPARROW_CHECK(paged != nullptr && paged->device() == device, "a sequence's cache is not a paged cache on ",
                  device_name(device), " (make sequences with ModelRunner::new_sequence() or the engine)");
    SPARROW_CHECK(storage == nullptr || storage == paged, "the sequences of one batch must share one paged cache");
    storage = paged;
    shape.table_stride = std::max<int64_t>(shape.table_stride, int64_t(seq.cache().block_table().size()));
    shape.max_visible = std::max(shape.max_visible, seq.start() + seq.count);
    if (seq.cache().state_slot()) {
      const int64_t snapshot_at = seq.cache().snapshot_position(seq.start(), seq.start() + seq.count);
      shape.rows_after_snapshot |= snapshot_at > seq.start() && snapshot_at < seq.start() + seq.count;
    }
  }
  shape.table_stride = std::max<int64_t>(shape.table_stride, 1);
  return shape;
}

int64_t step_buffer_bytes(int64_t rows, int64_t seqs, const StepShape& shape) {
  return StepLayout(rows, seqs, shape).bytes;
}

std::shared_ptr<const DeviceStep> upload_device_step(const Batch& batch, const StepShape& shape,
                                                     const Tensor& buffer) {
  const int64_t rows = batch.size(), seqs = int64_t(batch.seqs.size());
  const StepShape least = step_shape(batch, buffer.device());
  SPARROW_CHECK(shape.table_stride >= least.table_stride && shape.max_visible >= least.max_visible &&
                    shape.rows_after_snapshot == least.rows_after_snapshot,
                "upload_device_step: the shape is smaller than the batch needs");
  const StepLayout layout(rows, seqs, shape);
  SPARROW_CHECK(buffer.nbytes() >= layout.bytes, "upload_device_step: the buffer holds ", buffer.nbytes(),
                " bytes, the step needs ", layout.bytes);

  Tensor host = Tensor::zeros({layout.bytes}, ScalarType::U8);
  auto at = [&](int64_t offset) { return host.as<uint8_t>() + offset; };
  auto* ids = reinterpret_cast<int32_t*>(at(layout.token_ids));
  auto* positions = reinterpret_cast<int64_t*>(at(layout.positions));
  auto* logit_rows = reinterpret_cast<int32_t*>(at(layout.logit_rows));
  int64_t num_logit_rows = 0;
  auto* table = reinterpret_cast<int64_t*>(at(layout.page_table));
  auto* row_seq = reinterpret_cast<int32_t*>(at(layout.row_seq));
  auto* row_pos = reinterpret_cast<int32_t*>(at(layout.row_pos));
  auto* row_visible = reinterpret_cast<int32_t*>(at(layout.row_visible));
  auto* seq_rows = reinterpret_cast<int32_t*>(at(layout.seq_rows));
  auto* seq_split = reinterpret_cast<int32_t*>(at(layout.seq_split));
  auto* state_slots = reinterpret_cast<int64_t*>(at(layout.state_slots));
  auto* snapshot_slots = reinterpret_cast<int64_t*>(at(layout.snapshot_slots));
  int64_t max_seq_rows = 0;
  const PagedStorage* storage = seqs ? batch.seqs[0].cache().paged() : nullptr;
  std::memcpy(ids, batch.tokens.data(), rows * sizeof(int32_t));
  std::copy(batch.positions.begin(), batch.positions.end(), positions);
  for (int64_t s = 0; s < seqs; ++s) {
    const SeqSlice& seq = batch.seqs[s];
    for (int64_t r = seq.offset + seq.count - seq.logits; r < seq.offset + seq.count; ++r)
      logit_rows[num_logit_rows++] = int32_t(r);
    const std::vector<int32_t>& blocks = seq.cache().block_table();
    for (size_t i = 0; i < blocks.size(); ++i)
      table[s * shape.table_stride + int64_t(i)] = int64_t(blocks[i]) * storage->row_bytes();
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t row = seq.offset + i, pos = seq.start() + i;
      row_seq[row] = int32_t(s);
      row_pos[row] = int32_t(pos);
      row_visible[row] = int32_t(pos + 1);
    }
    // Recurrent state: where it lives, and where this step's snapshot (if any) splits the rows.
    seq_rows[s] = int32_t(seq.offset);
    seq_rows[s + 1] = int32_t(seq.offset + seq.count);
    max_seq_rows = std::max(max_seq_rows, seq.count);
    int64_t split = seq.count;
    if (std::byte* slot = seq.cache().state_slot()) {
      state_slots[s] = int64_t(reinterpret_cast<uintptr_t>(slot));
      const int64_t snapshot_at = seq.cache().snapshot_position(seq.start(), seq.start() + seq.count);
      if (snapshot_at > seq.start()) {
        SPARROW_CHECK(snapshot_at <= seq.start() + seq.count, "snapshot position ", snapshot_at,
                      " lies beyond the step's last token ", seq.start() + seq.count - 1);
        split = snapshot_at - seq.start();
        snapshot_slots[s] = int64_t(reinterpret_cast<uintptr_t>(seq.cache().snapshot_slot()));
      }
    }
    seq_split[s] = int32_t(seq.offset + split);
  }
  // One copy; from pageable memory it returns once the bytes are staged, so `host` may go.
  buffer.view_bytes(0, {layout.bytes}, ScalarType::U8).copy_from(host);

  auto step = std::make_shared<DeviceStep>();
  step->storage = storage;
  step->table_stride = shape.table_stride;
  step->max_visible = shape.max_visible;
  step->token_ids = buffer.view_bytes(layout.token_ids, {rows}, ScalarType::I32);
  step->positions = buffer.view_bytes(layout.positions, {rows}, ScalarType::I64);
  step->logit_rows = buffer.view_bytes(layout.logit_rows, {num_logit_rows}, ScalarType::I32);
  step->page_table = buffer.view_bytes(layout.page_table, {seqs, shape.table_stride}, ScalarType::I64);
  step->row_seq = buffer.view_bytes(layout.row_seq, {rows}, ScalarType::I32);
  step->row_pos = buffer.view_bytes(layout.row_pos, {rows}, ScalarType::I32);
  step->row_visible = buffer.view_bytes(layout.row_visible, {rows}, ScalarType::I32);
  step->seq_rows = buffer.view_bytes(layout.seq_rows, {seqs + 1}, ScalarType::I32);
  step->seq_split = buffer.view_bytes(layout.seq_split, {seqs}, ScalarType::I32);
  step->state_slots = buffer.view_bytes(layout.state_slots, {seqs}, ScalarType::I64);
  step->snapshot_slots = buffer.view_bytes(layout.snapshot_slots, {seqs}, ScalarType::I64);
  step->max_seq_rows = max_seq_rows;
  step->rows_after_snapshot = shape.rows_after_snapshot;
  batch.device_step = step;
  return step;
}

const DeviceStep& attach_device_step(const Batch& batch, Device device) {
  const StepShape shape = step_shape(batch, device);
  const int64_t bytes = step_buffer_bytes(batch.size(), int64_t(batch.seqs.size()), shape);
  upload_device_step(batch, shape, Tensor::empty({bytes}, ScalarType::U8, device));
  return *batch.device_step;
}

}  // namespace sparrow
