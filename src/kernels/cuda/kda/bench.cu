// bench_kda: Kimi Delta Attention's delta rule at Kimi K3.1 Pro's KDA shape: head_dim 128, and the heads one
// GPU holds (96 / 8 = 12 under TP8, and all 96 on one GPU).
//
// Decode (kda_delta_rule, one token per sequence). Bytes (minimum HBM traffic): each sequence's state
// [heads, 128, 128] fp32 read and written once (2 x 64 KB per head), plus q, k, v, g (fp32 [heads, 128]
// each), beta and the output. FLOPs: per token and head, the decay, S^T k, the rank-1 update and S^T q:
// about 4 * 128 * 128 multiply-adds (8 * 128^2 FLOPs). Beside it, on the same rows: the token-serial kernel
// (impl "sparrow-token_serial", what decode ran before the decode kernel) and a cudaMemcpyAsync of the states
// alone (impl "cudaMemcpyAsync", bytes = the state read and written: the bandwidth ceiling at that size).
//
// Prefill (one sequence of 8K, 32K, 128K tokens, and 8 sequences of 8K): kda_delta_rule_chunked (impl
// "sparrow") and, at 8K, the token-serial kda_delta_rule (impl "sparrow-token_serial") on the same inputs.
// Bytes: q, k, v, g read (fp32 [T, heads, 128] each), beta read, the output written, and each sequence's
// state read and written once. FLOPs of the chunk form, per chunk of C = 64 tokens and head (D = 128), in
// multiply-adds: K K^T and Q K^T below the diagonal (C^2 D / 2 each), the triangular inverse (C^3 / 6),
// W = T (beta exp(G) K) and U = T (beta V) (C^2 D / 2 each), W S and exp(G) Q S (C D^2 each), Aqk Vn
// (C^2 D / 2) and the state update K^T Vn (C D^2): per token 2.5 C D + 3 D^2 + C^2 / 6 = 70315
// multiply-adds, 140.6 kFLOP per token and head. The kernels do more than that (whole 16x16 tiles, the
// output's state-free part folded through M = Aqk T); the count is the form's, not the implementation's.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kda/kda.h"
#include "kernels/cuda/kernel_bench.h"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {

void bench_kda(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);

namespace {

constexpr int kHeadDim = 128;
constexpr int kChunk = 64;

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

// Multiply-adds of the chunk form per token and head (see the top of this file).
constexpr double kChunkMacsPerToken =
    2.5 * kChunk * kHeadDim + 3.0 * kHeadDim * kHeadDim + double(kChunk) * kChunk / 6.0;

// Prefill of `batch` sequences of `count` tokens each: the chunked kernel, and the token-serial one when
// `serial`.
void bench_prefill(const KernelBenchOptions& options, int heads, int batch, int count, bool serial,
                   cudaStream_t stream, std::vector<KernelBenchRow>& rows) {
  const int64_t width = int64_t(heads) * kHeadDim, state_floats = width * kHeadDim;
  const int64_t tokens = int64_t(batch) * count;
  float* qkv = device_floats(tokens * 3 * width, 6, 1.0f, 0.0f, stream);
  float* g = device_floats(tokens * width, 7, 0.05f, -0.05f, stream);
  float* beta = device_floats(tokens * heads, 8, 0.4f, 0.5f, stream);
  float* out = device_floats(tokens * width, 9, 0.0f, 0.0f, stream);
  float* states = device_floats(batch * state_floats, 10, 0.01f, 0.0f, stream);
  std::vector<uint8_t*> slots(batch);
  std::vector<int32_t> offsets(batch + 1);
  for (int b = 0; b < batch; ++b) {
    slots[b] = reinterpret_cast<uint8_t*>(states + b * state_floats);
    offsets[b] = int32_t(int64_t(b) * count);
  }
  offsets[batch] = int32_t(tokens);
  uint8_t** d_slots = nullptr;
  int32_t* d_offsets = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&d_slots, batch * sizeof(uint8_t*)));
  SPARROW_CUDA_CHECK(cudaMalloc(&d_offsets, (batch + 1) * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMemcpy(d_slots, slots.data(), batch * sizeof(uint8_t*), cudaMemcpyHostToDevice));
  SPARROW_CUDA_CHECK(cudaMemcpy(d_offsets, offsets.data(), (batch + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
  const KdaSequences seqs{d_offsets, d_offsets + 1, d_slots, batch, count};
  const size_t ws_bytes = kda_delta_rule_chunked_workspace_bytes(tokens, batch, heads, kHeadDim);
  void* workspace = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&workspace, ws_bytes));

  std::string shape = "kimi_k3.1_pro heads=" + std::to_string(heads) + " d=128 prefill tokens=" + std::to_string(count);
  if (batch > 1) shape += " batch=" + std::to_string(batch);
  const double bytes = double(tokens) * (5 * width + heads) * 4 + double(batch) * state_floats * 4 * 2;
  const int iterations = std::max(3, options.iterations / 4);

  KernelBenchRow row;
  row.kernel = "kda_delta_rule";
  row.shape = shape;
  row.median_us = median_launch_us(
      [&](cudaStream_t s) {
        kda_delta_rule_chunked(qkv, qkv + width, qkv + 2 * width, 3 * width, g, beta, out, heads, kHeadDim, true,
                               seqs, 0, workspace, s);
      },
      stream, iterations);
  row.bytes = bytes;
  row.flops = 2.0 * kChunkMacsPerToken * double(tokens) * heads;
  row.note = "chunk-parallel (C=64): tf32 per-chunk prep + bf16 walk, fp32 state and sums; workspace " +
             std::to_string(ws_bytes >> 20) + " MiB";
  rows.push_back(row);

  if (serial) {
    KernelBenchRow srow;
    srow.kernel = "kda_delta_rule";
    srow.shape = shape;
    srow.impl = "sparrow-token_serial";
    srow.median_us = median_launch_us(
        [&](cudaStream_t s) {
          kda_delta_rule(qkv, qkv + width, qkv + 2 * width, 3 * width, g, beta, out, heads, kHeadDim, true, seqs, 0,
                         s);
        },
        stream, iterations);
    srow.bytes = bytes;
    srow.flops = 8.0 * kHeadDim * kHeadDim * heads * double(tokens);
    srow.note = "token-serial kda_delta_rule on the same inputs (FLOPs of the recurrence)";
    rows.push_back(srow);
  }

  SPARROW_CUDA_CHECK(cudaFree(workspace));
  SPARROW_CUDA_CHECK(cudaFree(qkv));
  SPARROW_CUDA_CHECK(cudaFree(g));
  SPARROW_CUDA_CHECK(cudaFree(beta));
  SPARROW_CUDA_CHECK(cudaFree(out));
  SPARROW_CUDA_CHECK(cudaFree(states));
  SPARROW_CUDA_CHECK(cudaFree(d_slots));
  SPARROW_CUDA_CHECK(cudaFree(d_offsets));
}

}  // namespace

void bench_kda(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("kda_delta_rule").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::vector<int> head_counts = {12, 96};
  const std::vector<int> batches = options.quick ? std::vector<int>{64} : std::vector<int>{1, 8, 64, 128};
  const std::vector<int> prompts = options.quick ? std::vector<int>{8192} : std::vector<int>{8192, 32768, 131072};
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
      // max_count 1 takes the decode kernel; max_count 2 (the same rows) the token-serial one, for comparison.
      auto launch_with = [&](int64_t max_count) {
        return [=](cudaStream_t s) {
          const KdaSequences seqs{d_offsets, d_offsets + 1, reinterpret_cast<uint8_t* const*>(d_ptrs), batch,
                                  max_count};
          kda_delta_rule(qkv, qkv + width, qkv + 2 * width, 3 * width, g, beta, out, heads, kHeadDim, true, seqs, 0,
                         s);
        };
      };
      const std::string shape =
          "kimi_k3.1_pro heads=" + std::to_string(heads) + " d=128 decode batch=" + std::to_string(batch);
      const double bytes = double(batch) * state_floats * 4 * 2 + double(tokens) * (5 * width + heads) * 4;
      const double flops = 8.0 * kHeadDim * kHeadDim * heads * double(tokens);
      KernelBenchRow row;
      row.kernel = "kda_delta_rule";
      row.shape = shape;
      row.median_us = median_launch_us(launch_with(1), stream, options.iterations);
      row.bytes = bytes;
      row.flops = flops;
      row.note = "decode kernel: fp32 state slice in registers, 16-byte loads issued first";
      rows.push_back(row);
      if (!options.quick) {
        KernelBenchRow srow = row;
        srow.impl = "sparrow-token_serial";
        srow.median_us = median_launch_us(launch_with(2), stream, options.iterations);
        srow.note = "the token-serial kda_delta_rule on the same rows (what decode ran before)";
        rows.push_back(srow);
        // The copy ceiling at this size: the state's bytes read and written by cudaMemcpyAsync, nothing else.
        float* copy = nullptr;
        SPARROW_CUDA_CHECK(cudaMalloc(&copy, size_t(batch) * state_floats * sizeof(float)));
        KernelBenchRow crow = row;
        crow.impl = "cudaMemcpyAsync";
        crow.median_us = median_launch_us(
            [&](cudaStream_t s) {
              SPARROW_CUDA_CHECK(cudaMemcpyAsync(copy, states, size_t(batch) * state_floats * sizeof(float),
                                                 cudaMemcpyDeviceToDevice, s));
            },
            stream, options.iterations);
        crow.bytes = double(batch) * state_floats * 4 * 2;
        crow.flops = 0;
        crow.note = "device-to-device copy of the states alone (the bandwidth ceiling at this size)";
        rows.push_back(crow);
        SPARROW_CUDA_CHECK(cudaFree(copy));
      }
      SPARROW_CUDA_CHECK(cudaFree(qkv));
      SPARROW_CUDA_CHECK(cudaFree(g));
      SPARROW_CUDA_CHECK(cudaFree(beta));
      SPARROW_CUDA_CHECK(cudaFree(out));
      SPARROW_CUDA_CHECK(cudaFree(states));
      SPARROW_CUDA_CHECK(cudaFree(d_ptrs));
      SPARROW_CUDA_CHECK(cudaFree(d_offsets));
    }
    // Prefill: one long sequence (the token-serial kernel too at 8K, where it takes milliseconds, not
    // seconds), then a batch of 8 sequences of 8K.
    for (int count : prompts) bench_prefill(options, heads, 1, count, !options.quick && count == 8192, stream, rows);
    if (!options.quick) bench_prefill(options, heads, 8, 8192, false, stream, rows);
  }
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
