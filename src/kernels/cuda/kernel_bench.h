// `sparrow bench kernels`: each kernel family times its launches on the real models' shapes and reports
// one row per (kernel, shape). Bytes and FLOPs are counted by hand from the shape (what the operation
// must read, write and compute at minimum), so a row's fraction of the limit is an honest figure:
// max(bytes / HBM bandwidth, FLOPs / matrix peak) / time. Peers (PyTorch, FlashMLA) are measured by
// bench/peers/*.py in the same run and merged by bench/kernels.sh.
#pragma once
#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace sparrow::cuda {

struct KernelBenchOptions {
  std::string filter;      // run only kernels whose name contains this (empty: all)
  bool quick = false;      // fewer shapes and iterations (a smoke run)
  int iterations = 50;     // timed launches per shape (median reported)
};

struct KernelBenchRow {
  std::string kernel;  // e.g. "dsa_index_scores"
  std::string shape;   // e.g. "deepseek_v3.2 heads=64 ctx=131072 batch=1"
  std::string impl;    // "sparrow", or the peer's name
  double median_us = 0;
  double bytes = 0;    // HBM bytes the operation must move
  double flops = 0;    // arithmetic it must do (2 per multiply-add)
  // The products run on the FP8 tensor cores (e4m3 x e4m3, wgmma or cuBLASLt's FP8 kernels): the FLOPs count
  // against the FP8 rate. Operands stored in FP8 but widened to bf16 or f16 before the products do not.
  bool fp8_products = false;
  std::string note;    // anything a reader needs (dtype, layout)
};

// The H200 ceilings measured on the lent machine (docs: /work/.library/device/KINDS.md, bench/results).
inline constexpr double kHbmBytesPerSecond = 4.3e12;
inline constexpr double kBf16FlopsPerSecond = 790e12;
inline constexpr double kFp8FlopsPerSecond = 1580e12;  // Hopper's FP8 tensor-core rate is twice bf16's

// The tensor-core rate a row's FLOPs count against.
inline double matrix_peak(const KernelBenchRow& row) {
  return row.fp8_products ? kFp8FlopsPerSecond : kBf16FlopsPerSecond;
}

// Median time of `launch` in microseconds, by CUDA events around each of `iterations` launches after a
// warm-up. `launch` must enqueue its work on `stream`. Between launches the L2 is flushed (a 256 MiB
// write) so that a kernel never reads its operands from the previous launch's cache.
double median_launch_us(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int iterations,
                        bool flush_l2 = true);

// The families' benchmarks, each appending its rows.
void bench_dsa_indexer(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_topk(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_mla_decode(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_gemm(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_sampling(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_gqa(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_msa(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_kda(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);
void bench_moe(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows);

}  // namespace sparrow::cuda
