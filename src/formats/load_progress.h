// How far a checkpoint load has got: bytes of tensor data taken out of the total, and the rate. Printed as
// one line that redraws itself on a terminal (or a line per tenth elsewhere), then a summary:
//   loading weights  46%  12.3 / 27.0 GB  3.2 GB/s
//   loaded 27.0 GB of weights in 8.4 s (3.2 GB/s)
// Thread-safe: prefetch threads and the loader may report at once.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace sparrow {

class LoadProgress {
 public:
  // out: where the lines go (null: nowhere, only counted); live: redraw one line (a terminal).
  LoadProgress(int64_t total_bytes, std::FILE* out, bool live);

  void add(int64_t bytes);
  int64_t done() const;
  int64_t total() const { return total_; }
  double seconds() const;
  // Prints the summary line (once).
  void finish();

  // The two lines, for given figures.
  static std::string bar(int64_t done, int64_t total, double seconds);
  static std::string summary(int64_t bytes, double seconds);

 private:
  using Clock = std::chrono::steady_clock;
  mutable std::mutex mutex_;
  int64_t total_ = 0, done_ = 0;
  std::FILE* out_ = nullptr;
  bool live_ = false, finished_ = false;
  int last_tenth_ = 0;
  Clock::time_point start_ = Clock::now(), last_draw_{};
};

}  // namespace sparrow
