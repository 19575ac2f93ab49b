// bench_kda: Kimi Delta Attention's recurrent decode (kda_delta_rule with one token per sequence) and its
// token-serial prefill, at Kimi K3.1 Pro's KDA shape: head_dim 128, and the heads one GPU holds (96 / 8 =
// 12 under TP8, and all 96 on one GPU).
//
// Bytes (minimum HBM traffic of decode): each sequence's state [heads, 128, 128] fp32 read and written once
// (2 x 64 KB per head), plus q, k, v, g (fp32 [heads, 128] each), beta and the output. FLOPs: per token and
// head, the decay, S^T k, the rank-1 update and S^T q: about 4 * 128 * 128 multiply-adds (8 * 128^2 FLOPs).
// Prefill reads and writes the state once per sequence but walks its tokens one after the other, so its
// row reports tokens per second next to the same bytes and FLOPs.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kda/kda.h"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {

void bench_kda(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);

namespace {

constexpr int kHeadDim = 128;

// Random inputs in the ranges the model produces: q, k, v in [-1, 1] (normalised by the kernel), decay
// g in (-1, 0], beta in (0, 1).
__global__ void fill_kernel(float* p, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = offset + scale * hash_unit(seed ^ uint64_t(i));
}

float* device_floats(int64_t n, uint64_t seed, float scale, float offset, cudaStream_t stream) {
  float* p = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&p, size_t(std::max<int64_t>(n, 1)) * sizeof(float)));
  fill_kernel<<<1024, 256, 0, stream>>>(p, n, seed, scale, offset);
  SPARROW_CUDA_CHECK_LAUNCH();
  return p;
}

}  // namespace

void bench_kda(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("kda_delta_rule").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::vector<int> head_counts = {12, 96};
  const std::vector<int> batches = options.quick ? std::vector<int>{64} : std::vector<int>{1, 8, 64, 128};
  const std::vector<int> prompts = options.quick ? std::vector<int>{} : std::vector<int>{8192};
  for (int heads : head_counts) {
    const int64_t width = int64_t(heads) * kHeadDim, state_floats = width * kHeadDim;
    // Decode: one token per sequence.
    for (int batch : batches) {
      const int64_t tokens = batch;
      float* qkv = device_floats(tokens * 3 * width, 1, 1.0f, 0.0f, stream);
      float* g = device_floats(tokens * width, 2, 0.05f, -0.05f, stream);
      float* beta = device_floats(tokens * heads, 3, 0.4f, 0.5f, stream);
      float* out = device_floats(tokens * width, 4, 0.0f, 0.0f, stream);
      float* states = device_floats(int64_t(batch) * state_floats, 5, 0.01f, 0.0f, stream);
      std::vector<float*> state_ptrs(batch);
      std::vector<int32_t> offsets(batch + 1);
      for (int b = 0; b < batch; ++b) state_ptrs[b] = states + int64_t(b) * state_floats, offsets[b] = b;
      offsets[batch] = batch;
      float** d_ptrs = nullptr;
      int32_t* d_offsets = nullptr;
      SPARROW_CUDA_CHECK(cudaMalloc(&d_ptrs, batch * sizeof(float*)));
      SPARROW_CUDA_CHECK(cudaMalloc(&d_offsets, (batch + 1) * sizeof(int32_t)));
      SPARROW_CUDA_CHECK(cudaMemcpy(d_ptrs, state_ptrs.data(), batch * sizeof(float*), cudaMemcpyHostToDevice));
      SPARROW_CUDA_CHECK(cudaMemcpy(d_offsets, offsets.data(), (batch + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
      auto launch = [&](cudaStream_t s) {
        const KdaSequences seqs{d_offsets, d_offsets + 1, reinterpret_cast<uint8_t* const*>(d_ptrs), batch, 1};
        kda_delta_rule(qkv, qkv + width, qkv + 2 * width, 3 * width, g, beta, out, heads, kHeadDim, true, seqs, 0, s);
      };
      KernelBenchRow row;
      row.kernel = "kda_delta_rule";
      row.shape = "kimi_k3.1_pro heads=" + std::to_string(heads) + " d=128 decode batch=" + std::to_string(batch);
      row.median_us = median_launch_us(launch, stream, options.iterations);
      row.bytes = double(batch) * state_floats * 4 * 2 + double(tokens) * (5 * width + heads) * 4;
      row.flops = 8.0 * kHeadDim * kHeadDim * heads * double(tokens);
      row.note = "fp32 state in registers, one CTA per (sequence, head, 32 value columns)";
      rows.push_back(row);
      SPARROW_CUDA_CHECK(cudaFree(qkv));
      SPARROW_CUDA_CHECK(cudaFree(g));
      SPARROW_CUDA_CHECK(cudaFree(beta));
      SPARROW_CUDA_CHECK(cudaFree(out));
      SPARROW_CUDA_CHECK(cudaFree(states));
      SPARROW_CUDA_CHECK(cudaFree(d_ptrs));
      SPARROW_CUDA_CHECK(cudaFree(d_offsets));
    }
    // Prefill: one sequence of `count` tokens (token-serial: the chunk-parallel form is not built yet).
    for (int count : prompts) {
      float* qkv = device_floats(int64_t(count) * 3 * width, 6, 1.0f, 0.0f, stream);
      float* g = device_floats(int64_t(count) * width, 7, 0.05f, -0.05f, stream);
      float* beta = device_floats(int64_t(count) * heads, 8, 0.4f, 0.5f, stream);
      float* out = device_floats(int64_t(count) * width, 9, 0.0f, 0.0f, stream);
      float* state = device_floats(state_floats, 10, 0.0f, 0.0f, stream);
      const int32_t offsets[2] = {0, count};
      float** d_ptrs = nullptr;
      int32_t* d_offsets = nullptr;
      SPARROW_CUDA_CHECK(cudaMalloc(&d_ptrs, sizeof(float*)));
      SPARROW_CUDA_CHECK(cudaMalloc(&d_offsets, 2 * sizeof(int32_t)));
      SPARROW_CUDA_CHECK(cudaMemcpy(d_ptrs, &state, sizeof(float*), cudaMemcpyHostToDevice));
      SPARROW_CUDA_CHECK(cudaMemcpy(d_offsets, offsets, 2 * sizeof(int32_t), cudaMemcpyHostToDevice));
      auto launch = [&](cudaStream_t s) {
        const KdaSequences seqs{d_offsets, d_offsets + 1, reinterpret_cast<uint8_t* const*>(d_ptrs), 1, count};
        kda_delta_rule(qkv, qkv + width, qkv + 2 * width, 3 * width, g, beta, out, heads, kHeadDim, true, seqs, 0, s);
      };
      KernelBenchRow row;
      row.kernel = "kda_delta_rule";
      row.shape = "kimi_k3.1_pro heads=" + std::to_string(heads) + " d=128 prefill tokens=" + std::to_string(count);
      row.median_us = median_launch_us(launch, stream, std::max(3, options.iterations / 4));
      row.bytes = double(state_floats) * 4 * 2 + double(count) * (5 * width + heads) * 4;
      row.flops = 8.0 * kHeadDim * kHeadDim * heads * double(count);
      row.note = "token-serial prefill (the chunk-parallel form is next)";
      rows.push_back(row);
      SPARROW_CUDA_CHECK(cudaFree(qkv));
      SPARROW_CUDA_CHECK(cudaFree(g));
      SPARROW_CUDA_CHECK(cudaFree(beta));
      SPARROW_CUDA_CHECK(cudaFree(out));
      SPARROW_CUDA_CHECK(cudaFree(state));
      SPARROW_CUDA_CHECK(cudaFree(d_ptrs));
      SPARROW_CUDA_CHECK(cudaFree(d_offsets));
    }
  }
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
