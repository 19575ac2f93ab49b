// Writing MLA latent rows into the paged cache, with the FP8 quantisation fused in (FlashMLA's cache
// layout: per 128 latent values one fp32 scale = amax/448, values e4m3 = RNE(value/scale) saturated to
// the format's largest finite value 448; the 64 rope values stay bf16).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float load_value(const T* p);
template <>
__device__ __forceinline__ float load_value<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_value<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// One block of 128 threads per row: warp w owns latent values 128w .. 128w+127 (four per lane), which
// is exactly one scale group, so the amax is a warp reduction.
template <typename T, bool FP8>
__global__ void __launch_bounds__(128) mla_cache_write_kernel(const MlaPagedCache cache, const T* src,
                                                               const int32_t* row_seq, const int32_t* row_pos,
                                                               int32_t seq0, int64_t start_pos) {
  const int64_t i = blockIdx.x;
  const int seq = row_seq ? row_seq[i] : seq0;
  const int64_t pos = row_pos ? int64_t(row_pos[i]) : start_pos + i;
  constexpr int64_t kRowBytes = FP8 ? 656 : 1152;
  uint8_t* dst = cache.pool + cache.page_offsets[int64_t(seq) * cache.pages_stride + pos / cache.block_size] +
                 (pos % cache.block_size) * kRowBytes;
  const T* s = src + i * kMlaRow;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = load_value(s + 4 * t + k);
  if constexpr (FP8) {
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

template <typename T>
void launch_write(const MlaPagedCache& cache, const T* src, int64_t count, const int32_t* row_seq,
                  const int32_t* row_pos, int32_t seq0, int64_t start_pos, cudaStream_t stream) {
  if (cache.format == MlaCacheFormat::kFp8)
    mla_cache_write_kernel<T, true><<<unsigned(count), 128, 0, stream>>>(cache, src, row_seq, row_pos, seq0, start_pos);
  else
    mla_cache_write_kernel<T, false><<<unsigned(count), 128, 0, stream>>>(cache, src, row_seq, row_pos, seq0, start_pos);
  SPARROW_CUDA_CHECK_LAUNCH();
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
