#include "core/batch_invariance.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace sparrow {

namespace {
// -1: not decided yet (the environment decides on first use).
std::atomic<int> mode{-1};
}  // namespace

bool batch_invariant() {
  int m = mode.load(std::memory_order_relaxed);
  if (m < 0) {
    const char* env = std::getenv("VLLM_BATCH_INVARIANT");
    const int from_env = env != nullptr && std::strcmp(env, "1") == 0 ? 1 : 0;
    mode.compare_exchange_strong(m, from_env);
    m = mode.load(std::memory_order_relaxed);
  }
  return m == 1;
}

void set_batch_invariant(bool on) { mode.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace sparrow
