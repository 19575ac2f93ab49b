// Reads a checkpoint's shard files ahead of the loader, several at once, into the page cache, so that the
// loader's reads of the mmapped tensors find them there: the load runs at the disk's speed rather than at
// one page fault at a time. It stays at most `window_bytes` ahead of what the loader has taken (`taken()`),
// so a checkpoint larger than memory streams through instead of evicting its own pages.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace sparrow {

class ShardPrefetcher {
 public:
  ShardPrefetcher(std::vector<std::string> paths, int threads, int64_t window_bytes, std::function<int64_t()> taken);
  ~ShardPrefetcher();  // stops the readers and waits for them
  ShardPrefetcher(const ShardPrefetcher&) = delete;
  ShardPrefetcher& operator=(const ShardPrefetcher&) = delete;

  int64_t bytes_read() const { return read_.load(); }
  void wait();  // until every file is read (tests)

 private:
  void reader();
  std::vector<std::string> paths_;
  int64_t window_;
  std::function<int64_t()> taken_;
  std::atomic<size_t> next_{0};
  std::atomic<int64_t> read_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace sparrow
