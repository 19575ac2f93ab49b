// GPU tests: compiled whenever the CUDA backend is (CI compiles it without a GPU), run only where a
// device exists; elsewhere each test is skipped with a message saying so.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace sparrow::test {

inline bool have_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace sparrow::test

#define SPARROW_REQUIRE_GPU()                                                      \
  do {                                                                             \
    if (!::sparrow::test::have_cuda_device()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)
