// Matrix products through cuBLASLt, row-major as the rest of sparrow:
//   y[m, n] = alpha * x[m, k] · w[n, k]ᵀ + beta * y      (gemm_nt: a torch Linear, weights [out, in])
//   y[m, n] = alpha * x[m, k] · w[k, n]   + beta * y      (gemm_nn)
// Operands are bf16 (tensor cores, fp32 accumulation); y is bf16 or fp32. Strided-batched forms run
// `batch` independent products (per-head products of MLA's absorbed weights).
//
// Decode-sized products (m <= 8) reach only a fraction of HBM bandwidth through cuBLASLt; ops::linear sends
// them to gemm_skinny_bf16 (gemm_skinny.h) instead: the same product, weights streamed once, fp32
// accumulation in another order (within rounding of this one), y bf16 or fp32.
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
