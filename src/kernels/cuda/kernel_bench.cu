#include "kernels/cuda/kernel_bench.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/device/cuda_check.h"

namespace sparrow::cuda {

namespace {

// Reads `bytes` (a multiple of 16) and writes one word only if a value no flush pattern holds turns up, so
// that the L2 ends full of clean lines of this buffer.
__global__ void read_flush_kernel(const uint4* data, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

}  // namespace

double median_launch_us(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int iterations,
                        bool flush_l2) {
  constexpr size_t kFlushBytes = size_t(256) << 20;  // well above the H200's 50 MB L2
  void* flush = nullptr;
  if (flush_l2) SPARROW_CUDA_CHECK(cudaMalloc(&flush, kFlushBytes));
  // SPARROW_BENCH_FLUSH=read flushes by reading the buffer (clean lines) instead of writing it (dirty lines
  // the timed kernel's first misses must write back): an experiment on the timing floor (kernels.md).
  const char* mode = std::getenv("SPARROW_BENCH_FLUSH");
  const bool read_flush = mode && std::string(mode) == "read";
  if (flush && read_flush) SPARROW_CUDA_CHECK(cudaMemsetAsync(flush, 0x5A, kFlushBytes, stream));
  cudaEvent_t start, stop;
  SPARROW_CUDA_CHECK(cudaEventCreate(&start));
  SPARROW_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(stream);  // warm-up: module load, first-touch
  std::vector<float> times;
  for (int i = 0; i < std::max(iterations, 1); ++i) {
    if (flush && read_flush) {
      read_flush_kernel<<<1056, 512, 0, stream>>>(static_cast<const uint4*>(flush), kFlushBytes / 16,
                                                   static_cast<unsigned*>(flush));
      SPARROW_CUDA_CHECK_LAUNCH();
    } else if (flush) {
      SPARROW_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, stream));
    }
    SPARROW_CUDA_CHECK(cudaEventRecord(start, stream));
    launch(stream);
    SPARROW_CUDA_CHECK(cudaEventRecord(stop, stream));
    SPARROW_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SPARROW_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1000.0f);
  }
  SPARROW_CUDA_CHECK(cudaEventDestroy(start));
  SPARROW_CUDA_CHECK(cudaEventDestroy(stop));
  if (flush) SPARROW_CUDA_CHECK(cudaFree(flush));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

}  // namespace sparrow::cuda
