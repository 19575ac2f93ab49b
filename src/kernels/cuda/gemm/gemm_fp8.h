// FP8 E4M3 products with DeepSeek's block scales through cuBLASLt (Hopper, sm_90a), so FP8 checkpoints
// run as FP8:
//   y[m, n] = x[m, k] · Wᵀ,   W[i][j] = e4m3(w[i][j]) * w_scales[i / 128][j / 128]
// The activations x (bf16) are quantised per (row, 128 columns) on the fly, as DeepSeek's act_quant does
// (DeepSeek-V3 inference/kernel.py, block size 128), and the product runs as one cuBLASLt matmul whose
// A operand (the weights) carries 128x128 block scales and whose B operand (the activations) carries
// 1x128 block scales (cuBLAS docs, "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types",
// https://docs.nvidia.com/cuda/cublas/#element-1d-and-128x128-2d-block-scaling-for-fp8-data-types).
// These scale modes exist on sm_90 only, from cuBLAS 12.9 on.
//
// Small m (ops::linear at m <= 8) takes gemm_skinny_fp8 (gemm_skinny.h) instead, a weight-streaming
// product that does NOT quantise the activations: bf16 x times each e4m3 weight converted exactly to bf16,
// fp32 sums per 128-column block, each multiplied by its block scale into an fp32 accumulator. Its
// result is within fp32-accumulation rounding of x · (dequantised W)ᵀ (slightly closer to it than this
// path, which adds the activations' 1x128-block e4m3 rounding), not bit-identical to this path. At m <= 8
// the product is bound by reading W; x's precision costs nothing there, and the quantising launch is gone.
//
// Scale layouts (fp32 everywhere):
//   * Weights, w_scales: row-major [ceil(n / 128), ceil(k / 128)], exactly a checkpoint's
//     weight_scale_inv. cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F wants, for A, "K-major"
//     scales of shape L4 x ceil(M / 128) where L = ceil(K / 128) and L4 is L rounded up to a multiple of 4
//     ("the stride between the consecutive columns must be a multiple of 4"), starting 16-byte aligned.
//     With A = W (cuBLASLt M = n) that is the row-major [ceil(n/128), L] array itself whenever L % 4 == 0
//     (every DeepSeek-V3.2 projection: k is a multiple of 512); otherwise, or when w_scales is not 16-byte
//     aligned, the launcher copies it into a padded workspace first (a few hundred bytes per call).
//   * Activations, quantize_fp8_rows' `scales`: scales[g * m + i] for row i and column group g, i.e. a
//     column-major [m, ceil(k / 128)] array whose row index is contiguous. That is
//     CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F's layout for B: "N-major for B with shape N x L", cuBLASLt's
//     N being our m. cuBLASLt also needs "M and N ... multiples of 4": gemm_fp8_block_scaled pads m to a
//     multiple of 4 internally (zero rows with zero scales), so callers need not.
//
// cuBLASLt requirements the product checks (cublasLtMatmul: "pointers and matrix dimension must support
// 16-byte alignment", TN form, fp32 compute and scale type):
//   * k % 16 == 0 (the K extent and leading dimension of the e4m3 A and B);
//   * n % 8 == 0 for a bf16 y, n % 4 == 0 for an fp32 y (the rows of the column-major output, 16 bytes);
//   * w 16-byte aligned (its leading dimension is k, so its rows then are too).
// Everything else (m not a multiple of 4, ldy or y not 16-byte aligned, w_scales padding or alignment) is
// handled inside by workspace copies. Violations are sparrow::Error with the requirement named.
//
// Workspace: the quantised activations (m4 * k bytes + their scales, m4 = m rounded up to 4) and the
// padded copies come from the device pool (runtime/device.h) and go back after the work is enqueued; the
// engine stream is made to wait for the product when it runs on another stream, so a later pool user there
// cannot overwrite the workspace early. A null stream means the engine's stream.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/gemm/gemm.h"

namespace sparrow::cuda {

// Per row i and per group g of 128 consecutive columns (the last group may be partial):
//   scale = amax / 448 (fp32, correctly rounded), amax = max |x[i][128g .. 128g+127]|;
//   q[i][j] = e4m3(x[i][j] / scale), round to nearest even, saturating to ±448 (__NV_SATFINITE);
//   an all-zero group has scale 0 and codes 0.
// x: bf16 row-major with row stride ldx >= k. q: row-major [m, k] (row stride k). scales: scales[g * m + i]
// (see above). Inputs are expected finite. Bit-identical to cpu::float_to_e4m3 on (x / scale).
void quantize_fp8_rows(int64_t m, int64_t k, const void* x_bf16, int64_t ldx, uint8_t* q, float* scales,
                       cudaStream_t stream);

// y[m, n] = x[m, k] · W[n, k]ᵀ, W = e4m3 w (row-major [n, k], row stride k) times w_scales (row-major
// [ceil(n/128), ceil(k/128)]). x bf16 with row stride ldx >= k; y bf16 or fp32 with row stride ldy >= n.
// fp32 accumulation (cuBLASLt promotes the FP8 tensor-core partial sums per 128-deep block).
void gemm_fp8_block_scaled(int64_t m, int64_t n, int64_t k, const void* x_bf16, int64_t ldx, const uint8_t* w,
                           const float* w_scales, void* y, ElemType y_type, int64_t ldy, cudaStream_t stream);

// out[i][j] = bf16(e4m3(w[i][j]) * w_scales[i/128][j/128]) (fp32 product, rounded to nearest even), for a
// row-major [rows, cols] w and out (row stride cols) and the same scale layout as gemm_fp8_block_scaled;
// rows and cols need not be multiples of 128.
void dequantize_fp8_blocks(int64_t rows, int64_t cols, const uint8_t* w, const float* w_scales, void* out_bf16,
                           cudaStream_t stream);

}  // namespace sparrow::cuda
