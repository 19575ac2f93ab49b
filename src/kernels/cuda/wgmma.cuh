// Hopper's warpgroup matrix products (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
// D[64 x N] (+)= A[64 x K] · B[N x K]ᵀ by the 128 threads of a warpgroup, each holding R = N / 2 fp32
// accumulators d[R] in the ISA's fragment layout. Written once for the kernels that use them (the DSA
// indexer's FP8 and FP4 decode scores, the MoE prefill kernel, sparse MLA); the group discipline (fence, commit, wait)
// is in ptx.cuh. Device code only: include from .cu files.
//   ss_*: A and B in shared memory, given by descriptors (sw128_descriptor);
//   rs_*: A in 4 registers per thread (the A fragment of a k step), B in shared memory;
//   e4m3 products are m64nNk32 (K-major operands only); f16 / bf16 ones m64nNk16, K-major (the transpose
//   immediates 0), except ss_bf16_bn / ss_f16_bn, whose B is N-major (sw128_descriptor_mn). `accumulate` 0 writes
//   D = A·Bᵀ, 1 adds to it. Specialised for the widths in use:
//   wgmma::ss_e4m3<64>(acc, sw128_descriptor(a), sw128_descriptor(b), k > 0).
#pragma once
#include <cstdint>

#include "kernels/cuda/ptx.cuh"

namespace sparrow::cuda::wgmma {

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") of a K-major tile stored with the
// 128-byte swizzle, rows of 128 bytes: start address >> 4, leading byte offset 1 (unused when a row is one
// swizzle atom wide), stride byte offset 1024 (8-row core groups), swizzle mode 1 (128 bytes) in bits 62-63.
// A k step starts 32 bytes further along the rows (k32 of 8-bit, k16 of 16-bit values).
__device__ __forceinline__ uint64_t sw128_descriptor_u32(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ uint64_t sw128_descriptor(const void* p) { return sw128_descriptor_u32(ptx::smem_u32(p)); }

// The same for an operand stored MN-major (the transposed B of ss_bf16_bn): each swizzled 128-byte row holds
// 64 consecutive N values of one k, k rows 128 bytes apart in 8-row groups 1024 bytes apart (stride byte
// offset), and the next 64 N values `block_bytes` further on (leading byte offset: for MN-major layouts it
// steps along M / N, PTX ISA "Strides"; CUTLASS's GmmaDescriptor Major::MN). A k16 step starts 2048 bytes on.
__device__ __forceinline__ uint64_t sw128_descriptor_mn_u32(uint32_t addr, uint32_t block_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((block_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// cp.async (generic proxy) and st.shared writes become visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps a register where it is until this point: a wgmma reads its register operands and accumulators
// asynchronously, until wgmma.wait_group, so neither may be reused, read or moved across it before then
// (CUTLASS's warpgroup_fence_operand).
__device__ __forceinline__ void keep(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int R>
__device__ __forceinline__ void keep(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) keep(d[i]);
}

// The accumulator operands "+f"(d[i]), ... of R registers, and the PTX operand list {%0, ..., %R-1}.
#define SPARROW_WGMMA_D8(i)                                                                                     \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define SPARROW_WGMMA_D16(i) SPARROW_WGMMA_D8(i), SPARROW_WGMMA_D8(i + 8)
#define SPARROW_WGMMA_D32(i) SPARROW_WGMMA_D16(i), SPARROW_WGMMA_D16(i + 16)
#define SPARROW_WGMMA_D64(i) SPARROW_WGMMA_D32(i), SPARROW_WGMMA_D32(i + 32)
#define SPARROW_WGMMA_D128(i) SPARROW_WGMMA_D64(i), SPARROW_WGMMA_D64(i + 64)

#define SPARROW_WGMMA_REGS16 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define SPARROW_WGMMA_REGS32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31}"
#define SPARROW_WGMMA_REGS64 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49," \
  "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define SPARROW_WGMMA_REGS128 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
  "%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49," \
  "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73," \
  "%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97," \
  "%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116," \
  "%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"

// The products, one specialisation per width N (R = N / 2 accumulators at d): D from descriptors a and b
// (ss) or from registers a[4] and descriptor b (rs). TAIL: the immediates after the scale-d predicate
// (scale-a, scale-b and, for 16-bit types, the transposes).
template <int N>
__device__ void ss_e4m3(float* d, uint64_t a, uint64_t b, int accumulate);
template <int N>
__device__ void rs_e4m3(float* d, const uint32_t (&a)[4], uint64_t b, int accumulate);
template <int N>
__device__ void rs_f16(float* d, const uint32_t (&a)[4], uint64_t b, int accumulate);
template <int N>
__device__ void ss_bf16(float* d, uint64_t a, uint64_t b, int accumulate);
template <int N>
__device__ void ss_bf16_bn(float* d, uint64_t a, uint64_t b, int accumulate);  // B N-major (sw128_descriptor_mn)
template <int N>
__device__ void ss_f16(float* d, uint64_t a, uint64_t b, int accumulate);
template <int N>
__device__ void ss_f16_bn(float* d, uint64_t a, uint64_t b, int accumulate);  // B N-major (sw128_descriptor_mn)

#define SPARROW_WGMMA_SS(NAME, R, INSTR, TAIL, A, B, P)                                              \
  template <>                                                                                         \
  __device__ __forceinline__ void NAME<2 * R>(float* d, uint64_t a, uint64_t b, int accumulate) {     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\nwgmma.mma_async.sync.aligned." INSTR " " \
                 SPARROW_WGMMA_REGS##R ", %" #A ", %" #B ", p, " TAIL ";\n}\n"                           \
                 : SPARROW_WGMMA_D##R(0)                                                              \
                 : "l"(a), "l"(b), "r"(accumulate));                                                  \
  }
#define SPARROW_WGMMA_RS(NAME, R, INSTR, TAIL, A0, A1, A2, A3, B, P)                                     \
  template <>                                                                                             \
  __device__ __forceinline__ void NAME<2 * R>(float* d, const uint32_t (&a)[4], uint64_t b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\nwgmma.mma_async.sync.aligned." INSTR " "     \
                 SPARROW_WGMMA_REGS##R ", {%" #A0 ",%" #A1 ",%" #A2 ",%" #A3 "}, %" #B ", p, " TAIL ";\n}\n"    \
                 : SPARROW_WGMMA_D##R(0)                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                  \
  }

// e4m3 x e4m3, k32.
SPARROW_WGMMA_SS(ss_e4m3, 16, "m64n32k32.f32.e4m3.e4m3", "1, 1", 16, 17, 18)
SPARROW_WGMMA_SS(ss_e4m3, 32, "m64n64k32.f32.e4m3.e4m3", "1, 1", 32, 33, 34)
SPARROW_WGMMA_SS(ss_e4m3, 64, "m64n128k32.f32.e4m3.e4m3", "1, 1", 64, 65, 66)
SPARROW_WGMMA_RS(rs_e4m3, 16, "m64n32k32.f32.e4m3.e4m3", "1, 1", 16, 17, 18, 19, 20, 21)
SPARROW_WGMMA_RS(rs_e4m3, 32, "m64n64k32.f32.e4m3.e4m3", "1, 1", 32, 33, 34, 35, 36, 37)
SPARROW_WGMMA_RS(rs_e4m3, 64, "m64n128k32.f32.e4m3.e4m3", "1, 1", 64, 65, 66, 67, 68, 69)
// f16 x f16, k16, B K-major.
SPARROW_WGMMA_RS(rs_f16, 16, "m64n32k16.f32.f16.f16", "1, 1, 0", 16, 17, 18, 19, 20, 21)
SPARROW_WGMMA_RS(rs_f16, 32, "m64n64k16.f32.f16.f16", "1, 1, 0", 32, 33, 34, 35, 36, 37)
SPARROW_WGMMA_RS(rs_f16, 64, "m64n128k16.f32.f16.f16", "1, 1, 0", 64, 65, 66, 67, 68, 69)
// bf16 x bf16, k16, A and B K-major.
SPARROW_WGMMA_SS(ss_bf16, 32, "m64n64k16.f32.bf16.bf16", "1, 1, 0, 0", 32, 33, 34)
SPARROW_WGMMA_SS(ss_bf16, 64, "m64n128k16.f32.bf16.bf16", "1, 1, 0, 0", 64, 65, 66)
SPARROW_WGMMA_SS(ss_bf16, 128, "m64n256k16.f32.bf16.bf16", "1, 1, 0, 0", 128, 129, 130)
// bf16 x bf16, k16, A K-major, B N-major (tnsp-b = 1): a tile stored key-major read as the right operand of
// P V, where V's rows are the keys.
SPARROW_WGMMA_SS(ss_bf16_bn, 128, "m64n256k16.f32.bf16.bf16", "1, 1, 0, 1", 128, 129, 130)
// The same two shapes on f16 (sparse MLA's FP8 latents, widened to f16 in one conversion a pair).
SPARROW_WGMMA_SS(ss_f16, 32, "m64n64k16.f32.f16.f16", "1, 1, 0, 0", 32, 33, 34)
SPARROW_WGMMA_SS(ss_f16_bn, 128, "m64n256k16.f32.f16.f16", "1, 1, 0, 1", 128, 129, 130)

#undef SPARROW_WGMMA_SS
#undef SPARROW_WGMMA_RS
#undef SPARROW_WGMMA_REGS16
#undef SPARROW_WGMMA_REGS32
#undef SPARROW_WGMMA_REGS64
#undef SPARROW_WGMMA_REGS128
#undef SPARROW_WGMMA_D128
#undef SPARROW_WGMMA_D64
#undef SPARROW_WGMMA_D32
#undef SPARROW_WGMMA_D16
#undef SPARROW_WGMMA_D8

}  // namespace sparrow::cuda::wgmma
