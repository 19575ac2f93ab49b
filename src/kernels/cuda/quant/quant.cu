// Launchers over kernels/cuda/quant/fp4.cuh (see quant.h). One thread per value or per scale block:
// these exist to check the device codecs bit for bit, not to be fast.
#include "kernels/cuda/quant/quant.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cuda/quant/fp4.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {

namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

__global__ void encode_kernel(QuantElement element, const float* x, int64_t n, uint8_t* codes) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  codes[i] = element == QuantElement::E4m3 ? quant::e4m3_encode(x[i]) : uint8_t(quant::e2m1_encode(x[i]));
}

__global__ void decode_kernel(QuantElement element, const uint8_t* codes, int64_t n, float* x) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  switch (element) {
    case QuantElement::E4m3: x[i] = quant::e4m3_decode(codes[i]); break;
    case QuantElement::E2m1: x[i] = quant::e2m1_decode(codes[i] & 15u); break;
    case QuantElement::E8m0: x[i] = quant::e8m0_decode(codes[i]); break;
  }
}

// One thread per (row, block): the block's scale, then its codes, two a byte. Blocks start on even
// elements, so no two threads share a byte.
__global__ void quantize_kernel(Fp4Format format, const float* x, int64_t rows, int64_t width, float global,
                                uint8_t* packed, uint8_t* scales) {
  const int block = format == Fp4Format::Nvfp4 ? quant::kNvfp4Block : quant::kMxfp4Block;
  const int64_t blocks = (width + block - 1) / block;
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= rows * blocks) return;
  const int64_t row = id / blocks, b = id % blocks;
  const int64_t begin = b * block, end = min(width, begin + block);
  const float* v = x + row * width;
  float amax = 0.0f;
  bool not_finite = false;
  for (int64_t i = begin; i < end; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));  // fmaxf leaves NaNs out
    not_finite |= !isfinite(v[i]);
  }
  uint8_t scale;
  float step = 0.0f, inverse = 0.0f;
  if (format == Fp4Format::Nvfp4) {
    scale = quant::nvfp4_scale(amax, global);
    step = quant::nvfp4_step(scale, global);
  } else {
    scale = quant::mxfp4_scale(amax, not_finite);
    if (scale != quant::kE8m0Nan) inverse = quant::mxfp4_inverse(scale);
  }
  scales[row * blocks + b] = scale;
  uint8_t* out = packed + row * ((width + 1) / 2);
  for (int64_t i = begin; i < end; i += 2) {
    uint32_t code[2] = {0u, 0u};
    for (int k = 0; k < 2 && i + k < end; ++k) {
      if (format == Fp4Format::Nvfp4) code[k] = quant::nvfp4_encode(v[i + k], step);
      else if (scale != quant::kE8m0Nan) code[k] = quant::mxfp4_encode(v[i + k], inverse);
    }
    out[i / 2] = uint8_t(code[0] | (code[1] << 4));
  }
}

__global__ void dequantize_kernel(Fp4Format format, const uint8_t* packed, const uint8_t* scales, int64_t rows,
                                  int64_t width, float global, float* x) {
  const int block = format == Fp4Format::Nvfp4 ? quant::kNvfp4Block : quant::kMxfp4Block;
  const int64_t blocks = (width + block - 1) / block;
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= rows * width) return;
  const int64_t row = id / width, i = id % width;
  const uint8_t byte = packed[row * ((width + 1) / 2) + i / 2];
  const uint32_t code = (i & 1) ? byte >> 4 : byte & 15u;
  const uint8_t scale = scales[row * blocks + i / block];
  x[id] = format == Fp4Format::Nvfp4 ? quant::nvfp4_decode(code, scale, global) : quant::mxfp4_decode(code, scale);
}

}  // namespace

void quant_encode(QuantElement element, const float* x, int64_t n, uint8_t* codes, cudaStream_t stream) {
  SPARROW_CHECK(element != QuantElement::E8m0, "quant_encode: E8M0 is a block scale, encoded by fp4_quantize");
  if (n <= 0) return;
  encode_kernel<<<grid_for(n), kThreads, 0, stream>>>(element, x, n, codes);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void quant_decode(QuantElement element, const uint8_t* codes, int64_t n, float* x, cudaStream_t stream) {
  if (n <= 0) return;
  decode_kernel<<<grid_for(n), kThreads, 0, stream>>>(element, codes, n, x);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void fp4_quantize(Fp4Format format, const float* x, int64_t rows, int64_t width, float global, uint8_t* packed,
                  uint8_t* scales, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width >= 0, "fp4_quantize: bad shape ", rows, " x ", width);
  SPARROW_CHECK(format != Fp4Format::Nvfp4 || (global > 0.0f && std::isfinite(global)),
                "nvfp4: the second-level scale must be positive and finite, got ", global);
  const int block = format == Fp4Format::Nvfp4 ? quant::kNvfp4Block : quant::kMxfp4Block;
  const int64_t threads = rows * ((width + block - 1) / block);
  if (threads == 0) return;
  quantize_kernel<<<grid_for(threads), kThreads, 0, stream>>>(format, x, rows, width, global, packed, scales);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void fp4_dequantize(Fp4Format format, const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t width,
                    float global, float* x, cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && width >= 0, "fp4_dequantize: bad shape ", rows, " x ", width);
  if (rows * width == 0) return;
  dequantize_kernel<<<grid_for(rows * width), kThreads, 0, stream>>>(format, packed, scales, rows, width, global, x);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
