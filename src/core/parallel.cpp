#include "core/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace sparrow {
namespace {

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return n_; }

  void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    std::lock_guard<std::mutex> one_job(job_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      total_ = n;
      pending_ = n_ - 1;
      ++generation_;
    }
    start_.notify_all();
    chunk(0, n, fn);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void chunk(int index, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    int64_t begin = n * index / n_, end = n * (index + 1) / n_;
    if (begin < end) {
      in_pool_ = true;
      fn(begin, end);
      in_pool_ = false;
    }
  }
  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t, int64_t)>* fn;
      int64_t n;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        fn = fn_;
        n = total_;
      }
      chunk(index, n, *fn);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

 public:
  static thread_local bool in_pool_;

 private:
  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_, job_mu_;
  std::condition_variable start_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t total_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

thread_local bool Pool::in_pool_ = false;

// A process forked after the pool started (a tensor-parallel test's ranks) has none of its threads:
// there every parallel_for runs serially.
bool forked_child = false;

Pool& pool() {
  static const bool registered = pthread_atfork(nullptr, nullptr, [] { forked_child = true; }) == 0;
  (void)registered;
  static Pool p([] {
    if (const char* env = std::getenv("SPARROW_NUM_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    // Ranks of a tensor-parallel run on one machine share its cores (LOCAL_WORLD_SIZE: docs/parallel.md).
    int ranks_here = 1;
    if (const char* env = std::getenv("LOCAL_WORLD_SIZE")) ranks_here = std::max(1, std::atoi(env));
    return std::max(1, int(std::thread::hardware_concurrency()) / ranks_here);
  }());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || Pool::in_pool_ || forked_child || pool().size() == 1) {
    fn(0, n);
    return;
  }
  pool().run(n, fn);
}

}  // namespace sparrow
