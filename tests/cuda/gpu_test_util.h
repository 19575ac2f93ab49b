// GPU tests: compiled whenever the CUDA backend is (CI compiles it without a GPU), run only where a
// device exists; elsewhere each test is skipped with a message saying so.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "core/device/cuda_check.h"

namespace sparrow::test {

inline bool have_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// n values of T in device memory of its own (cudaMalloc: apart from the engine's pool, so a kernel
// test sees nothing else), with checked copies both ways and 0xFF poisoning.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    SPARROW_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(1, n) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& host) {
    SPARROW_CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    SPARROW_CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { SPARROW_CUDA_CHECK(cudaMemset(ptr, 0xff, std::max<size_t>(1, n) * sizeof(T))); }
};

}  // namespace sparrow::test

#define SPARROW_REQUIRE_GPU()                                                      \
  do {                                                                             \
    if (!::sparrow::test::have_cuda_device()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)
