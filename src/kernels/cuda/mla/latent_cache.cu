// Writing MLA latent rows into the paged cache, the quantisation fused into the write (one launch, one
// block of 128 threads a row). Each format's bytes are those of its CPU page codec (cache/page_codec.cpp):
//   kFp8     FlashMLA's layout: per 128 latent values one fp32 scale = amax/448, values e4m3 =
//            RNE(value/scale) saturated to 448; the 64 rope values stay bf16.
//   kBf16    576 bf16 values.
//   kFp8Rows 576 e4m3(x / kMlaTensorScale) values (the per-layer scale, 1.0).
//   kNvfp4   NVFP4 (kernels/cpu/fp4_codec.h) over the 512 latent values: per 16 values the e4m3 block scale
//            e4m3((amax/6)/kMlaTensorScale), codes e2m1(|x| / step) with the sign, two a byte; the rope
//            as e4m3(x / kMlaTensorScale); layout [256 B codes | 64 B rope | 32 B scales in order].
// The narrow formats use the device twins of the CPU codecs (kernels/cuda/quant/fp4.cuh), whose bits
// tests/cuda/quant_test.cpp pins to the CPU's, so NaN, infinities, zeros and saturation agree too.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/paged.cuh"
#include "kernels/cuda/quant/fp4.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float load_value(const T* p);
template <>
__device__ __forceinline__ float load_value<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_value<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// The e4m3 byte the CPU's Fp8RowsCodec / Nvfp4LatentCodec store for x: float_to_e4m3(x / kKvTensorScale).
__device__ __forceinline__ uint32_t e4m3_of(float x) {
  return quant::e4m3_encode(__fdiv_rn(x, kMlaTensorScale));
}

// One block of 128 threads per row; thread t owns latent values 4t .. 4t+3 and, for t < 32, rope values
// 2t, 2t+1. kFp8: warp w's 128 values are exactly one scale group, so the amax is a warp reduction.
// kNvfp4: the 4 threads 4b .. 4b+3 (consecutive lanes of one warp) hold NVFP4 block b.
template <typename T, PageFormat F>
__global__ void __launch_bounds__(128) mla_cache_write_kernel(const MlaPagedCache cache, const T* src,
                                                               const int32_t* row_seq, const int32_t* row_pos,
                                                               int32_t seq0, int64_t start_pos) {
  const int64_t i = blockIdx.x;
  const int seq = row_seq ? row_seq[i] : seq0;
  const int64_t pos = row_pos ? int64_t(row_pos[i]) : start_pos + i;
  constexpr int64_t kRowBytes = MlaRowBytes<F>::value;
  const PagedSlot at = paged_slot(cache.pool, cache.page_offsets, cache.pages_stride, seq, pos, cache.block_size);
  uint8_t* dst = at.page + at.slot * kRowBytes;
  const T* s = src + i * kMlaRow;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = load_value(s + 4 * t + k);
  if constexpr (F == PageFormat::Fp8Latent) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax / 448.0f;
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = scale > 0.f ? v[k] / scale : 0.f;  // IEEE division, as the CPU does
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[0], x[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[2], x[3]), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(dst + 4 * t) = lo | (hi << 16);
    if (lane == 0) *reinterpret_cast<float*>(dst + 512 + 4 * warp) = scale;
    if (t < 32) {
      const __nv_bfloat162 r = __floats2bfloat162_rn(load_value(s + 512 + 2 * t), load_value(s + 512 + 2 * t + 1));
      *reinterpret_cast<__nv_bfloat162*>(dst + 528 + 4 * t) = r;
    }
  } else if constexpr (F == PageFormat::Fp8Rows) {
    *reinterpret_cast<uint32_t*>(dst + 4 * t) =
        e4m3_of(v[0]) | (e4m3_of(v[1]) << 8) | (e4m3_of(v[2]) << 16) | (e4m3_of(v[3]) << 24);
    if (t < 32) {
      const uint32_t r = e4m3_of(load_value(s + 512 + 2 * t)) | (e4m3_of(load_value(s + 512 + 2 * t + 1)) << 8);
      *reinterpret_cast<uint16_t*>(dst + 512 + 2 * t) = uint16_t(r);
    }
  } else if constexpr (F == PageFormat::Nvfp4Latent) {
    // Block amax over 4 lanes; starting from 0 and using fmaxf leaves NaNs out, as the CPU's std::fmax does
    // (a block of NaNs only has amax 0).
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) amax = fmaxf(amax, fabsf(v[k]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const uint8_t scale = quant::nvfp4_scale(amax, kMlaTensorScale);
    const float step = quant::nvfp4_step(scale, kMlaTensorScale);
    uint32_t c[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = quant::nvfp4_encode(v[k], step);
    // Values 4t .. 4t+3 are bytes 2t, 2t+1; element 2i in the low nibble (cpu::fp4_code).
    *reinterpret_cast<uint16_t*>(dst + 2 * t) = uint16_t(c[0] | (c[1] << 4) | (c[2] << 8) | (c[3] << 12));
    if ((t & 3) == 0) dst[256 + 64 + (t >> 2)] = scale;
    if (t < 32) {
      const uint32_t r = e4m3_of(load_value(s + 512 + 2 * t)) | (e4m3_of(load_value(s + 512 + 2 * t + 1)) << 8);
      *reinterpret_cast<uint16_t*>(dst + 256 + 2 * t) = uint16_t(r);
    }
  } else {
    __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst + 8 * t);
    d[0] = __floats2bfloat162_rn(v[0], v[1]);
    d[1] = __floats2bfloat162_rn(v[2], v[3]);
    if (t < 32) {
      const __nv_bfloat162 r = __floats2bfloat162_rn(load_value(s + 512 + 2 * t), load_value(s + 512 + 2 * t + 1));
      *reinterpret_cast<__nv_bfloat162*>(dst + 1024 + 4 * t) = r;
    }
  }
}

template <typename T, PageFormat F>
void launch_format(const MlaPagedCache& cache, const T* src, int64_t count, const int32_t* row_seq,
                   const int32_t* row_pos, int32_t seq0, int64_t start_pos, cudaStream_t stream) {
  mla_cache_write_kernel<T, F><<<unsigned(count), 128, 0, stream>>>(cache, src, row_seq, row_pos, seq0, start_pos);
  SPARROW_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_write(const MlaPagedCache& cache, const T* src, int64_t count, const int32_t* row_seq,
                  const int32_t* row_pos, int32_t seq0, int64_t start_pos, cudaStream_t stream) {
  switch (cache.format) {
    case PageFormat::Fp8Latent:
      return launch_format<T, PageFormat::Fp8Latent>(cache, src, count, row_seq, row_pos, seq0, start_pos, stream);
    case PageFormat::BFloat16:
      return launch_format<T, PageFormat::BFloat16>(cache, src, count, row_seq, row_pos, seq0, start_pos, stream);
    case PageFormat::Fp8Rows:
      return launch_format<T, PageFormat::Fp8Rows>(cache, src, count, row_seq, row_pos, seq0, start_pos, stream);
    case PageFormat::Nvfp4Latent:
      return launch_format<T, PageFormat::Nvfp4Latent>(cache, src, count, row_seq, row_pos, seq0, start_pos, stream);
      default: break;  // a format these kernels do not read: refused below or at the entry
  }
  fail("mla cache write: unknown cache format ", int(cache.format));
}

}  // namespace

void mla_cache_write(const MlaPagedCache& cache, const void* src, MlaSourceType src_type, int64_t count,
                     const int32_t* row_seq, const int32_t* row_pos, int32_t seq0, int64_t start_pos,
                     cudaStream_t stream) {
  SPARROW_CHECK(count >= 0 && count < (int64_t(1) << 31), "mla cache write: bad row count ", count);
  if (count == 0) return;
  SPARROW_CHECK(src && cache.pool && cache.page_offsets && cache.block_size > 0, "mla cache write: null pointer");
  SPARROW_CHECK(row_pos || start_pos >= 0, "mla cache write: negative start position ", start_pos);
  if (src_type == MlaSourceType::kFloat32)
    launch_write(cache, static_cast<const float*>(src), count, row_seq, row_pos, seq0, start_pos, stream);
  else
    launch_write(cache, static_cast<const __nv_bfloat16*>(src), count, row_seq, row_pos, seq0, start_pos, stream);
}

}  // namespace sparrow::cuda
