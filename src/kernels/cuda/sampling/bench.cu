// bench_sampling (kernel_bench.h): draw_tokens on the real vocabularies (DeepSeek-V3.2 129280, Kimi
// 163840), 1 / 64 / 256 rows, for greedy, the usual serving cut (temperature 0.7, top-k 50, top-p 0.9)
// and a top-p-only draw (0.95, the large-set path). Logits: sums of four uniforms scaled to a standard
// deviation near 2.3, LLM-like. Bytes: the logits read once + the draws read + the tokens written.
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "core/device/cuda_check.h"
#include "kernels/cuda/sampling/sampling.h"

namespace sparrow::cuda {
namespace {

__global__ void fill_logits(float* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0;
    for (int j = 0; j < 4; ++j) s += hash_unit(uint64_t(i) * 4 + j);
    p[i] = 2.0f * s;
  }
}

}  // namespace

void bench_sampling(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("sampling").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Vocab {
    const char* model;
    int64_t size;
  };
  const std::vector<Vocab> vocabs = options.quick ? std::vector<Vocab>{{"deepseek_v3.2", 129280}}
                                                  : std::vector<Vocab>{{"deepseek_v3.2", 129280}, {"kimi", 163840}};
  const std::vector<int64_t> batches = options.quick ? std::vector<int64_t>{64} : std::vector<int64_t>{1, 64, 256};
  struct Setting {
    const char* name;
    TokenDraw draw;
  };
  std::vector<Setting> settings(3);
  settings[0].name = "greedy";
  settings[0].draw.temperature = 0.0f;
  settings[1].name = "t=0.7 top_k=50 top_p=0.9";
  settings[1].draw.temperature = 0.7f;
  settings[1].draw.top_k = 50;
  settings[1].draw.top_p = 0.9f;
  settings[2].name = "t=1 top_p=0.95";
  settings[2].draw.top_p = 0.95f;
  const int64_t max_rows = 256, max_vocab = 163840;
  float* logits = nullptr;
  TokenDraw* draws = nullptr;
  int32_t* tokens = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&logits, max_rows * max_vocab * sizeof(float)));
  SPARROW_CUDA_CHECK(cudaMalloc(&draws, max_rows * sizeof(TokenDraw)));
  SPARROW_CUDA_CHECK(cudaMalloc(&tokens, max_rows * sizeof(int32_t)));
  fill_logits<<<4096, 256, 0, stream>>>(logits, max_rows * max_vocab);
  SPARROW_CUDA_CHECK_LAUNCH();
  for (const Setting& setting : settings) {
    std::vector<TokenDraw> host(max_rows, setting.draw);
    for (int64_t r = 0; r < max_rows; ++r) host[r].key = 0x9E3779B97F4A7C15ull * uint64_t(r + 1);
    SPARROW_CUDA_CHECK(cudaMemcpyAsync(draws, host.data(), max_rows * sizeof(TokenDraw), cudaMemcpyHostToDevice, stream));
    SPARROW_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (const Vocab& v : vocabs)
      for (int64_t b : batches) {
        auto launch = [&](cudaStream_t s) { draw_tokens(logits, b, v.size, v.size, draws, tokens, s); };
        KernelBenchRow row;
        row.kernel = "sampling";
        row.shape = std::string(v.model) + " vocab=" + std::to_string(v.size) + " rows=" + std::to_string(b) + " " +
                    setting.name;
        row.impl = "sparrow";
        row.median_us = median_launch_us(launch, stream, options.iterations);
        row.bytes = double(b) * v.size * 4 + double(b) * (sizeof(TokenDraw) + 4);
        row.note = "exact (CPU reference's token): radix thresholds, Gumbel-max, one block per row";
        rows.push_back(row);
      }
  }
  SPARROW_CUDA_CHECK(cudaFree(logits));
  SPARROW_CUDA_CHECK(cudaFree(draws));
  SPARROW_CUDA_CHECK(cudaFree(tokens));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
