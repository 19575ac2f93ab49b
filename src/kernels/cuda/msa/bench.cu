// bench_msa (kernel_bench.h): MiniMax-M3.1's MSA block selection (4 index heads per GPU under TP4, dim
// 128, index blocks of 128 keys, top-16, 1 forced local block): decode (one query token per sequence,
// batch 1..128, contexts 8K..512K) and prefill of a 4K / 8K chunk against its causal prefix. Keys sit in
// a paged pool (64-token pages in random order) in each key format (indexer_kv_dtype; shape tag keys=):
// bf16 (256 B a token), FP8 E4M3 (128 B), NVFP4 (64 B of E2M1 codes + 8 E4M3 scales = 72 B, the MiniMax
// seed's index keys) and MXFP4 (64 + 4 E8M0 scales = 68 B). Narrow pools hold E4M3 codes of values in
// [-1, 1) in every byte (valid FP8 values, E2M1 code pairs and finite NVFP4 / MXFP4 scales). Bytes: the
// format's key bytes per (sequence, visible key) + queries (bf16) + the kept ids and counts written; the
// block scores' round trip through the workspace (L2-sized for decode) is not counted. FLOPs: 2 * heads *
// 128 per (query row, visible key).
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/msa/msa.h"
#include "kernels/cuda/quant/fp4.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

constexpr int kHeads = 4, kDim = 128, kIndexBlock = 128, kTopk = 16, kLocal = 1;

// bf16 values uniform in [-1, 1) (the top 16 bits of the float).
__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t salt) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint16_t(__float_as_uint(hash_unit(uint64_t(i) * 0x9E3779B97F4A7C15ull + salt)) >> 16);
}

// E4M3 codes of values uniform in [-1, 1) (no NaN codes, as written keys have none): FP8 keys, and FP4 codes
// and scales.
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint64_t salt) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = quant::e4m3_encode(hash_unit(uint64_t(i) * 0x9E3779B97F4A7C15ull + salt));
}

}  // namespace

void bench_msa(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("msa_select_blocks").find(options.filter) == std::string::npos) return;
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kBlock = 64;
  const int64_t page_bytes = int64_t(kBlock) * kDim * 2;  // bf16 pages (FP8 pages are half as large)
  const std::vector<int64_t> ctxs =
      options.quick ? std::vector<int64_t>{131072} : std::vector<int64_t>{8192, 32768, 131072, 524288};
  const std::vector<int> batches = options.quick ? std::vector<int>{8} : std::vector<int>{1, 8, 64, 128};
  const int64_t max_ctx = *std::max_element(ctxs.begin(), ctxs.end());
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t pages_per_seq = max_ctx / kBlock;
  const int64_t total_pages = pages_per_seq * max_batch;  // 16 GiB at 512K x 128
  // One pool, refilled per key format; a page table per format (page ids in the same random order).
  uint8_t* pool = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&pool, total_pages * page_bytes));
  std::vector<int64_t> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(1234);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t* table = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&table, total_pages * sizeof(int64_t)));

  const std::vector<int64_t> chunks = options.quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 8192};
  const int64_t max_rows = std::max<int64_t>(max_batch, *std::max_element(chunks.begin(), chunks.end()));
  uint16_t* q = nullptr;
  int32_t *row_seq = nullptr, *row_pos = nullptr, *blocks = nullptr, *counts = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&q, max_rows * kHeads * kDim * 2));
  SPARROW_CUDA_CHECK(cudaMalloc(&row_seq, max_rows * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMalloc(&row_pos, max_rows * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMalloc(&blocks, max_rows * kHeads * kTopk * sizeof(int32_t)));
  SPARROW_CUDA_CHECK(cudaMalloc(&counts, max_rows * kHeads * sizeof(int32_t)));
  fill_bf16<<<1024, 256, 0, stream>>>(q, max_rows * kHeads * kDim, 2);
  SPARROW_CUDA_CHECK_LAUNCH();
  size_t ws_bytes = 0;
  for (int64_t c : chunks) ws_bytes = std::max(ws_bytes, msa_select_workspace_bytes(c, kHeads, c - 1, kIndexBlock));
  ws_bytes = std::max(ws_bytes, msa_select_workspace_bytes(max_batch, kHeads, max_ctx - 1, kIndexBlock));
  void* ws = nullptr;
  SPARROW_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  const std::string model = "minimax_m3.1 index_heads=4 (TP4) dim=128 ib=128 top16";
  const double out_bytes_per_row = double(kHeads) * (kTopk + 1) * 4 + double(kHeads) * kDim * 2;

  struct Format {
    PageFormat format;
    const char* name;
    const char* note;
  };
  const Format formats[] = {
      {PageFormat::BFloat16, "bf16", "bf16 keys"},
      {PageFormat::Fp8Rows, "fp8", "FP8 E4M3 keys widened to bf16 in registers"},
      {PageFormat::Nvfp4Rows, "nvfp4", "NVFP4 keys (E2M1 + E4M3 per 16) widened to bf16 in registers"},
      {PageFormat::Mxfp4Rows, "mxfp4", "MXFP4 keys (E2M1 + E8M0 per 32) widened to bf16 in registers"},
  };
  for (const Format& f : formats) {
    const PageFormat format = f.format;
    const int64_t key_bytes = msa_key_bytes(format, kDim);  // per token: codes and scales
    const std::string tag = std::string(" keys=") + f.name;
    if (format == PageFormat::BFloat16)
      fill_bf16<<<4096, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(pool), total_pages * kBlock * kDim, 1);
    else
      fill_e4m3<<<4096, 256, 0, stream>>>(pool, total_pages * kBlock * key_bytes, 1);
    SPARROW_CUDA_CHECK_LAUNCH();
    std::vector<int64_t> offsets(ids);
    for (auto& o : offsets) o *= kBlock * key_bytes;
    SPARROW_CUDA_CHECK(cudaMemcpy(table, offsets.data(), total_pages * sizeof(int64_t), cudaMemcpyHostToDevice));

    for (int64_t ctx : ctxs)
      for (int batch : batches) {
        std::vector<int32_t> hs(batch), hp(batch, int32_t(ctx - 1));
        std::iota(hs.begin(), hs.end(), 0);
        SPARROW_CUDA_CHECK(cudaMemcpy(row_seq, hs.data(), batch * 4, cudaMemcpyHostToDevice));
        SPARROW_CUDA_CHECK(cudaMemcpy(row_pos, hp.data(), batch * 4, cudaMemcpyHostToDevice));
        auto launch = [&](cudaStream_t s) {
          msa_select_blocks(q, batch, kHeads, kDim, row_seq, row_pos, ctx - 1, pool, format, table, pages_per_seq,
                            kBlock, kIndexBlock, kTopk, kLocal, /*init_blocks=*/0, blocks, counts, ws, ws_bytes, s);
        };
        KernelBenchRow row;
        row.kernel = "msa_select_blocks";
        row.shape = model + " ctx=" + std::to_string(ctx) + " batch=" + std::to_string(batch) + tag;
        row.impl = "sparrow";
        row.median_us = median_launch_us(launch, stream, options.iterations);
        row.bytes = double(batch) * ctx * key_bytes + double(batch) * out_bytes_per_row;
        row.flops = 2.0 * kHeads * kDim * double(batch) * ctx;
        row.note = std::string(f.note) + " (paged, bs 64, " + std::to_string(key_bytes) +
                   " B a key), bf16 mma.sync block scores + top-16 selection; decode tiling";
        rows.push_back(row);
      }

    for (int64_t chunk : chunks) {
      std::vector<int32_t> hs(chunk, 0), hp(chunk);
      std::iota(hp.begin(), hp.end(), 0);
      SPARROW_CUDA_CHECK(cudaMemcpy(row_seq, hs.data(), chunk * 4, cudaMemcpyHostToDevice));
      SPARROW_CUDA_CHECK(cudaMemcpy(row_pos, hp.data(), chunk * 4, cudaMemcpyHostToDevice));
      auto launch = [&](cudaStream_t s) {
        msa_select_blocks(q, chunk, kHeads, kDim, row_seq, row_pos, chunk - 1, pool, format, table, pages_per_seq,
                          kBlock, kIndexBlock, kTopk, kLocal, /*init_blocks=*/0, blocks, counts, ws, ws_bytes, s);
      };
      KernelBenchRow row;
      row.kernel = "msa_select_blocks";
      row.shape = model + " prefill chunk=" + std::to_string(chunk) + tag;
      row.impl = "sparrow";
      row.median_us = median_launch_us(launch, stream, std::max(3, options.iterations / 4));
      row.bytes = double(chunk) * key_bytes + double(chunk) * out_bytes_per_row;
      row.flops = 2.0 * kHeads * kDim * (double(chunk) * (chunk + 1) / 2);
      row.note = std::string(f.name) + " keys; causal; prefill tiling (32 vectors per warp, keys shared through L1)";
      rows.push_back(row);
    }
  }

  SPARROW_CUDA_CHECK(cudaFree(ws));
  SPARROW_CUDA_CHECK(cudaFree(q));
  SPARROW_CUDA_CHECK(cudaFree(row_seq));
  SPARROW_CUDA_CHECK(cudaFree(row_pos));
  SPARROW_CUDA_CHECK(cudaFree(blocks));
  SPARROW_CUDA_CHECK(cudaFree(counts));
  SPARROW_CUDA_CHECK(cudaFree(table));
  SPARROW_CUDA_CHECK(cudaFree(pool));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
