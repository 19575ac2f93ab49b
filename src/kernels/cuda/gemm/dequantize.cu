// dequantize_grouped (dequantize.h): one thread per 8 output values (one 16-byte store of bf16), all of
// one scale group (8 divides 16 and 32).
#include "kernels/cuda/gemm/dequantize.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "core/device/cuda_check.h"
#include "core/device/stream.h"
#include "core/error.h"
#include "kernels/cuda/quant/fp4.cuh"

namespace sparrow::cuda {

namespace {

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}

template <WeightCodes C>
__global__ void dequantize_kernel(int64_t rows, int64_t cols, const uint8_t* w, const uint8_t* scales,
                                  const float* global, uint4* out) {
  constexpr int64_t GROUP = C == WeightCodes::Nvfp4 ? 16 : 32;
  const int64_t chunks = rows * (cols / 8);
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < chunks; c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = c / (cols / 8), col = (c % (cols / 8)) * 8;
    const uint8_t scale = scales[row * (cols / GROUP) + col / GROUP];
    float v[8];
    if constexpr (C == WeightCodes::Mxfp8) {
      const uint2 codes = *reinterpret_cast<const uint2*>(w + row * cols + col);
      const float s = quant::e8m0_decode(scale);
      for (int i = 0; i < 8; ++i) {
        const uint32_t word = i < 4 ? codes.x : codes.y;
        v[i] = __fmul_rn(quant::e4m3_decode(uint8_t(word >> (8 * (i % 4)))), s);
      }
    } else {
      const uint32_t codes = *reinterpret_cast<const uint32_t*>(w + row * (cols / 2) + col / 2);
      for (int i = 0; i < 8; ++i) {
        const uint32_t code = (codes >> (4 * i)) & 0xFu;
        // NVFP4 in the CPU's order, e2m1 * (e4m3 * global) (formats/quantization.cpp dequantize_nvfp4).
        v[i] = C == WeightCodes::Nvfp4
                   ? __fmul_rn(quant::e2m1_decode(code), __fmul_rn(quant::e4m3_decode(scale), *global))
                   : quant::mxfp4_decode(code, scale);
      }
    }
    out[c] = make_uint4(bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]), bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7]));
  }
}

}  // namespace

void dequantize_grouped(WeightCodes codes, int64_t rows, int64_t cols, const uint8_t* w, const uint8_t* scales,
                        const float* global, void* out_bf16, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && cols >= 0 && cols % 32 == 0, "dequantize_grouped: cols (", cols,
                ") must be a multiple of 32");
  SPARROW_CHECK(codes != WeightCodes::Nvfp4 || global != nullptr, "dequantize_grouped: NVFP4 needs its global scale");
  SPARROW_CHECK(reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out_bf16) % 16 == 0,
                "dequantize_grouped: w and out must be 16-byte aligned");
  if (rows == 0 || cols == 0) return;
  if (stream == nullptr) stream = cuda::stream();
  const int64_t chunks = rows * (cols / 8);
  const unsigned blocks = unsigned(std::min<int64_t>((chunks + 255) / 256, 8192));
  auto* out = static_cast<uint4*>(out_bf16);
  switch (codes) {
    case WeightCodes::Mxfp8:
      dequantize_kernel<WeightCodes::Mxfp8><<<blocks, 256, 0, stream>>>(rows, cols, w, scales, global, out);
      break;
    case WeightCodes::Mxfp4:
      dequantize_kernel<WeightCodes::Mxfp4><<<blocks, 256, 0, stream>>>(rows, cols, w, scales, global, out);
      break;
    case WeightCodes::Nvfp4:
      dequantize_kernel<WeightCodes::Nvfp4><<<blocks, 256, 0, stream>>>(rows, cols, w, scales, global, out);
      break;
    default: fail("dequantize_grouped: the weights must be NVFP4, MXFP4 or MXFP8");
  }
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
