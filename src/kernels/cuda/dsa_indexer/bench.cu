// bench_dsa_indexer (kernel_bench.h): index scores on DeepSeek-V3.2 (64 index heads) and Kimi K3.1 Pro
// (32 index heads) shapes, for each index-key format the cache offers: FP8 (132 B a token), MXFP4 (68 B,
// the Kimi seed's index key) and NVFP4 (72 B). Decode (batch 1..128, 1 or 2 query tokens per sequence,
// contexts 8K..1M) and prefill of an 8K / 32K chunk against its causal prefix. Keys sit in a paged pool with
// pages in random order. Bytes: keys (132, 68 or 72 B per (sequence, token)) + FP8 queries and folded
// weights + scores written (fp32); FLOPs: 2 * heads * 128 per (query row, visible key). FP8 rows keep their
// shape names (the PyTorch peers match them); 4-bit rows add "keys=mxfp4" / "keys=nvfp4".
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/dsa_indexer/index_scores.h"
#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

// Pages of 64 tokens: value words (FP8: 2048 words of codes, bytes below 0x40 with random signs: finite,
// modest values; 4-bit: 1024 words of any e2m1 codes), then the scales: FP8 fp32 0.01; MXFP4 E8M0 bytes
// 120..130 (2^-7 .. 2^3); NVFP4 E4M3 bytes 0x28 .. 0x47 (0.156 .. 3.75).
__global__ void fill_pool(uint32_t* words, int64_t n, int page_words, int value_words, PageFormat format) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int w = int(i % page_words);
    uint32_t v;
    if (format == PageFormat::Fp8IndexKey) {
      v = w < value_words ? (hash32(i) & 0x3F3F3F3Fu) | (hash32(i * 7 + 1) & 0x80808080u) : 0x3C23D70Au;
    } else if (w < value_words) {
      v = hash32(i);
    } else {
      v = 0;
      for (int b = 0; b < 4; ++b) {
        const uint32_t h = hash32(i * 4 + b);
        v |= (format == PageFormat::Mxfp4Rows ? 120u + h % 11u : 0x28u + (h & 0x1Fu)) << (8 * b);
      }
    }
    words[i] = v;
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
  const std::vector<Model> models = {{"deepseek_v3.2", 64}, {"kimi_k3.1_pro", 32}};
  const std::vector<int64_t> ctxs =
      options.quick ? std::vector<int64_t>{131072} : std::vector<int64_t>{8192, 32768, 131072, 1048576};
  const std::vector<int> batches = options.quick ? std::vector<int>{8} : std::vector<int>{1, 8, 64, 128};
  const std::vector<int> qtoks = options.quick ? std::vector<int>{1} : std::vector<int>{1, 2};
  const std::vector<int64_t> chunks = options.quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 32768};
  const int64_t max_ctx = *std::max_element(ctxs.begin(), ctxs.end());
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t pages_per_seq = max_ctx / kBlock;
  const int64_t total_pages = pages_per_seq * max_batch;
  // One pool sized for the widest format (FP8), refilled and re-addressed for each format.
  uint8_t* pool = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&pool, total_pages * kBlock * int64_t(kDsaKeyPageBytes)));
  // Page table: every sequence's pages scattered over the pool (the same permutation for every format).
  std::vector<int64_t> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(1234);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t* table = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&table, total_pages * sizeof(int64_t)));

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

  for (const PageFormat format : {PageFormat::Fp8IndexKey, PageFormat::Mxfp4Rows, PageFormat::Nvfp4Rows}) {
    const int key_bytes = dsa_key_bytes(format);
    const int64_t page_bytes = int64_t(kBlock) * key_bytes;
    const int value_words = kBlock * (format == PageFormat::Fp8IndexKey ? 128 : 64) / 4;
    fill_pool<<<4096, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(pool), total_pages * page_bytes / 4,
                                        int(page_bytes / 4), value_words, format);
    SPARROW_CUDA_CHECK_LAUNCH();
    std::vector<int64_t> offsets(total_pages);
    for (int64_t i = 0; i < total_pages; ++i) offsets[i] = ids[i] * page_bytes;
    SPARROW_CUDA_CHECK(cudaMemcpy(table, offsets.data(), total_pages * sizeof(int64_t), cudaMemcpyHostToDevice));
    const bool fp8 = format == PageFormat::Fp8IndexKey;
    const std::string keys_field = fp8 ? "" : std::string(" keys=") + dsa_key_format_name(format);
    const std::string what = fp8 ? std::string("fp8 e4m3 keys (paged, bs 64)")
                                 : std::string(dsa_key_format_name(format)) + " keys (paged, bs 64, " +
                                       std::to_string(key_bytes) + " B)";
    const std::string product =
        format == PageFormat::Nvfp4Rows ? "keys widened to f16 in registers, f16 tensor cores (wgmma f16)"
        : fp8 ? "fp8 tensor cores (wgmma e4m3), cp.async pipeline"
              : "keys widened to e4m3 in registers, fp8 tensor cores (wgmma e4m3)";
    // The tiled kernel reads FP8 and MXFP4 keys.
    std::vector<DsaScoreKernel> kernels = {DsaScoreKernel::Wgmma};
    if (format != PageFormat::Nvfp4Rows) kernels.push_back(DsaScoreKernel::Tiles);

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
            for (const DsaScoreKernel kernel : kernels) {
              auto launch = [&](cudaStream_t s) {
                dsa_index_scores(q8, wf, nrows, m.heads, row_seq, row_vis, pool, table, pages_per_seq, kBlock, format,
                                 scores, ctx, ctx, s, kernel, q);
              };
              KernelBenchRow row;
              row.kernel = "dsa_index_scores";
              row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + " ctx=" + std::to_string(ctx) +
                          " batch=" + std::to_string(batch) + " q=" + std::to_string(q) + keys_field;
              const bool wgmma = kernel == DsaScoreKernel::Wgmma;
              row.impl = wgmma ? "sparrow" : "sparrow-tiles";
              row.median_us = median_launch_us(launch, stream, options.iterations);
              row.bytes = double(batch) * ctx * key_bytes + double(nrows) * m.heads * (128 + 4) +
                          double(nrows) * ctx * 4;
              row.flops = 2.0 * m.heads * 128 * double(nrows) * ctx;
              row.fp8_products = wgmma && format != PageFormat::Nvfp4Rows;  // `product` above says which
              row.note = wgmma ? what + " and fp8 queries, fp32 scores; " + product
                               : what + " with the tiled kernel (emulated e4m3 mma.sync; FP8 prefill's kernel)";
              rows.push_back(row);
            }
          }
    }
    SPARROW_CUDA_CHECK(cudaFree(scores));

    // Prefill: one sequence, a chunk of C tokens that is the whole context, rows see their causal prefix.
    // Auto's kernel (FP8: tiled; 4-bit: wgmma, rows in pairs), and MXFP4's tiled kernel beside it.
    for (const Model& m : models)
      for (int64_t chunk : chunks) {
        std::vector<int32_t> hs(chunk, 0), hv(chunk);
        for (int64_t i = 0; i < chunk; ++i) hv[i] = int32_t(i + 1);
        SPARROW_CUDA_CHECK(cudaMemcpy(row_seq, hs.data(), chunk * 4, cudaMemcpyHostToDevice));
        SPARROW_CUDA_CHECK(cudaMemcpy(row_vis, hv.data(), chunk * 4, cudaMemcpyHostToDevice));
        float* ps = nullptr;
        SPARROW_CUDA_CHECK(cudaMalloc(&ps, chunk * chunk * sizeof(float)));
        std::vector<DsaScoreKernel> prefill_kernels = {DsaScoreKernel::Auto};
        if (format == PageFormat::Mxfp4Rows) prefill_kernels.push_back(DsaScoreKernel::Tiles);
        for (const DsaScoreKernel kernel : prefill_kernels) {
          // Rows in pairs for 4-bit keys, as the model asks for prefill chunks (model/dsa_indexer.cpp).
          auto launch = [&](cudaStream_t s) {
            dsa_index_scores(q8, wf, chunk, m.heads, row_seq, row_vis, pool, table, pages_per_seq, kBlock, format, ps,
                             chunk, chunk, s, kernel, fp8 ? 1 : 2);
          };
          KernelBenchRow row;
          row.kernel = "dsa_index_scores";
          row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) +
                      " prefill chunk=" + std::to_string(chunk) + keys_field;
          row.impl = kernel == DsaScoreKernel::Auto ? "sparrow" : "sparrow-tiles";
          row.median_us = median_launch_us(launch, stream, std::max(3, options.iterations / 4));
          row.bytes = double(chunk) * key_bytes + double(chunk) * m.heads * (128 + 4) + double(chunk) * chunk * 4;
          row.flops = 2.0 * m.heads * 128 * (double(chunk) * (chunk + 1) / 2);
          row.fp8_products = !fp8 && kernel == DsaScoreKernel::Auto && format != PageFormat::Nvfp4Rows;  // wgmma e4m3
          row.note = "causal; full [chunk, chunk] fp32 scores written (-inf above the diagonal); " + what +
                     (fp8 ? "; tiled kernel (emulated e4m3 mma.sync)"
                          : kernel == DsaScoreKernel::Auto ? "; wgmma kernel, rows in pairs, " + product
                                                           : "; tiled kernel (emulated e4m3 mma.sync)");
          rows.push_back(row);
        }
        SPARROW_CUDA_CHECK(cudaFree(ps));
      }
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
