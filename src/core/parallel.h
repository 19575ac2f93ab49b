// parallel_for over all cores: the CPU path splits heads, tokens or rows across a persistent pool.
// The pool is created on first use with one thread per hardware thread (SPARROW_NUM_THREADS overrides).
// Work is split into contiguous ranges so every thread sees the same partition for the same n:
// results do not depend on scheduling.
#pragma once
#include <cstdint>
#include <functional>

namespace sparrow {

int num_threads();

// Calls fn(begin, end) on disjoint ranges covering [0, n), in parallel; returns when all are done.
// Nested calls run serially in the calling thread.
void parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn);

}  // namespace sparrow
