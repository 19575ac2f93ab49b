#include "formats/shard_prefetch.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace sparrow {

namespace {
constexpr int64_t kChunk = 16 << 20;  // bytes a readahead call asks for
}

ShardPrefetcher::ShardPrefetcher(std::vector<std::string> paths, int threads, int64_t window_bytes,
                                 std::function<int64_t()> taken)
    : paths_(std::move(paths)), window_(window_bytes), taken_(std::move(taken)) {
  const int n = std::max(1, std::min<int>(threads, int(paths_.size())));
  for (int i = 0; i < n && !paths_.empty(); ++i) threads_.emplace_back([this] { reader(); });
}

ShardPrefetcher::~ShardPrefetcher() {
  stop_ = true;
  wait();
}

void ShardPrefetcher::wait() {
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
}

// One file at a time, front to back: readahead(2) fills the page cache without copying anything out; where
// the file system has no readahead (tmpfs, some network file systems: EINVAL), plain reads into a scratch
// buffer do the same. A file that cannot be opened or read is skipped: the loader's own read reports it.
void ShardPrefetcher::reader() {
  std::vector<char> scratch;
  auto read_chunk = [&](int fd, int64_t offset, int64_t n) {
    if (::readahead(fd, offset, size_t(n)) == 0) return true;
    scratch.resize(1 << 20);
    for (int64_t done = 0; done < n;) {
      const ssize_t got = ::pread(fd, scratch.data(), size_t(std::min<int64_t>(n - done, 1 << 20)), offset + done);
      if (got <= 0) return false;
      done += got;
    }
    return true;
  };
  for (size_t i = next_++; i < paths_.size() && !stop_; i = next_++) {
    const int fd = ::open(paths_[i].c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    const int64_t size = ::fstat(fd, &st) == 0 ? int64_t(st.st_size) : 0;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    for (int64_t offset = 0; offset < size && !stop_; offset += kChunk) {
      while (!stop_ && read_.load() - taken_() > window_) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const int64_t n = std::min(kChunk, size - offset);
      if (!read_chunk(fd, offset, n)) break;
      read_ += n;
    }
    ::close(fd);
  }
}

}  // namespace sparrow
