// `sparrow bench collectives`: each collective of a tensor-parallel group (core/communicator.h) timed at
// sizes from a few KB to hundreds of MB, on the backend the model's collectives would use (gloo over TCP
// for host memory, NCCL for GPU memory), the way nccl-tests measure them (their PERFORMANCE.md):
//   time     the median over iterations of the slowest rank's time for one call (a barrier before each,
//            the GPU's stream drained after it);
//   algbw    bytes / time, where bytes is the operation's largest buffer (all-gather's output,
//            reduce-scatter's input, the buffer of the others);
//   busbw    algbw times the share of the bytes each rank must move over its link for the operation,
//            which makes the figures comparable with the link's bandwidth whatever the group size:
//            all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast 1.
// Every size's result is checked once before it is timed (integer-valued floats: exact sums), so a
// backend that returns wrong data fails the run instead of looking fast.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/communicator.h"

namespace sparrow::bench {

// The operations, as the command's --op names them.
const std::vector<std::string>& collective_names();

struct CollectiveBenchOptions {
  int64_t min_bytes = 1 << 10, max_bytes = int64_t(1) << 28;  // sizes min, 2 min, 4 min, ... <= max
  int iterations = 20, warmup = 3;
  std::vector<std::string> ops;  // empty: every operation
};

struct CollectiveBenchRow {
  std::string op, backend, device;
  int ranks = 0;
  int64_t bytes = 0;
  double median_us = 0, algbw_gbps = 0, busbw_gbps = 0;
};

// Throws sparrow::Error, one line, for sizes out of order, no iterations or an unknown operation (the command
// checks before it starts any process).
void check_options(const CollectiveBenchOptions& options);

// The share of `bytes` a rank moves over its link (the busbw factor above).
double bus_factor(const std::string& op, int ranks);

// Runs on every rank of `comm`'s group, the same options on each (throws sparrow::Error on bad options, a
// result that is wrong, or a peer that fails); every rank gets the same rows.
std::vector<CollectiveBenchRow> bench_collectives(Communicator& comm, const CollectiveBenchOptions& options);

}  // namespace sparrow::bench
