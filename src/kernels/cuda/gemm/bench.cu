// cuBLASLt bf16 products at the real models' projection shapes: the ceiling every linear layer of the
// GPU path runs at (compute-bound for prefill-sized m, memory-bound on the weights for decode-sized m).
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/gemm/gemm.h"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/runtime/cuda_check.h"
#include "kernels/cuda/runtime/device.h"

namespace sparrow::cuda {

namespace {

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(0.5f * hash_unit(uint64_t(seed) << 40 ^ uint64_t(i)));
}

}  // namespace

void bench_gemm(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (!options.filter.empty() && std::string("gemm_bf16").find(options.filter) == std::string::npos) return;
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  // DeepSeek-V3.2 (hidden 7168): q_a (7168 -> 1536), MoE expert up (7168 -> 2048) and down; m = tokens.
  std::vector<Shape> shapes = {{"deepseek_v3.2 q_a_proj", 4096, 1536, 7168}, {"deepseek_v3.2 expert gate_up", 4096, 4096, 7168},
                               {"deepseek_v3.2 expert down", 4096, 7168, 2048}, {"square", 8192, 8192, 8192},
                               {"deepseek_v3.2 expert gate_up decode", 128, 4096, 7168}};
  if (options.quick) shapes.resize(2);
  for (const Shape& s : shapes) {
    void *x = device_alloc(s.m * s.k * 2), *w = device_alloc(s.n * s.k * 2), *y = device_alloc(s.m * s.n * 2);
    fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(x), s.m * s.k, 1);
    fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(w), s.n * s.k, 2);
    SPARROW_CUDA_CHECK_LAUNCH();
    const GemmOperand gx{x, ElemType::BF16, s.k, 0}, gw{w, ElemType::BF16, s.k, 0};
    const GemmOutput gy{y, ElemType::BF16, s.n, 0};
    KernelBenchRow row;
    row.kernel = "gemm_bf16";
    row.shape = std::string(s.name) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k);
    row.median_us = median_launch_us([&](cudaStream_t st) { gemm_nt(s.m, s.n, s.k, gx, gw, gy, 1.0f, 0.0f, 1, st); },
                                     stream(), options.iterations);
    row.bytes = 2.0 * (s.m * s.k + s.n * s.k + s.m * s.n);
    row.flops = 2.0 * s.m * s.n * s.k;
    row.note = "cuBLASLt, bf16 in and out, fp32 accumulation";
    rows.push_back(row);
    device_free(x);
    device_free(w);
    device_free(y);
  }
}

}  // namespace sparrow::cuda
