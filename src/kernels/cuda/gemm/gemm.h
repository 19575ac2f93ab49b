// Matrix products through cuBLASLt, row-major as the rest of sparrow:
//   y[m, n] = alpha * x[m, k] · w[n, k]ᵀ + beta * y      (gemm_nt: a torch Linear, weights [out, in])
//   y[m, n] = alpha * x[m, k] · w[k, n]   + beta * y      (gemm_nn)
// Operands are bf16 (tensor cores, fp32 accumulation); y is bf16 or fp32. Strided-batched forms run
// `batch` independent products (per-head products of MLA's absorbed weights).
//
// Decode-sized products (m <= 8) with FP8 or MX / NV weights go to gemm_skinny (gemm_skinny.h) instead
// (ops::linear); bf16 ones stay here: cuBLASLt streams bf16 weights faster at every measured decode shape
// (bench/results/kernels.md, "Skinny products").
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

enum class ElemType { F32, BF16 };

// How a weight matrix is stored, for the products that read it in place (gemm_skinny.h, moe/moe.h; on the
// device side skinny::Codes): Bf16; Fp8, e4m3 with DeepSeek's 128x128 fp32 block scales; or an MX / NV
// format as released, one scale per group of consecutive values along a row, the scales row-major
// [rows, cols / group] bytes beside the codes: Nvfp4, E2M1 pairs (element 2i in the low nibble) with an
// E4M3 scale per 16 and a per-matrix fp32 global scale (ModelOpt); Mxfp4, E2M1 pairs with an E8M0 scale
// per 32; Mxfp8, e4m3 with an E8M0 scale per 32 (OCP MX v1.0).
enum class WeightCodes { Bf16, Fp8, Nvfp4, Mxfp4, Mxfp8 };

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
