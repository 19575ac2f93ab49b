// bench_mla_decode: sparse (DSA top-2048) and dense MLA decode on the real models' shapes, reading a
// paged cache filled with random valid rows (pages scattered over the pool).
//
// Bytes (minimum HBM traffic): every distinct cached row the step reads (a sequence's q=2 rows share
// the rows they both select, counted once), the queries, the outputs (bf16) and lse, and the indices.
// FLOPs: 2 * heads * rows * keys * (576 + 512) (the q·k products over 576 values, p·c over 512).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {
namespace {

// Fills `rows` cache rows with valid random content (no NaN codes; scales around 1/448 of O(1) data).
__global__ void fill_rows_kernel(uint8_t* pool, int64_t rows, bool fp8, uint64_t seed) {
  const int64_t row_bytes = fp8 ? 656 : 1152;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    uint8_t* row = pool + r * row_bytes;
    if (fp8) {
      for (int i = threadIdx.x; i < 512; i += blockDim.x) {
        uint8_t b = uint8_t(hash32(seed ^ (r * 1024 + i)));
        if ((b & 0x7f) == 0x7f) b &= 0xfe;  // 0x7f / 0xff are NaN
        row[i] = b;
      }
      if (threadIdx.x < 4) reinterpret_cast<float*>(row + 512)[threadIdx.x] = (1.5f + hash_unit(seed + r * 4 + threadIdx.x)) / 448.f;
      for (int i = threadIdx.x; i < 64; i += blockDim.x)
        reinterpret_cast<__nv_bfloat16*>(row + 528)[i] = __float2bfloat16(hash_unit(seed ^ (r * 77 + i + 9999)));
    } else {
      for (int i = threadIdx.x; i < 576; i += blockDim.x)
        reinterpret_cast<__nv_bfloat16*>(row)[i] = __float2bfloat16(hash_unit(seed ^ (r * 1024 + i)));
    }
  }
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(hash_unit(seed ^ i));
}

struct Model {
  const char* name;
  int heads;
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
  std::mt19937_64 rng(1234);

  for (const MlaCacheFormat format : {MlaCacheFormat::kFp8, MlaCacheFormat::kBf16}) {
    const bool fp8 = format == MlaCacheFormat::kFp8;
    const int64_t row_bytes = mla_row_bytes(format);
    fill_rows_kernel<<<4096, 128, 0, stream>>>(static_cast<uint8_t*>(pool.p), max_rows_pool, fp8, fp8 ? 11 : 13);
    SPARROW_CUDA_CHECK_LAUNCH();
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
            const std::string fmt = fp8 ? " fp8" : " bf16";
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
              row.note = std::string(fp8 ? "FP8 FlashMLA layout" : "bf16 cache") + ", split-KV + combine";
              rows.push_back(row);
            }
            if (want_sparse) {
              const size_t need = mla_attention_workspace_bytes(nrows, m.heads, topk);
              ws.ensure(std::max<size_t>(need, 1));
              auto launch = [&](cudaStream_t st) {
                mla_sparse_attention(cache, static_cast<const uint16_t*>(q.p), static_cast<const int32_t*>(seqs.p),
                                     static_cast<const int32_t*>(idx.p), nrows, m.heads, topk, scale,
                                     static_cast<uint16_t*>(out.p), static_cast<float*>(lse.p), ws.p, ws.bytes, st);
              };
              KernelBenchRow row;
              row.kernel = "sparse_mla_decode";
              row.shape = std::string(m.name) + " heads=" + std::to_string(m.heads) + tail +
                          " topk=" + std::to_string(topk) + fmt;
              row.impl = "sparrow";
              row.median_us = median_launch_us(launch, stream, options.iterations);
              row.bytes = double(distinct) * row_bytes + io + double(nrows) * topk * 4;
              row.flops = 2.0 * m.heads * double(nrows) * topk * (kMlaRow + kMlaLatent);
              row.note = std::string(fp8 ? "FP8 FlashMLA layout" : "bf16 cache") + ", " + std::to_string(distinct) +
                         " distinct rows";
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
