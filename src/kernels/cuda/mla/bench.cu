// bench_mla_decode: sparse (DSA top-2048) and dense MLA decode on the real models' shapes, reading a
// paged cache (pages scattered over the pool) in each latent format the kernels read: bf16 (1152 B a
// token), fp8 (FlashMLA's 656 B), fp8_per_tensor (576 B e4m3) and nvfp4 (352 B). The cache is filled by
// mla_cache_write from random bf16 rows, so every row holds what the engine would store.
//
// Bytes (minimum HBM traffic): every distinct cached row the step reads at its format's size (a
// sequence's q=2 rows share the rows they both select, counted once), the queries, the outputs (bf16)
// and lse, and the indices. FLOPs: 2 * heads * rows * keys * (576 + 512) (the q·k products over 576
// values, p·c over 512), the same for every format: the quantised ones are dequantised to bf16 in shared
// memory first. The fp8_per_tensor and nvfp4 rows also give their time relative to fp8 (656 B) on the
// same shape: issue 7 asks that NVFP4 latents not make decode slower than FP8 at long context.
// Sparse decode runs both kernels (mla_attention.h, MlaKernel): the one mla_sparse_kernel_for picks is
// "sparrow", the other "sparrow-wgmma" or "sparrow-mma", on the same inputs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/mla/mla_attention.h"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(hash_unit(seed ^ i));
}

struct Model {
  const char* name;
  int heads;
};

struct Format {
  PageFormat format;
  const char* label;  // in the shape string (bf16 and fp8 as before, so earlier results stay comparable)
  const char* note;
};

const Format kFormats[] = {
    {PageFormat::BFloat16, "bf16", "bf16 cache"},
    {PageFormat::Fp8Latent, "fp8", "FP8 FlashMLA layout (656 B)"},
    {PageFormat::Fp8Rows, "fp8_per_tensor", "FP8 rows, per-layer scale (576 B)"},
    {PageFormat::Nvfp4Latent, "nvfp4", "NVFP4 latent + FP8 rope (352 B)"},
};

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

}  // namespace

void bench_mla_decode(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  const bool want_sparse = options.filter.empty() || std::string("sparse_mla_decode").find(options.filter) != std::string::npos;
  const bool want_dense = options.filter.empty() || std::string("dense_mla_decode").find(options.filter) != std::string::npos;
  if (!want_sparse && !want_dense) return;
  const std::vector<Model> models = {{"deepseek_v3.2", 128}, {"kimi_k3.1_pro", 96}, {"kimi_k3.1_pro", 12}};
  const std::vector<int> contexts = options.quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
  const std::vector<int> batches = options.quick ? std::vector<int>{64, 128} : std::vector<int>{1, 2, 8, 32, 64, 128};
  const int topk = 2048, block = 64;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_ctx = *std::max_element(contexts.begin(), contexts.end());
  cudaStream_t stream;
  SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceMem pool, q, out, lse, ws, pages, idx, seqs, lens;
  const int64_t max_rows_pool = int64_t(max_batch) * max_ctx;
  pool.ensure(size_t(max_rows_pool) * 1152);
  q.ensure(size_t(max_batch) * 2 * 128 * kMlaRow * 2);
  out.ensure(size_t(max_batch) * 2 * 128 * kMlaLatent * 2);
  lse.ensure(size_t(max_batch) * 2 * 128 * 4);
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(q.p), int64_t(q.bytes / 2), 7);
  SPARROW_CUDA_CHECK_LAUNCH();

  // The fill: one "sequence" whose pages are the whole pool in order, written by the engine's write
  // kernel in chunks of kFillRows tokens from one random bf16 source.
  constexpr int64_t kFillRows = 65536;
  DeviceMem fill_src, fill_pages;
  fill_src.ensure(size_t(kFillRows) * kMlaRow * 2);
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(fill_src.p), kFillRows * kMlaRow, 11);
  SPARROW_CUDA_CHECK_LAUNCH();
  std::map<std::string, double> fp8_us;  // kernel + shape without the format -> fp8 (656 B) time

  for (const Format& f : kFormats) {
    const PageFormat format = f.format;
    const int64_t row_bytes = mla_row_bytes(format);
    {
      const int64_t total_pages = max_rows_pool / block;
      std::vector<int64_t> all(static_cast<size_t>(total_pages));
      for (int64_t i = 0; i < total_pages; ++i) all[i] = i * block * row_bytes;
      fill_pages.ensure(all.size() * 8);
      SPARROW_CUDA_CHECK(cudaMemcpyAsync(fill_pages.p, all.data(), all.size() * 8, cudaMemcpyHostToDevice, stream));
      const MlaPagedCache whole{static_cast<uint8_t*>(pool.p), static_cast<const int64_t*>(fill_pages.p), total_pages,
                                block, format};
      for (int64_t start = 0; start < max_rows_pool; start += kFillRows)
        mla_cache_write(whole, fill_src.p, MlaSourceType::kBf16, std::min(kFillRows, max_rows_pool - start), nullptr,
                        nullptr, 0, start, stream);
      SPARROW_CUDA_CHECK(cudaStreamSynchronize(stream));  // `all` leaves scope
    }
    for (const int ctx : contexts) {
      for (const int batch : batches) {
        // Pages of all sequences scattered over the pool: page i of sequence s at slot (s*P+i)*7919 mod total.
        const int64_t pages_per_seq = ctx / block, total_pages = max_rows_pool / block;
        std::vector<int64_t> offsets(size_t(batch * pages_per_seq));
        for (int64_t i = 0; i < int64_t(offsets.size()); ++i)
          offsets[i] = ((i * 7919) % total_pages) * block * row_bytes;
        pages.ensure(offsets.size() * 8);
        SPARROW_CUDA_CHECK(cudaMemcpyAsync(pages.p, offsets.data(), offsets.size() * 8, cudaMemcpyHostToDevice, stream));
        const MlaPagedCache cache{static_cast<uint8_t*>(pool.p), static_cast<const int64_t*>(pages.p), pages_per_seq,
                                  block, format};
        for (const int qn : {1, 2}) {
          std::mt19937_64 rng(1234 + 7 * ctx + 131 * batch + qn);  // every format reads the same keys
          const int64_t nrows = int64_t(batch) * qn;
          std::vector<int32_t> row_seq(nrows), row_len(nrows), indices(size_t(nrows) * topk);
          int64_t distinct = 0;
          for (int s = 0; s < batch; ++s) {
            std::unordered_set<int32_t> seen;
            for (int j = 0; j < qn; ++j) {
              const int64_t r = int64_t(s) * qn + j;
              row_seq[r] = s;
              row_len[r] = ctx - (qn - 1 - j);
              // topk distinct positions: an odd stride modulo the (power of two) context.
              const uint64_t a = (rng() | 1) % uint64_t(ctx), b = rng() % uint64_t(ctx);
              for (int i = 0; i < topk; ++i) {
                int32_t t = int32_t((a * i + b) % uint64_t(ctx));
                if (t >= row_len[r]) t = row_len[r] - 1 - (i % 2);  // keep it causal
                indices[r * topk + i] = t;
                seen.insert(t);
              }
            }
            distinct += int64_t(seen.size());
          }
          seqs.ensure(nrows * 4);
          lens.ensure(nrows * 4);
          idx.ensure(indices.size() * 4);
          SPARROW_CUDA_CHECK(cudaMemcpyAsync(seqs.p, row_seq.data(), nrows * 4, cudaMemcpyHostToDevice, stream));
          SPARROW_CUDA_CHECK(cudaMemcpyAsync(lens.p, row_len.data(), nrows * 4, cudaMemcpyHostToDevice, stream));
          SPARROW_CUDA_CHECK(cudaMemcpyAsync(idx.p, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice, stream));
          for (const Model& m : models) {
            if (options.quick && !((m.heads == 12 && batch == 64) || (m.heads == 128 && batch == 128)) ) continue;
            const float scale = 1.0f / 13.856f;  // 192^-0.5
            const double io = double(nrows) * m.heads * (kMlaRow * 2 + kMlaLatent * 2 + 4);
            const std::string tail = " ctx=" + std::to_string(ctx) + " batch=" + std::to_string(batch) +
                                     " q=" + std::to_string(qn);
            const std::string fmt = std::string(" ") + f.label;
            // fp8_per_tensor / nvfp4 against fp8 (656 B) on the same kernel and shape.
            auto versus_fp8 = [&](const std::string& key, double us) {
              if (format == PageFormat::Fp8Latent) fp8_us[key] = us;
              const auto it = fp8_us.find(key);
              if (format == PageFormat::BFloat16 || format == PageFormat::Fp8Latent || it == fp8_us.end())
                return std::string();
              char buf[96];
              std::snprintf(buf, sizeof buf, "; %.2fx the time of fp8 (656 B)", us / it->second);
              return std::string(buf);
            };
            double dense_us = 0, dense_bytes = 0;
            if (want_dense && batch <= 64) {
              const size_t need = mla_attention_workspace_bytes(nrows, m.heads, ctx);
              ws.ensure(std::max<size_t>(need, 1));
              auto launch = [&](cudaStream_t st) {
                mla_dense_attention(cache, static_cast<const uint16_t*>(q.p), static_cast<const int32_t*>(seqs.p),
                                    static_cast<const int32_t*>(lens.p), nrows, m.heads, ctx, scale,
                                    static_cast<uint16_t*>(out.p), static_cast<float*>(lse.p), ws.p, ws.bytes, st);
              };
              KernelBenchRow row;
              row.kernel = "dense_mla_decode";
              row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + tail + fmt;
              row.impl = "sparrow";
              row.median_us = dense_us = median_launch_us(launch, stream, options.iterations);
              row.bytes = dense_bytes = double(batch) * ctx * row_bytes + io;
              row.flops = 0;
              for (int64_t r = 0; r < nrows; ++r) row.flops += 2.0 * m.heads * row_len[r] * (kMlaRow + kMlaLatent);
              row.note = std::string(f.note) + ", split-KV + combine" +
                         versus_fp8("dense " + std::string(m.name) + " heads=" + std::to_string(m.heads) + tail, dense_us);
              rows.push_back(row);
            }
            // Both kernels: the one Auto takes as "sparrow", the other beside it ("sparrow-wgmma" / "-mma").
            for (const MlaKernel kernel : {MlaKernel::Wgmma, MlaKernel::MmaSync}) {
              if (!want_sparse) break;
              const bool mma = kernel == MlaKernel::MmaSync;
              const bool chosen = kernel == mla_sparse_kernel_for(m.heads);
              const size_t need = mla_attention_workspace_bytes(nrows, m.heads, topk);
              ws.ensure(std::max<size_t>(need, 1));
              auto launch = [&](cudaStream_t st) {
                mla_sparse_attention(cache, static_cast<const uint16_t*>(q.p), static_cast<const int32_t*>(seqs.p),
                                     static_cast<const int32_t*>(idx.p), nrows, m.heads, topk, scale,
                                     static_cast<uint16_t*>(out.p), static_cast<float*>(lse.p), ws.p, ws.bytes, st,
                                     kernel);
              };
              KernelBenchRow row;
              row.kernel = "sparse_mla_decode";
              row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + tail +
                          " topk=" + std::to_string(topk) + fmt;
              row.impl = chosen ? "sparrow" : mma ? "sparrow-mma" : "sparrow-wgmma";
              row.median_us = median_launch_us(launch, stream, options.iterations);
              row.bytes = double(distinct) * row_bytes + io + double(nrows) * topk * 4;
              row.flops = 2.0 * m.heads * double(nrows) * topk * (kMlaRow + kMlaLatent);
              row.note = std::string(f.note) + (mma ? ", mma.sync kernel" : ", wgmma kernel (64 heads a CTA)") + ", " +
                         std::to_string(distinct) + " distinct rows" +
                         (!chosen ? std::string()
                                  : versus_fp8("sparse " + std::string(m.name) + " heads=" + std::to_string(m.heads) + tail,
                                           row.median_us));
              if (dense_us > 0) {
                char buf[160];
                std::snprintf(buf, sizeof buf, "; dense MLA on this cache: %.1f us, %.1fx the time, %.1fx the bytes",
                              dense_us, dense_us / row.median_us, dense_bytes / row.bytes);
                row.note += buf;
              }
              rows.push_back(row);
            }
          }
        }
      }
    }
  }
  SPARROW_CUDA_CHECK(cudaStreamSynchronize(stream));
  SPARROW_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace sparrow::cuda
