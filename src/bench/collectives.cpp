#include "bench/collectives.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>

#include "core/device/device.h"
#include "core/error.h"
#include "core/tensor.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A copy of a host vector on the communicator's device (and back).
Tensor upload(std::vector<float>& host, Device device) {
  Tensor t = Tensor::empty({int64_t(host.size())}, ScalarType::F32, device);
  t.copy_from(Tensor::view(host.data(), {int64_t(host.size())}));
  return t;
}
std::vector<float> download(const Tensor& t) {
  const Tensor host = t.to(Device::Cpu);
  return std::vector<float>(host.data(), host.data() + host.numel());
}

void expect_equal(const std::vector<float>& got, const std::vector<float>& want, const std::string& op, int64_t bytes,
                  int rank) {
  for (size_t i = 0; i < want.size(); ++i)
    SPARROW_CHECK(got[i] == want[i], "bench collectives: ", op, " of ", bytes, " bytes gave rank ", rank, " ", got[i],
                  " at element ", i, " instead of ", want[i]);
}

// One operation at one size: the buffers (on the communicator's device) and the call that is timed, whose
// first result is checked here.
struct Case {
  Tensor send, recv;
  std::function<void()> run;
};

Case make_case(Communicator& comm, const std::string& op, int64_t bytes) {
  const int n = comm.size(), rank = comm.rank();
  const Device device = comm.device();
  const int64_t total = bytes / 4;  // float elements in the operation's largest buffer
  const int64_t part = total / n;   // each rank's share, where the operation has shares
  Case c;
  auto f = [](int64_t v) { return float(v); };
  if (op == "all_reduce") {
    std::vector<float> data(static_cast<size_t>(total)), want(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) {
      data[size_t(i)] = f(rank + 1 + i % 13);
      want[size_t(i)] = f(int64_t(n) * (n + 1) / 2 + int64_t(n) * (i % 13));
    }
    c.send = upload(data, device);
    c.run = [&comm, t = c.send, total]() mutable { comm.all_reduce(t.as<void>(), total, ScalarType::F32); };
    c.run();
    expect_equal(download(c.send), want, op, bytes, rank);
  } else if (op == "all_gather") {
    std::vector<float> data(static_cast<size_t>(part)), want(static_cast<size_t>(part * n)), zero(static_cast<size_t>(part * n), 0.0f);
    for (int64_t i = 0; i < part; ++i) data[size_t(i)] = f(rank * 1000 + i % 997);
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < part; ++i) want[size_t(r * part + i)] = f(r * 1000 + i % 997);
    c.send = upload(data, device);
    c.recv = upload(zero, device);
    c.run = [&comm, s = c.send, r = c.recv, part]() mutable {
      comm.all_gather(s.as<void>(), r.as<void>(), part, ScalarType::F32);
    };
    c.run();
    expect_equal(download(c.recv), want, op, bytes, rank);
  } else if (op == "reduce_scatter") {
    std::vector<float> data(static_cast<size_t>(part * n)), want(static_cast<size_t>(part)), zero(static_cast<size_t>(part), 0.0f);
    for (int64_t j = 0; j < part * n; ++j) data[size_t(j)] = f(rank + 1 + j % 13);
    for (int64_t i = 0; i < part; ++i) want[size_t(i)] = f(int64_t(n) * (n + 1) / 2 + int64_t(n) * ((rank * part + i) % 13));
    c.send = upload(data, device);
    c.recv = upload(zero, device);
    c.run = [&comm, s = c.send, r = c.recv, part]() mutable {
      comm.reduce_scatter(s.as<void>(), r.as<void>(), part, ScalarType::F32);
    };
    c.run();
    expect_equal(download(c.recv), want, op, bytes, rank);
  } else if (op == "all_to_all") {
    std::vector<float> data(static_cast<size_t>(part * n)), want(static_cast<size_t>(part * n)), zero(static_cast<size_t>(part * n), 0.0f);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < part; ++i) {
        data[size_t(p * part + i)] = f(rank * 1000 + p * 10 + i % 7);  // for peer p
        want[size_t(p * part + i)] = f(p * 1000 + rank * 10 + i % 7);  // from peer p
      }
    c.send = upload(data, device);
    c.recv = upload(zero, device);
    c.run = [&comm, s = c.send, r = c.recv, part]() mutable {
      comm.all_to_all(s.as<void>(), r.as<void>(), part, ScalarType::F32);
    };
    c.run();
    expect_equal(download(c.recv), want, op, bytes, rank);
  } else if (op == "broadcast") {
    std::vector<float> data(static_cast<size_t>(total)), want(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) {
      want[size_t(i)] = f(i % 251);
      data[size_t(i)] = rank == 0 ? want[size_t(i)] : -1.0f;
    }
    c.send = upload(data, device);
    c.run = [&comm, t = c.send, total]() mutable { comm.broadcast(t.as<void>(), total * 4, 0); };
    c.run();
    expect_equal(download(c.send), want, op, bytes, rank);
  } else {
    fail("bench collectives: unknown operation ", op);
  }
  return c;
}

// The operation's largest buffer for a requested size: whole floats, and whole shares where it has shares.
int64_t operation_bytes(const std::string& op, int64_t bytes, int n) {
  const int64_t unit = op == "all_reduce" || op == "broadcast" ? 4 : 4 * int64_t(n);
  return std::max(unit, bytes / unit * unit);
}

}  // namespace

const std::vector<std::string>& collective_names() {
  static const std::vector<std::string> names = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                 "broadcast"};
  return names;
}

double bus_factor(const std::string& op, int ranks) {
  const double n = ranks;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return (n - 1) / n;
}

void check_options(const CollectiveBenchOptions& options) {
  SPARROW_CHECK(options.min_bytes >= 4 && options.min_bytes <= options.max_bytes,
                "bench collectives: sizes must satisfy 4 <= --min-bytes <= --max-bytes");
  SPARROW_CHECK(options.iterations >= 1 && options.warmup >= 0,
                "bench collectives: --iterations must be positive and --warmup not negative");
  for (const std::string& op : options.ops)
    SPARROW_CHECK(std::find(collective_names().begin(), collective_names().end(), op) != collective_names().end(),
                  "bench collectives: unknown operation '", op, "' (all_reduce, all_gather, reduce_scatter, ",
                  "all_to_all, broadcast)");
}

std::vector<CollectiveBenchRow> bench_collectives(Communicator& comm, const CollectiveBenchOptions& options) {
  check_options(options);
  const std::vector<std::string> ops = options.ops.empty() ? collective_names() : options.ops;
  const int n = comm.size();
  const bool gpu = comm.device() != Device::Cpu;
  // The group's first calls run slow (measured: ~2 ms a call over the first ~30 on two local processes, where
  // later ones take ~70 µs), so the ranks meet a few times before anything is timed.
  for (int i = 0; i < 64; ++i) comm.barrier();
  std::vector<CollectiveBenchRow> rows;
  for (const std::string& op : ops)
    for (int64_t requested = options.min_bytes; requested <= options.max_bytes; requested *= 2) {
      const int64_t bytes = operation_bytes(op, requested, n);
      Case c = make_case(comm, op, bytes);
      for (int i = 0; i < options.warmup; ++i) c.run();
      std::vector<float> mine(static_cast<size_t>(options.iterations));
      for (int i = 0; i < options.iterations; ++i) {
        comm.barrier();
        const Clock::time_point start = Clock::now();
        c.run();
        if (gpu) device::synchronize();
        mine[size_t(i)] = float(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      }
      // Every rank's times, so that each iteration counts its slowest rank.
      std::vector<float> zero(static_cast<size_t>(options.iterations) * size_t(n), 0.0f);
      Tensor send = upload(mine, comm.device()), all = upload(zero, comm.device());
      comm.all_gather(send.as<void>(), all.as<void>(), options.iterations, ScalarType::F32);
      const std::vector<float> times = download(all);
      std::vector<double> slowest(size_t(options.iterations), 0.0);
      for (int r = 0; r < n; ++r)
        for (int i = 0; i < options.iterations; ++i)
          slowest[size_t(i)] = std::max(slowest[size_t(i)], double(times[size_t(r * options.iterations + i)]));
      std::sort(slowest.begin(), slowest.end());
      CollectiveBenchRow row;
      row.op = op;
      row.backend = comm.backend();
      row.device = gpu ? "cuda" : "cpu";
      row.ranks = n;
      row.bytes = bytes;
      row.median_us = slowest[slowest.size() / 2];
      row.algbw_gbps = row.median_us > 0 ? double(bytes) / (row.median_us * 1e3) : 0.0;
      row.busbw_gbps = row.algbw_gbps * bus_factor(op, n);
      rows.push_back(row);
    }
  return rows;
}

}  // namespace sparrow::bench
