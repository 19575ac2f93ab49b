// The tensor-parallel ops of kernels/ops.h: the collectives a sharded model calls, over the group's
// communicator (core/communicator.h) on the tensors' device.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/device/device.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace sparrow::ops {

namespace {

void check_group(const TensorParallel& tp, const Tensor& x, const char* op) {
  SPARROW_CHECK(tp.comm, op, ": a sharded model without a communicator");
  SPARROW_CHECK(tp.comm->device() == x.device() || tp.comm->device() == Device::Cpu, op, ": a ",
                device_name(x.device()), " tensor on a ", tp.comm->backend(), " communicator");
}

// A host communicator serves a device tensor through a host copy of it (the copy back waits for the
// collective): the path of GPU ranks until the NCCL backend, and of ranks that share one GPU. A CUDA graph
// cannot capture it, so such a model runs its steps eagerly (Model::capturable).
bool staged(const TensorParallel& tp, const Tensor& x) { return tp.comm->device() != x.device(); }

}  // namespace

void all_reduce_(const TensorParallel& tp, Tensor& x) {
  if (!tp.sharded()) return;
  check_group(tp, x, "all_reduce_");
  if (staged(tp, x)) {
    Tensor host = x.to(Device::Cpu);
    tp.comm->all_reduce(host.raw(), host.numel(), host.type());
    x.copy_from(host);
    return;
  }
  tp.comm->all_reduce(x.raw(), x.numel(), x.type());
}

Tensor all_gather_columns(const TensorParallel& tp, const Tensor& x, int64_t part, int64_t total) {
  if (!tp.sharded()) return x;
  check_group(tp, x, "all_gather_columns");
  if (staged(tp, x)) return all_gather_columns(tp, x.to(Device::Cpu), part, total).to(x.device());
  const int64_t rows = x.dim(0), width = x.dim(1), elem = scalar_size(x.type());
  SPARROW_CHECK(width <= part && int64_t(tp.size) * part >= total, "all_gather_columns: part ", width,
                " of at most ", part, " columns cannot make ", total);
  // A block of `cols` columns of every row, from rows `src_ld` elements apart to rows `dst_ld` apart.
  auto copy_columns = [&](void* dst, int64_t dst_ld, const void* src, int64_t src_ld, int64_t cols) {
    if (x.on_cpu()) {
      for (int64_t t = 0; t < rows; ++t)
        std::memcpy(static_cast<uint8_t*>(dst) + t * dst_ld * elem, static_cast<const uint8_t*>(src) + t * src_ld * elem,
                    size_t(cols * elem));
    } else {
      device::copy_device_2d(dst, size_t(dst_ld * elem), src, size_t(src_ld * elem), size_t(cols * elem), size_t(rows));
    }
  };
  // Every rank sends `part` columns (the shorter last parts padded), then the parts are laid side by side.
  Tensor padded = Tensor::zeros({rows, part}, x.type(), x.device());
  copy_columns(padded.raw(), part, x.raw(), width, width);
  Tensor gathered = Tensor::empty({int64_t(tp.size), rows, part}, x.type(), x.device());
  tp.comm->all_gather(padded.raw(), gathered.raw(), rows * part, x.type());
  Tensor out = Tensor::empty({rows, total}, x.type(), x.device());
  for (int64_t r = 0; r < tp.size; ++r) {
    const int64_t first = r * part, count = std::min(part, total - first);
    if (count <= 0) break;
    copy_columns(out.as<uint8_t>() + first * elem, total, gathered.as<uint8_t>() + r * rows * part * elem, part, count);
  }
  return out;
}

namespace {

// The data-parallel groups' row counts, checked against this group's rows: the largest one (every
// group's part is padded to it) and where each group's rows start.
struct RowParts {
  int64_t largest = 0, total = 0;
  std::vector<int64_t> first;
};
RowParts row_parts(const TensorParallel& tp, const std::vector<int64_t>& counts, int64_t mine, const char* op) {
  SPARROW_CHECK(tp.dp_comm, op, ": a data-parallel model without its communicator");
  SPARROW_CHECK(int64_t(counts.size()) == tp.dp_size, op, ": ", counts.size(), " row counts for ", tp.dp_size,
                " data-parallel groups");
  SPARROW_CHECK(counts[size_t(tp.dp_rank)] == mine, op, ": this group holds ", mine, " rows, its count says ",
                counts[size_t(tp.dp_rank)]);
  RowParts parts;
  for (int64_t count : counts) {
    SPARROW_CHECK(count >= 0, op, ": a negative row count");
    parts.first.push_back(parts.total);
    parts.total += count;
    parts.largest = std::max(parts.largest, count);
  }
  return parts;
}

}  // namespace

Tensor all_gather_rows(const TensorParallel& tp, const Tensor& x, const std::vector<int64_t>& counts) {
  const RowParts parts = row_parts(tp, counts, x.dim(0), "all_gather_rows");
  const int64_t width = x.dim(1);
  if (tp.dp_comm->device() != x.device()) return all_gather_rows(tp, x.to(Device::Cpu), counts).to(x.device());
  Tensor padded = Tensor::zeros({parts.largest, width}, x.type(), x.device());
  if (x.dim(0) > 0) padded.rows(0, x.dim(0)).copy_from(x);
  Tensor gathered = Tensor::empty({int64_t(tp.dp_size) * parts.largest, width}, x.type(), x.device());
  tp.dp_comm->all_gather(padded.raw(), gathered.raw(), parts.largest * width, x.type());
  Tensor out = Tensor::empty({parts.total, width}, x.type(), x.device());
  for (size_t d = 0; d < counts.size(); ++d)
    if (counts[d] > 0)
      out.rows(parts.first[d], parts.first[d] + counts[d])
          .copy_from(gathered.rows(int64_t(d) * parts.largest, int64_t(d) * parts.largest + counts[d]));
  return out;
}

Tensor reduce_scatter_rows(const TensorParallel& tp, const Tensor& x, const std::vector<int64_t>& counts) {
  const int64_t mine = counts.empty() || tp.dp_rank >= int64_t(counts.size()) ? -1 : counts[size_t(tp.dp_rank)];
  const RowParts parts = row_parts(tp, counts, mine, "reduce_scatter_rows");
  SPARROW_CHECK(x.dim(0) == parts.total, "reduce_scatter_rows: ", x.dim(0), " rows for groups of ", parts.total);
  const int64_t width = x.dim(1);
  if (tp.dp_comm->device() != x.device()) return reduce_scatter_rows(tp, x.to(Device::Cpu), counts).to(x.device());
  Tensor padded = Tensor::zeros({int64_t(tp.dp_size) * parts.largest, width}, x.type(), x.device());
  for (size_t d = 0; d < counts.size(); ++d)
    if (counts[d] > 0)
      padded.rows(int64_t(d) * parts.largest, int64_t(d) * parts.largest + counts[d])
          .copy_from(x.rows(parts.first[d], parts.first[d] + counts[d]));
  Tensor summed = Tensor::empty({parts.largest, width}, x.type(), x.device());
  tp.dp_comm->reduce_scatter(padded.raw(), summed.raw(), parts.largest * width, x.type());
  return mine == parts.largest ? summed : summed.rows(0, mine).clone();
}

Tensor send_rows(const TensorParallel& tp, const Tensor& x, RowExchange& exchange) {
  const std::vector<std::vector<int64_t>>& to = exchange.to;
  SPARROW_CHECK(tp.dp_comm && int64_t(to.size()) == tp.dp_size, "send_rows: ", to.size(), " destinations for ",
                tp.dp_size, " data-parallel groups");
  if (!x.on_cpu()) return send_rows(tp, x.to(Device::Cpu), exchange).to(x.device());
  const int D = tp.dp_size, me = tp.dp_rank;
  const int64_t width = x.dim(1), row_bytes = width * scalar_size(x.type());
  // Every group's counts to every group: [source][destination].
  std::vector<int64_t> counts(D), matrix(size_t(D) * D);
  for (int d = 0; d < D; ++d) counts[d] = int64_t(to[d].size());
  tp.dp_comm->all_gather(counts.data(), matrix.data(), D, ScalarType::I64);
  exchange.largest = std::max<int64_t>(1, *std::max_element(matrix.begin(), matrix.end()));
  const int64_t largest = exchange.largest;
  std::vector<uint8_t> send(size_t(D * largest * row_bytes), 0), recv(send.size());
  const uint8_t* rows = static_cast<const uint8_t*>(x.raw());
  for (int d = 0; d < D; ++d)
    for (size_t i = 0; i < to[d].size(); ++i) {
      SPARROW_CHECK(to[d][i] >= 0 && to[d][i] < x.dim(0), "send_rows: row ", to[d][i], " of ", x.dim(0));
      std::memcpy(send.data() + (d * largest + int64_t(i)) * row_bytes, rows + to[d][i] * row_bytes, size_t(row_bytes));
    }
  tp.dp_comm->all_to_all(send.data(), recv.data(), largest * row_bytes, ScalarType::U8);
  exchange.from.assign(D, 0);
  int64_t total = 0;
  for (int s = 0; s < D; ++s) total += exchange.from[s] = matrix[size_t(s) * D + me];
  Tensor out = Tensor::empty({total, width}, x.type());
  for (int64_t s = 0, at = 0; s < D; at += exchange.from[s], ++s)
    std::memcpy(static_cast<uint8_t*>(out.raw()) + at * row_bytes, recv.data() + s * largest * row_bytes,
                size_t(exchange.from[s] * row_bytes));
  return out;
}

Tensor return_rows(const TensorParallel& tp, const Tensor& y, const RowExchange& exchange, int64_t rows) {
  const int D = tp.dp_size;
  SPARROW_CHECK(tp.dp_comm && int64_t(exchange.from.size()) == D && int64_t(exchange.to.size()) == D,
                "return_rows: an exchange of ", exchange.from.size(), " groups, not ", D);
  if (!y.on_cpu()) return return_rows(tp, y.to(Device::Cpu), exchange, rows).to(y.device());
  SPARROW_CHECK(y.type() == ScalarType::F32, "return_rows: fp32 terms");
  const int64_t width = y.dim(1), largest = exchange.largest;
  std::vector<float> send(size_t(D * largest * width), 0.0f), recv(send.size());
  for (int64_t s = 0, at = 0; s < D; at += exchange.from[s], ++s)
    std::copy_n(y.data() + at * width, exchange.from[s] * width, send.data() + s * largest * width);
  tp.dp_comm->all_to_all(send.data(), recv.data(), largest * width, ScalarType::F32);
  Tensor out = Tensor::zeros({rows, width});
  for (int d = 0; d < D; ++d)
    for (size_t i = 0; i < exchange.to[d].size(); ++i) {
      float* row = out.row(exchange.to[d][i]);
      const float* term = recv.data() + (d * largest + int64_t(i)) * width;
      for (int64_t c = 0; c < width; ++c) row[c] += term[c];
    }
  return out;
}

Tensor embedding_part(const Tensor& table_part, int64_t first, int64_t vocab, const std::vector<int32_t>& ids) {
  const int64_t rows = table_part.dim(0), width = table_part.dim(1), n = int64_t(ids.size());
  // The rows this part holds, then one zero row that every other id picks (on either device, with the
  // plain embedding and row selection).
  std::vector<int32_t> local(ids.size());
  std::vector<int64_t> pick(ids.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[size_t(i)];
    SPARROW_CHECK(id >= 0 && id < vocab, "token id ", id, " out of range [0, ", vocab, ")");
    const bool held = id >= first && id < first + rows;
    local[size_t(i)] = held ? int32_t(id - first) : 0;
    pick[size_t(i)] = held ? i : n;
  }
  const Tensor embedded = embedding(table_part, local);
  return select_rows(concat_rows(embedded, Tensor::zeros({1, width}, embedded.type(), embedded.device())), pick);
}

}  // namespace sparrow::ops
