// Launchers over the device number codecs of kernels/cuda/quant/fp4.cuh, for tests that check them
// against the CPU reference (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h) and for tools. The cache writers
// and attention kernels call the device functions themselves, fused into their own loops.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

enum class QuantElement { E4m3, E2m1, E8m0 };
enum class Fp4Format { Nvfp4, Mxfp4 };

// n floats -> n codes, one a byte (E4M3; E2M1 in the low nibble). E8M0 has no element encode: throws.
void quant_encode(QuantElement element, const float* x, int64_t n, uint8_t* codes, cudaStream_t stream);
// n codes -> n floats (E2M1 reads the low nibble).
void quant_decode(QuantElement element, const uint8_t* codes, int64_t n, float* x, cudaStream_t stream);

// rows x width floats (contiguous rows) -> per row (width + 1) / 2 packed code bytes (element 2i in the
// low nibble; rows consecutive) and ceil(width / block) scale bytes (block 16 and E4M3 for NVFP4, 32 and
// E8M0 for MXFP4; rows consecutive). `global` is NVFP4's second-level scale (ignored for MXFP4).
void fp4_quantize(Fp4Format format, const float* x, int64_t rows, int64_t width, float global, uint8_t* packed,
                  uint8_t* scales, cudaStream_t stream);
void fp4_dequantize(Fp4Format format, const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t width,
                    float global, float* x, cudaStream_t stream);

}  // namespace sparrow::cuda
