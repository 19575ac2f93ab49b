// Decode-sized dense products (1..8 activation rows) streamed from HBM:
//   y[m, n] = x[m, k] · W[n, k]ᵀ,   W stored as gemm.h's WeightCodes say: bf16;
//   FP8:   W[i][j] = e4m3(w[i][j]) * w_scales[i / 128][j / 128]           (fp32 block scales)
//   MXFP8: W[i][j] = e4m3(w[i][j]) * 2^(w_scales[i][j / 32] - 127)          (E8M0 group scales)
//   MXFP4: W[i][j] = e2m1(w[i][j])  * 2^(w_scales[i][j / 32] - 127)          (two codes a byte)
//   NVFP4: W[i][j] = e2m1(w[i][j])  * e4m3(w_scales[i][j / 16]) * w_global[0]
// At m <= 8 a product is bound by reading W once (kv_a_proj 576x7168 e4m3: 4 MB, ~1 us at 4.3 TB/s;
// the bf16 lm_head 129280x7168: 1.85 GB, 0.43 ms); cuBLASLt reaches 5-57% of HBM there
// (bench/results/kernels.md). These run skinny::kernel (skinny.cuh), the kernel of the MoE decode path:
// each warp streams 16 weight rows with 16-byte loads and multiplies them on mma.sync against the m
// activation rows staged in shared memory, fp32 accumulation. Matrices with few 16-row groups have their
// K split over the grid (gemm_skinny.cu says when), the partial sums then added in a fixed order by a
// second small kernel: results do not vary from run to run.
//
// Numerics:
//   * bf16 W: bf16 products summed in fp32 (the order differs from cuBLASLt's: within rounding of it).
//   * FP8 W: the activations stay bf16 -- they are NOT quantised to e4m3 per 128 columns as
//     gemm_fp8_block_scaled does. This path streams the weights, so the activations' precision costs
//     nothing, and skipping their quantisation removes a launch and the 1x128-block rounding error. Each
//     e4m3 weight converts exactly to bf16; each 128-column block's fp32 partial sum is multiplied by its
//     block scale and added into the fp32 accumulator. The result is therefore within fp32-accumulation
//     rounding of x · (dequantised W)ᵀ computed exactly (the dequantised W being e4m3 * scale in exact
//     arithmetic), i.e. slightly closer to it than the cuBLASLt path, not bit-identical to it.
//   * MX / NV W (as released, read in place): each code times its group scale is formed exactly in bf16 in
//     registers (skinny.cuh), then as bf16 W; NVFP4's global scale multiplies the fp32 sums. Within
//     fp32-accumulation rounding of x · (dequantised W)ᵀ.
//   * y: bf16 (rounded to nearest even once) or fp32.
//
// Requirements (gemm_skinny_unsupported names the first one broken; gemm_skinny throws sparrow::Error
// with that text; callers such as ops::linear test first and fall back to cuBLASLt):
//   0 <= m <= 8; n >= 1; k >= 1 and k a multiple of 8 (bf16), 16 (FP8) or 32 (MX / NV: whole groups);
//   x and w 16-byte aligned, ldx >= k and ldx % 8 == 0 (16-byte aligned x rows);
//   w_scales non-null except for bf16 (FP8: 4-byte aligned fp32, row-major [ceil(n/128), ceil(k/128)],
//   gemm_fp8.h; MX / NV: bytes [n, k / group]); NVFP4: w_global one fp32 on the device;
//   y non-null and aligned to its element, ldy >= n; workspace of gemm_skinny_workspace_bytes(m, n, k, codes)
//   bytes (0: none needed; else 256-byte aligned device memory, used only by the work enqueued on `stream`).
// A null stream means the engine's stream.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/gemm/gemm.h"

namespace sparrow::cuda {

constexpr int64_t kSkinnyMaxRows = 8;

// Null when the skinny product can run these operands; else the requirement they break.
const char* gemm_skinny_unsupported(int64_t m, int64_t n, int64_t k, WeightCodes codes, const void* x, int64_t ldx,
                                    const void* w, const void* w_scales, const float* w_global, const void* y,
                                    ElemType y_type, int64_t ldy);

// Bytes of fp32 partial sums the product needs (0 when K is not split).
size_t gemm_skinny_workspace_bytes(int64_t m, int64_t n, int64_t k, WeightCodes codes);

void gemm_skinny(int64_t m, int64_t n, int64_t k, WeightCodes codes, const void* x_bf16, int64_t ldx, const void* w,
                 const void* w_scales, const float* w_global, void* y, ElemType y_type, int64_t ldy, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream);

}  // namespace sparrow::cuda
