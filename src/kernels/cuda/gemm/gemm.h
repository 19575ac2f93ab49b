// Matrix products through cuBLASLt, row-major as the rest of sparrow:
//   y[m, n] = alpha * x[m, k] · w[n, k]ᵀ + beta * y      (gemm_nt: a torch Linear, weights [out, in])
//   y[m, n] = alpha * x[m, k] · w[k, n]   + beta * y      (gemm_nn)
// Operands are bf16 (tensor cores, fp32 accumulation); y is bf16 or fp32. Strided-batched forms run
// `batch` independent products (per-head products of MLA's absorbed weights).
//
// Decode-sized products (m <= 8) with FP8 weights go to gemm_skinny_fp8 (gemm_skinny.h) instead of
// gemm_fp8_block_scaled (ops::linear); bf16 ones stay here: cuBLASLt streams bf16 weights faster at every
// measured decode shape (bench/results/kernels.md, "Skinny products").
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

enum class ElemType { F32, BF16 };

struct GemmOperand {
  const void* data = nullptr;
  ElemType type = ElemType::BF16;
  int64_t ld = 0;            // leading dimension (row stride, elements)
  int64_t batch_stride = 0;  // elements between consecutive batch entries
};

struct GemmOutput {
  void* data = nullptr;
  ElemType type = ElemType::BF16;
  int64_t ld = 0;
  int64_t batch_stride = 0;
};

void gemm_nt(int64_t m, int64_t n, int64_t k, const GemmOperand& x, const GemmOperand& w, const GemmOutput& y,
             float alpha = 1.0f, float beta = 0.0f, int64_t batch = 1, cudaStream_t stream = nullptr);
void gemm_nn(int64_t m, int64_t n, int64_t k, const GemmOperand& x, const GemmOperand& w, const GemmOutput& y,
             float alpha = 1.0f, float beta = 0.0f, int64_t batch = 1, cudaStream_t stream = nullptr);

}  // namespace sparrow::cuda
