// Weights stored in an MX / NV format (gemm.h WeightCodes: Nvfp4, Mxfp4, Mxfp8) widened to bf16, for the
// products above decode sizes: ops::linear runs them as dequantize_grouped into a scratch matrix followed
// by cuBLASLt's bf16 product (gemm.h), since cuBLASLt on Hopper has no MX / NV block scaling (its
// VEC32_UE8M0 and VEC16_UE4M3 scale modes need sm_100) and no wgmma product of ours reads these formats
// yet. The widening costs a read of the codes and a write and re-read of the bf16 matrix (~5 bytes a
// weight, ~1.2 us per million weights at 4.3 TB/s) per call: small beside a prefill step's product
// (2 x tokens FLOPs a weight).
//
// out[i][j] = bf16(value), value the exact product in fp32 rounded once to nearest even:
//   Mxfp8: e4m3(w[i][j]) * 2^(scales[i][j / 32] - 127)      (exact in bf16 inside its normal range)
//   Mxfp4: e2m1(w[i][j]) * 2^(scales[i][j / 32] - 127)      (w: two codes a byte, element 2j in the low nibble)
//   Nvfp4: e2m1(w[i][j]) * (e4m3(scales[i][j / 16]) * global[0])
// -- the values formats/quantization.cpp's CPU dequantization gives, rounded to bf16. cols must be a
// multiple of 32; w 16-byte aligned with rows of cols bytes (Mxfp8) or cols / 2 (FP4); scales row-major
// [rows, cols / group]; global one fp32 on the device (Nvfp4; null otherwise); out row-major [rows, cols].
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/gemm/gemm.h"

namespace sparrow::cuda {

void dequantize_grouped(WeightCodes codes, int64_t rows, int64_t cols, const uint8_t* w, const uint8_t* scales,
                        const float* global, void* out_bf16, cudaStream_t stream);

}  // namespace sparrow::cuda
