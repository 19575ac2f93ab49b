// bench_dsa_indexer (kernel_bench.h): index scores on DeepSeek-V3.2 (64 index heads) and Kimi K3.1 Pro
// (32 index heads) shapes: decode (batch 1..128, 1 or 2 query tokens per sequence, contexts 8K..1M)
// and prefill of an 8K / 32K chunk against its causal prefix. Keys sit in a paged FP8 pool with pages
// in random order. Bytes: keys 132 B per (sequence, token) + FP8 queries and folded weights + scores
// written (fp32); FLOPs: 2 * heads * 128 per (query row, visible key).
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/dsa_indexer/index_scores.h"
#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {
namespace {

// Pages of 64 tokens: 2048 words of codes (bytes below 0x40: finite, modest values), then 64 scales.
__global__ void fill_pool(uint32_t* words, int64_t n, int page_words, int value_words) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int w = int(i % page_words);
    words[i] = w < value_words ? (hash32(i) & 0x3F3F3F3Fu) | (hash32(i * 7 + 1) & 0x80808080u) : 0x3C23D70Au;
  }
}

__global__ void fill_bytes(uint8_t* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t((hash32(i + 12345) & 0x3F) | (i & 1 ? 0x80 : 0));
}

__global__ void fill_floats(float* p, int64_t n, float v) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v * (1.0f + float(hash32(i) & 0xff) / 256.0f);
}

struct Model {
  const char* name;
  int heads;
};

}  // namespace

void bench_dsa_indexer(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("dsa_index_scores").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kBlock = 64;
  const int64_t page_bytes = int64_t(kBlock) * kDsaKeyPageBytes;
  const std::vector<Model> models = {{"deepseek_v3.2", 64}, {"kimi_k3.1_pro", 32}};
  const std::vector<int64_t> ctxs =
      options.quick ? std::vector<int64_t>{131072} : std::vector<int64_t>{8192, 32768, 131072, 1048576};
  const std::vector<int> batches = options.quick ? std::vector<int>{8} : std::vector<int>{1, 8, 64, 128};
  const std::vector<int> qtoks = options.quick ? std::vector<int>{1} : std::vector<int>{1, 2};
  const int64_t max_ctx = *std::max_element(ctxs.begin(), ctxs.end());
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t pages_per_seq = max_ctx / kBlock;
  const int64_t total_pages = pages_per_seq * max_batch;
  uint8_t* pool = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&pool, total_pages * page_bytes));
  fill_pool<<<4096, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(pool), total_pages * page_bytes / 4,
                                      int(page_bytes / 4), kBlock * 128 / 4);
  SPARROW_CUDA_CHECK_LAUNCH();
  // Page table: every sequence's pages scattered over the pool.
  std::vector<int64_t> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(1234);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (auto& id : ids) id *= page_bytes;
  int64_t* table = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&table, total_pages * sizeof(int64_t)));
  SPARROW_CUDA_CHECK(cudaMemcpy(table, ids.data(), total_pages * sizeof(int64_t), cudaMemcpyHostToDevice));

  const int64_t max_rows = std::max<int64_t>(int64_t(max_batch) * 2, options.quick ? 8192 : 32768);
  uint8_t* q8 = nullptr;
  float* wf = nullptr;
  int32_t *row_seq = nullptr, *row_vis = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&q8, max_rows * 64 * 128));
  SPARROW_CUDA_CHECK(cudaMalloc(&wf, max_rows * 64 * sizeof(float)));
  SPARROW_CUDA_CHECK(cudaMalloc(&row_seq, max_rows * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMalloc(&row_vis, max_rows * sizeof(int32_t)));
  fill_bytes<<<1024, 256, 0, stream>>>(q8, max_rows * 64 * 128);
  fill_floats<<<1024, 256, 0, stream>>>(wf, max_rows * 64, 0.01f);
  SPARROW_CUDA_CHECK_LAUNCH();
  float* scores = nullptr;
  const int64_t decode_score_floats = int64_t(max_batch) * 2 * max_ctx;
  SPARROW_CUDA_CHECK(cudaMalloc(&scores, decode_score_floats * sizeof(float)));

  for (const Model& m : models) {
    for (int64_t ctx : ctxs)
      for (int batch : batches)
        for (int q : qtoks) {
          const int64_t nrows = int64_t(batch) * q;
          std::vector<int32_t> hs(nrows), hv(nrows);
          for (int b = 0; b < batch; ++b)
            for (int j = 0; j < q; ++j) hs[b * q + j] = b, hv[b * q + j] = int32_t(ctx - q + 1 + j);
          SPARROW_CUDA_CHECK(cudaMemcpy(row_seq, hs.data(), nrows * 4, cudaMemcpyHostToDevice));
          SPARROW_CUDA_CHECK(cudaMemcpy(row_vis, hv.data(), nrows * 4, cudaMemcpyHostToDevice));
          // The kernel Auto picks for decode (wgmma), and the tiled mma.sync kernel beside it.
          for (const DsaScoreKernel kernel : {DsaScoreKernel::Wgmma, DsaScoreKernel::Tiles}) {
            auto launch = [&](cudaStream_t s) {
              dsa_index_scores(q8, wf, nrows, m.heads, row_seq, row_vis, pool, table, pages_per_seq, kBlock, scores,
                               ctx, ctx, s, kernel, q);
            };
            KernelBenchRow row;
            row.kernel = "dsa_index_scores";
            row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + " ctx=" + std::to_string(ctx) +
                        " batch=" + std::to_string(batch) + " q=" + std::to_string(q);
            const bool wgmma = kernel == DsaScoreKernel::Wgmma;
            row.impl = wgmma ? "sparrow" : "sparrow-tiles";
            row.median_us = median_launch_us(launch, stream, options.iterations);
            row.bytes = double(batch) * ctx * kDsaKeyPageBytes + double(nrows) * m.heads * (128 + 4) +
                        double(nrows) * ctx * 4;
            row.flops = 2.0 * m.heads * 128 * double(nrows) * ctx;
            row.note = wgmma ? "fp8 e4m3 keys (paged, bs 64) and queries, fp32 scores; fp8 tensor cores (wgmma e4m3), cp.async pipeline"
                             : "the same with the tiled kernel (emulated e4m3 mma.sync; prefill's kernel)";
            rows.push_back(row);
          }
        }
  }
  SPARROW_CUDA_CHECK(cudaFree(scores));

  // Prefill: one sequence, a chunk of C tokens that is the whole context, rows see their causal prefix.
  const std::vector<int64_t> chunks = options.quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 32768};
  for (const Model& m : models)
    for (int64_t chunk : chunks) {
      std::vector<int32_t> hs(chunk, 0), hv(chunk);
      for (int64_t i = 0; i < chunk; ++i) hv[i] = int32_t(i + 1);
      SPARROW_CUDA_CHECK(cudaMemcpy(row_seq, hs.data(), chunk * 4, cudaMemcpyHostToDevice));
      SPARROW_CUDA_CHECK(cudaMemcpy(row_vis, hv.data(), chunk * 4, cudaMemcpyHostToDevice));
      float* ps = nullptr;
      SPARROW_CUDA_CHECK(cudaMalloc(&ps, chunk * chunk * sizeof(float)));
      auto launch = [&](cudaStream_t s) {
        dsa_index_scores(q8, wf, chunk, m.heads, row_seq, row_vis, pool, table, pages_per_seq, kBlock, ps, chunk,
                         chunk, s);
      };
      KernelBenchRow row;
      row.kernel = "dsa_index_scores";
      row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + " prefill chunk=" + std::to_string(chunk);
      row.impl = "sparrow";
      row.median_us = median_launch_us(launch, stream, std::max(3, options.iterations / 4));
      row.bytes = double(chunk) * kDsaKeyPageBytes + double(chunk) * m.heads * (128 + 4) + double(chunk) * chunk * 4;
      row.flops = 2.0 * m.heads * 128 * (double(chunk) * (chunk + 1) / 2);
      row.note = "causal; full [chunk, chunk] fp32 scores written (-inf above the diagonal)";
      rows.push_back(row);
      SPARROW_CUDA_CHECK(cudaFree(ps));
    }

  SPARROW_CUDA_CHECK(cudaFree(q8));
  SPARROW_CUDA_CHECK(cudaFree(wf));
  SPARROW_CUDA_CHECK(cudaFree(row_seq));
  SPARROW_CUDA_CHECK(cudaFree(row_vis));
  SPARROW_CUDA_CHECK(cudaFree(table));
  SPARROW_CUDA_CHECK(cudaFree(pool));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
