// bench_gqa: GQA decode attention (gqa_attention.h) on MiniMax-M3.1's shapes (bench/shapes/minimax_m3.1.json:
// 64 query heads, 4 kv heads x 128, 4 MSA index heads, 128-key index blocks, top 16 blocks):
//   tp4: one GPU of tensor parallelism 4 -> 16 query heads, 1 kv head, 1 index head per GPU;
//   tp1: the whole layer on one GPU      -> 64 query heads, 4 kv heads, 4 index heads.
// One query row per sequence, at the sequence's last position; pages of 64 tokens scattered over the pool.
// Each K/V page format (--kv-cache-dtype): bf16 (2,048 B a token at tp1), fp8 (1,024 B: fp8 and
// fp8_per_tensor) and nvfp4 (576 B: 512 B of E2M1 codes + 64 E4M3 block scales); the shape's
// "kv_dtype=" tag names it. Narrow pools hold E4M3 codes of values in [-1, 1) in every byte (valid FP8 values, valid
// NVFP4 codes and finite block scales).
//
// Bytes (minimum HBM traffic): each sequence's K/V read once per kv head (dense: the whole prefix; sparse:
// the keys of the kept blocks) at the format's bytes per token, plus q and out (bf16) and the block lists.
// FLOPs: 2 * heads * keys * 2 * head_dim per row (q.k and p.v). Sparse contexts beyond what fits in
// memory reuse pages across sequences (noted); a row's 16 random blocks rarely meet another's.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/gqa/gqa_attention.h"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/quant/fp4.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {

void bench_gqa(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);

namespace {

__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(hash_unit(seed ^ uint64_t(i)));
}

// E4M3 codes of values uniform in [-1, 1): FP8 values, E2M1 code pairs and finite NVFP4 block scales alike.
__global__ void fill_e4m3_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = quant::e4m3_encode(hash_unit(seed ^ uint64_t(i)));
}

struct Format {
  const char* name;
  PageFormat format;
};

// Bytes of one token's row (all kv heads) in a page of each format.
int64_t token_bytes(PageFormat f, int kv_heads, int head_dim) {
  const int64_t values = int64_t(2) * kv_heads * head_dim;
  return f == PageFormat::BFloat16 ? 2 * values : f == PageFormat::Fp8Rows ? values : values / 2 + values / 16;
}

struct DeviceMem {
  void* p = nullptr;
  size_t bytes = 0;
  void ensure(size_t want) {
    if (want <= bytes) return;
    if (p) SPARROW_CUDA_CHECK(cudaFree(p));
    SPARROW_CUDA_CHECK(cudaMalloc(&p, want));
    bytes = want;
  }
  ~DeviceMem() {
    if (p) cudaFree(p);
  }
};

struct Config {
  const char* name;
  int heads, kv_heads, index_heads;
};

constexpr int kHeadDim = 128, kIndexBlock = 128, kTopBlocks = 16, kCacheBlock = 64;
constexpr size_t kPoolBytes = size_t(36) << 30;  // dense tp1 at 128K x 128 sequences needs 34.4 GB

}  // namespace

void bench_gqa(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  auto wanted = [&](const char* name) {
    return options.filter.empty() || std::string(name).find(options.filter) != std::string::npos;
  };
  const bool want_dense = wanted("dense_gqa_decode"), want_sparse = wanted("sparse_gqa_decode");
  if (!want_dense && !want_sparse) return;
  const std::vector<Config> configs = options.quick ? std::vector<Config>{{"minimax_m3.1_tp4", 16, 1, 1}}
                                                    : std::vector<Config>{{"minimax_m3.1_tp4", 16, 1, 1},
                                                                          {"minimax_m3.1_tp1", 64, 4, 4}};
  const std::vector<int> batches = options.quick ? std::vector<int>{1, 64} : std::vector<int>{1, 2, 8, 32, 64, 128};
  const std::vector<int> dense_ctx = options.quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
  const std::vector<int> sparse_ctx =
      options.quick ? std::vector<int>{131072} : std::vector<int>{32768, 131072, 524288};
  const int max_batch = *std::max_element(batches.begin(), batches.end());

  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceMem pool, q, out, ws, pages, seqs, poss, blocks;
  pool.ensure(kPoolBytes);
  q.ensure(size_t(max_batch) * 64 * kHeadDim * 2);
  out.ensure(q.bytes);
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(q.p), int64_t(q.bytes / 2), 5);
  SPARROW_CUDA_CHECK_LAUNCH();
  const std::vector<Format> formats = {
      {"bf16", PageFormat::BFloat16}, {"fp8", PageFormat::Fp8Rows}, {"nvfp4", PageFormat::Nvfp4Rows}};

  for (const Format& f : formats) {
    if (f.format == PageFormat::BFloat16)
      fill_bf16_kernel<<<8192, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(pool.p), int64_t(kPoolBytes / 2), 17);
    else
      fill_e4m3_kernel<<<8192, 256, 0, stream>>>(static_cast<uint8_t*>(pool.p), int64_t(kPoolBytes), 17);
    SPARROW_CUDA_CHECK_LAUNCH();
    std::mt19937_64 rng(1234);  // the same pages and selections for every format
    for (const Config& c : configs) {
      const int64_t row_bytes = token_bytes(f.format, c.kv_heads, kHeadDim);
      const int64_t page_bytes = kCacheBlock * row_bytes;
      const int64_t total_pages = int64_t(kPoolBytes) / page_bytes;
      const float scale = 1.0f / std::sqrt(float(kHeadDim));
      for (const bool sparse : {false, true}) {
        if (sparse ? !want_sparse : !want_dense) continue;
        for (const int ctx : sparse ? sparse_ctx : dense_ctx) {
          for (const int batch : batches) {
            // Page i of sequence s at slot (s * P + i) * 7919 mod total (a prime stride scatters the pages).
            const int64_t pages_per_seq = ctx / kCacheBlock;
            const bool aliased = int64_t(batch) * pages_per_seq > total_pages;
            std::vector<int64_t> offsets(size_t(batch * pages_per_seq));
            for (int64_t i = 0; i < int64_t(offsets.size()); ++i) offsets[i] = ((i * 7919) % total_pages) * page_bytes;
            std::vector<int32_t> row_seq(batch), row_pos(batch, ctx - 1);
            std::iota(row_seq.begin(), row_seq.end(), 0);
            // MSA selection: the row's own (last) block and 15 other random blocks, ascending.
            std::vector<int32_t> sel;
            if (sparse) {
              const int nblocks = ctx / kIndexBlock;
              sel.resize(size_t(batch) * c.index_heads * kTopBlocks);
              std::vector<int32_t> older(nblocks - 1);
              for (size_t r = 0; r < sel.size() / kTopBlocks; ++r) {
                std::iota(older.begin(), older.end(), 0);
                std::shuffle(older.begin(), older.end(), rng);
                std::sort(older.begin(), older.begin() + (kTopBlocks - 1));
                std::copy(older.begin(), older.begin() + (kTopBlocks - 1), sel.begin() + r * kTopBlocks);
                sel[r * kTopBlocks + kTopBlocks - 1] = nblocks - 1;
              }
            }
            pages.ensure(offsets.size() * 8);
            seqs.ensure(size_t(batch) * 4);
            poss.ensure(size_t(batch) * 4);
            blocks.ensure(std::max<size_t>(sel.size() * 4, 4));
            auto upload = [&](void* dst, const void* src, size_t bytes) {
              SPARROW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
            };
            upload(pages.p, offsets.data(), offsets.size() * 8);
            upload(seqs.p, row_seq.data(), size_t(batch) * 4);
            upload(poss.p, row_pos.data(), size_t(batch) * 4);
            if (sparse) upload(blocks.p, sel.data(), sel.size() * 4);
            const int ih = sparse ? c.index_heads : 0, mb = sparse ? kTopBlocks : 0;
            const size_t need = gqa_attention_workspace_bytes(batch, c.heads, c.kv_heads, kHeadDim, ctx, ih, mb,
                                                              kIndexBlock, f.format);
            ws.ensure(std::max<size_t>(need, 16));
            auto launch = [&](cudaStream_t st) {
              const int32_t* sel_d = sparse ? static_cast<const int32_t*>(blocks.p) : nullptr;
              gqa_attention(q.p, out.p, batch, c.heads, c.kv_heads, kHeadDim, scale,
                            static_cast<const int32_t*>(seqs.p), static_cast<const int32_t*>(poss.p), ctx, sel_d,
                            ih, mb, kIndexBlock,
                            static_cast<const int64_t*>(pages.p), pages_per_seq, kCacheBlock,
                            static_cast<const uint8_t*>(pool.p), f.format, ws.p, ws.bytes, st);
            };
            const double keys = sparse ? double(kTopBlocks) * kIndexBlock : double(ctx);  // per row and kv head
            KernelBenchRow row;
            row.kernel = sparse ? "sparse_gqa_decode" : "dense_gqa_decode";
            row.shape = std::string(c.name) + " heads=" + std::to_string(c.heads) +
                        " kv=" + std::to_string(c.kv_heads) + " ctx=" + std::to_string(ctx) +
                        " batch=" + std::to_string(batch) + (sparse ? " top=16x128" : "") + " kv_dtype=" + f.name;
            row.impl = "sparrow";
            row.median_us = median_launch_us(launch, stream, options.iterations);
            row.bytes = double(batch) * keys * row_bytes + double(batch) * c.heads * kHeadDim * 2 * 2 +
                        double(sel.size()) * 4;
            row.flops = 2.0 * batch * c.heads * keys * 2 * kHeadDim;
            row.note = std::string(f.name) + " paged K/V (" + std::to_string(row_bytes) + " B a token)" +
                       (f.format == PageFormat::BFloat16 ? "" : ", widened to bf16 in the kernel") +
                       (need ? ", keys split + combine" : ", one pass") +
                       (aliased ? ", pages shared across sequences" : "");
            rows.push_back(row);
          }
        }
      }
    }
  }
  SPARROW_CUDA_CHECK(cudaStreamSynchronize(stream));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
