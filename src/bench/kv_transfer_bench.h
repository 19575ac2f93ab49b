// `sparrow bench kv-transfer`: prefill/decode disaggregation's transfer (core/kv_transfer.h on UCX) between two
// processes of this machine, the way a decode instance fetches a prompt's block rows: one message per row, rows of
// a real model's size (DeepSeek-V3.2's 64-token row in FP8 is about 2.6 MB; the second seed article's 1.82 MB),
// and, as the link's own figure in the same run, memcpy of the same bytes in one process (on one host the agents
// move bytes through shared memory or CMA, so memory bandwidth is the limit). Every size's bytes are checked once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::bench {

struct KvTransferBenchOptions {
  int64_t row_bytes = 1'820'000;
  std::vector<int64_t> rows = {1, 8, 64, 256};  // rows per fetch
  int iterations = 10;
};

struct KvTransferBenchRow {
  int64_t row_bytes = 0, rows = 0;
  double median_ms = 0;       // one fetch: request to last byte, as the consumer's agent saw it
  double gbps = 0;            // bytes / median
  double rows_per_s = 0;      // messages a second
  double memcpy_gbps = 0;     // the same bytes copied in one process, median
};

// Forks the producer; throws sparrow::Error (one line) on bad options, a failed fetch or wrong bytes.
std::vector<KvTransferBenchRow> bench_kv_transfer(const KvTransferBenchOptions& options);

}  // namespace sparrow::bench
