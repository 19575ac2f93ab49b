#include "kernels/cuda/kernel_bench.h"

#include <algorithm>

#include "core/device/cuda_check.h"

namespace sparrow::cuda {

double median_launch_us(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int iterations,
                        bool flush_l2) {
  constexpr size_t kFlushBytes = size_t(256) << 20;  // well above the H200's 50 MB L2
  void* flush = nullptr;
  if (flush_l2) SPARROW_CUDA_CHECK(cudaMalloc(&flush, kFlushBytes));
  cudaEvent_t start, stop;
  SPARROW_CUDA_CHECK(cudaEventCreate(&start));
  SPARROW_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(stream);  // warm-up: module load, first-touch
  std::vector<float> times;
  for (int i = 0; i < std::max(iterations, 1); ++i) {
    if (flush) SPARROW_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, kFlushBytes, stream));
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
