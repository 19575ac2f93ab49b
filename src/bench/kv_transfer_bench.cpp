#include "bench/kv_transfer_bench.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "distributed/ucx_kv_transfer.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string offer_id(int64_t rows, int iteration) { return std::to_string(rows) + "/" + std::to_string(iteration); }

std::byte pattern(int64_t row, int64_t i) { return std::byte((row * 131 + i * 7 + 3) & 0xff); }

// The child: offers every fetch the parent will make (each an offer of its own, over the same rows), says
// where it listens, and serves until the parent closes the pipe.
[[noreturn]] void serve_offers(const KvTransferBenchOptions& o, int port_pipe, int done_pipe) {
  const int64_t most = *std::max_element(o.rows.begin(), o.rows.end());
  std::vector<std::byte> rows(size_t(most * o.row_bytes));
  for (int64_t r = 0; r < most; ++r)
    for (int64_t i = 0; i < o.row_bytes; ++i) rows[size_t(r * o.row_bytes + i)] = pattern(r, i);
  auto agent = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  for (const int64_t n : o.rows)
    for (int it = 0; it <= o.iterations; ++it) {  // one more: the checked warm-up fetch
      std::vector<KvRegion> regions;
      for (int64_t r = 0; r < n; ++r) regions.push_back({rows.data() + r * o.row_bytes, o.row_bytes});
      agent->offer(offer_id(n, it), std::move(regions), std::chrono::minutes(10));
    }
  const int port = agent->address().port;
  (void)!write(port_pipe, &port, sizeof(port));
  char byte;
  (void)!read(done_pipe, &byte, 1);  // the parent is done (or gone)
  _exit(0);
}

}  // namespace

std::vector<KvTransferBenchRow> bench_kv_transfer(const KvTransferBenchOptions& o) {
  SPARROW_CHECK(o.row_bytes > 0 && o.iterations > 0 && !o.rows.empty() &&
                    std::all_of(o.rows.begin(), o.rows.end(), [](int64_t n) { return n > 0 && n < (1 << 20); }),
                "bench kv-transfer: sizes and iterations must be positive");
  int port_pipe[2], done_pipe[2];
  SPARROW_CHECK(pipe(port_pipe) == 0 && pipe(done_pipe) == 0, "bench kv-transfer: cannot create pipes");
  const pid_t child = fork();
  SPARROW_CHECK(child >= 0, "bench kv-transfer: fork failed");
  if (child == 0) {
    close(port_pipe[0]);
    close(done_pipe[1]);  // so that the parent's close is the end of the pipe
    serve_offers(o, port_pipe[1], done_pipe[0]);
  }
  close(port_pipe[1]);
  close(done_pipe[0]);
  struct Reap {  // the producer goes whatever happens here
    pid_t pid;
    int done;
    ~Reap() {
      close(done);
      waitpid(pid, nullptr, 0);
    }
  } reap{child, done_pipe[1]};
  int port = 0;
  const bool started = read(port_pipe[0], &port, sizeof(port)) == ssize_t(sizeof(port));
  close(port_pipe[0]);
  SPARROW_CHECK(started, "bench kv-transfer: the producer failed to start");

  auto consumer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  const int64_t most = *std::max_element(o.rows.begin(), o.rows.end());
  std::vector<std::byte> into(size_t(most * o.row_bytes));
  auto fetch = [&](int64_t n, int it) {
    std::vector<std::pair<int64_t, KvRegion>> wanted;
    for (int64_t r = 0; r < n; ++r) wanted.push_back({r, {into.data() + r * o.row_bytes, o.row_bytes}});
    consumer->fetch({"127.0.0.1", port}, offer_id(n, it), std::move(wanted), std::chrono::seconds(60));
    while (true) {
      for (const KvTransferCompletion& c : consumer->poll()) {
        SPARROW_CHECK(c.ok, "bench kv-transfer: fetch ", c.id, " failed: ", c.error);
        return c.seconds;
      }
      std::this_thread::yield();
    }
  };
  std::vector<KvTransferBenchRow> out;
  for (const int64_t n : o.rows) {
    std::memset(into.data(), 0, size_t(n * o.row_bytes));
    fetch(n, o.iterations);  // warm-up, checked
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < o.row_bytes; i += 4099)
        SPARROW_CHECK(into[size_t(r * o.row_bytes + i)] == pattern(r, i), "bench kv-transfer: row ", r, " arrived wrong");
    std::vector<double> times, copies;
    for (int it = 0; it < o.iterations; ++it) times.push_back(fetch(n, it));
    std::vector<std::byte> source(size_t(n * o.row_bytes), std::byte{1});
    for (int it = 0; it < o.iterations; ++it) {
      const auto start = Clock::now();
      std::memcpy(into.data(), source.data(), source.size());
      copies.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    std::sort(copies.begin(), copies.end());
    KvTransferBenchRow row;
    row.row_bytes = o.row_bytes;
    row.rows = n;
    const double median = times[times.size() / 2], bytes = double(n * o.row_bytes);
    row.median_ms = median * 1e3;
    row.gbps = bytes / median / 1e9;
    row.rows_per_s = double(n) / median;
    row.memcpy_gbps = bytes / copies[copies.size() / 2] / 1e9;
    out.push_back(row);
  }
  return out;
}

}  // namespace sparrow::bench
