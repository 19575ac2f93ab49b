// bench_topk (kernel_bench.h): top-2048 of rows of 8K .. 1M fp32 scores, batch 1 .. 128, scores drawn
// from a normal-like distribution. Bytes: the scores read once + the indices written.
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/kernel_bench.h"
#include "core/device/cuda_check.h"
#include "kernels/cuda/topk/topk.h"
#include "kernels/cuda/topk/topk_registers.cuh"
#include "kernels/cuda/topk/topk_sampled.cuh"

namespace sparrow::cuda {
namespace {

__global__ void fill_scores(float* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = uint64_t(i) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    // Sum of four uniforms: roughly normal, few exact ties.
    float s = 0;
    for (int j = 0; j < 4; ++j) s += float((x >> (16 * j)) & 0xffff) / 65536.0f;
    p[i] = s - 2.0f;
  }
}

__global__ void fill_lengths(int32_t* p, int64_t n, int32_t v) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}

}  // namespace

void bench_topk(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("topk").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int k = 2048;
  const std::vector<int64_t> lens =
      options.quick ? std::vector<int64_t>{131072} : std::vector<int64_t>{8192, 32768, 131072, 1048576};
  const std::vector<int64_t> batches = options.quick ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 8, 64, 128};
  const int64_t max_elems = 128 * int64_t(1048576);
  float* scores = nullptr;
  int32_t *lengths = nullptr, *out = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&scores, max_elems * sizeof(float)));
  SPARROW_CUDA_CHECK(cudaMalloc(&lengths, 128 * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMalloc(&out, 128 * k * sizeof(int32_t)));
  fill_scores<<<4096, 256, 0, stream>>>(scores, max_elems);
  SPARROW_CUDA_CHECK_LAUNCH();
  for (int64_t len : lens)
    for (int64_t b : batches) {
      fill_lengths<<<1, 128, 0, stream>>>(lengths, b, int32_t(len));
      SPARROW_CUDA_CHECK_LAUNCH();
      // Auto ("sparrow") and each method on its own ("sparrow-<method>": a variant in kernels.md).
      const std::pair<TopkMethod, const char*> methods[] = {{TopkMethod::Auto, "sparrow"},
                                                            {TopkMethod::RadixPasses, "sparrow-radix"},
                                                            {TopkMethod::StreamingFilter, "sparrow-stream"},
                                                            {TopkMethod::SampledThreshold, "sparrow-sampled"},
                                                            {TopkMethod::RegisterRadix, "sparrow-registers"}};
      for (const auto& [method, impl] : methods) {
        if (method == TopkMethod::SampledThreshold && !topk_sampled::supports(len)) continue;
        if (method == TopkMethod::RegisterRadix && !topk_registers::supports(len)) continue;
        const size_t wsb = topk_workspace_bytes(b, len, k, method);
        void* ws = nullptr;
        if (wsb) SPARROW_CUDA_CHECK(cudaMalloc(&ws, wsb));
        auto launch = [&](cudaStream_t s) { topk_rows(scores, len, lengths, b, len, k, out, ws, wsb, s, method); };
        KernelBenchRow row;
        row.kernel = "topk";
        row.shape = "rows=" + std::to_string(b) + " len=" + std::to_string(len) + " k=" + std::to_string(k);
        row.impl = impl;
        row.median_us = median_launch_us(launch, stream, options.iterations);
        row.bytes = double(b) * len * 4 + double(b) * k * 4;
        row.note = "exact, ties to the smaller index, indices ascending";
        rows.push_back(row);
        if (ws) SPARROW_CUDA_CHECK(cudaFree(ws));
      }
    }
  SPARROW_CUDA_CHECK(cudaFree(scores));
  SPARROW_CUDA_CHECK(cudaFree(lengths));
  SPARROW_CUDA_CHECK(cudaFree(out));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
