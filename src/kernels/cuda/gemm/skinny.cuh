// Skinny products: few activation rows (<= 8 per pass) against a big weight matrix, streamed from HBM.
// One kernel template (skinny::kernel<Job, Codes>) serves the MoE decode path (moe/moe.cu: gate/up with the
// activation fused, down with the pair weight; rows gathered per expert) and the dense decode-sized
// products (gemm/gemm_skinny.cu, ops::linear at m <= 8). Device code only: include from .cu files.
//
// The products are bound by reading the weights once (DeepSeek-V3.2 at 1 token: 8 experts x 44 MB of e4m3
// = 82 us at 4.3 TB/s; the 2.5 GB bf16 lm_head = 0.6 ms); tiled tensor-core GEMMs would be mostly
// padding at these sizes. Here:
//   - grid: blockIdx.x a slice (MoE: one touched expert, its rows; dense: the one matrix, all m rows),
//     blockIdx.y `warps` consecutive 16-row weight groups, blockIdx.z a range of K (split-K, dense only:
//     job.chunk_slabs slabs per z; the MoE jobs use one range, the whole row).
//   - a warp owns one group of 16 weight rows (the Job maps group and lane to the two rows it reads: MoE
//     gate/up: gate rows i and up rows i of 8 outputs i = 8 group + g, so each lane holds the gate and the
//     up sum of the same (row, output) and the activation is fused; down and dense: 16 rows of out = 16
//     outputs). It walks its K range in slabs of 64 bytes per row: lane (g = lane / 4, t = lane % 4) uses
//     16 bytes (16 e4m3 codes or 8 bf16) at byte 64 s + 16 t of weight rows g and g + 8. The bytes come
//     through a ring in shared memory (make_plan's `rings`): the warp copies two slabs of its 16 rows at a
//     time with cp.async, whole 128-byte lines an instruction (4 rows x 128 bytes), STAGES = 3 stages
//     deep, and each lane reads its pieces back; read straight into registers instead (8 rows x 64 bytes
//     an instruction, half lines, U = 4 slabs ahead), the same bytes came 1.17-1.27x slower
//     (bench/probes/stream_probe.cu). Where the rings would cost an SM one of its CTAs (8 staged rows of
//     6-7K columns beyond 64 tokens, or with FP4 codes), the warps read straight into registers;
//   - the slice's activation rows (job.act_row: gathered through sorted_pair for MoE gate/up, contiguous
//     for down and dense), up to `rows` of them (<= 8) per pass and only the columns of the CTA's K range,
//     are staged once per pass into shared memory (bf16, cp.async, issued after the first weight slabs are
//     requested), row pitch padded so that the fragment reads below are free of bank conflicts; a slice
//     with more rows would loop over passes of `rows` rows, re-reading its weights (the MoE schedule cuts
//     an expert's rows into slices of one pass instead, moe.cu; dense products have at most 8 rows);
//   - products on the tensor cores, mma.sync m16n8k16 (bf16 in, fp32 accumulators; PTX ISA "Matrix
//     Fragments for mma.m16n8k16"): A = the 16 weight rows, B = up to 8 activation rows (n = row of the
//     pass; rows past the pass are zero), C = 16 x 8 fp32. A dot product does not depend on the order of
//     k, so each lane's own 16-byte pieces are its fragment: in mma j of a slab, lane t's k = 2t, 2t+1 are
//     its columns 4j, 4j+1 and k = 2t+8, 2t+9 its columns 4j+2, 4j+3 -- the same assignment for the
//     weights (A) and the activations (B), so no shuffles and no shared-memory staging of the weights.
//     FP8: e4m3 pairs -> bf16 pairs with cuda_fp8.h's x2 conversion (exact: e4m3 values are bf16 values);
//     each 128-column block (two slabs) accumulates on the raw codes, and the block partial is then
//     multiplied by its scale into the fp32 accumulator (a K range starts at an even slab, so a block never
//     straddles two ranges);
//     FP4 (NVFP4 / MXFP4, as released, read in place): a lane's 16 bytes are 32 columns; each 32-bit word
//     (8 codes) becomes four bf16 pairs by shifts and masks, pair i = codes i and i + 4 of the word (so one
//     pair of shifts serves both halves), each pair times its group's scale, exactly (fp4_to_bf16x2); the
//     activations are staged in that column order (fp4_pair_order), so A and B still meet column by column;
//     NVFP4's per-matrix weight_scale_2 is the Job's (applied in its store);
//     MXFP8 (as released, read in place): e4m3 pairs -> bf16 pairs as FP8's, each times its row's E8M0
//     group scale (a lane's 16 columns lie in one group of 32) in one bf16x2 product, exact;
//   - epilogue from the accumulators (job.store): lane (g, t) holds rows g, g + 8 for pass rows 2t, 2t + 1.
// Why the tensor cores and not FMAs: at 1.9 GHz an SM must take ~17 weight bytes per clock for 4.3 TB/s
// (32.6 GB/s per SM), i.e. a warp's 512-byte load instruction buys at most ~30 clocks x 4 schedulers =
// ~120 issue slots, ~120 instructions per lane per 16 bytes (7.5 per byte). With FMAs, 16 e4m3 codes x 8
// rows are 128 FFMA per 16 bytes (H200 fp32 peak ~67 TFLOP/s vs 2 x 8 x 4.3e12 = 69 TFLOP/s needed):
// compute-bound at 8 rows. Here, per slab (32 weight bytes per lane), FP8: 2 weight loads (LDG.128, or
// LDS.128 from the ring and its share of the cp.async), 16 e4m3x2 -> f16x2,
// 32 f16 -> f32 and 16 f32x2 -> bf16x2 conversions, 4 mma, 2 LDS.128 of activations, 2 scale loads, ~2
// FFMA (the block scale, every other slab), address and loop arithmetic: ~110 instructions in the SASS
// (sm_90a, nvcc 13.0), ~55 per 16 bytes = 3.4 per byte whatever the rows, ~45% of the issue budget.
// bf16 weights, no conversion: ~45 per slab, 1.4 per byte. Tensor-core rate needed: 2 x 16 x 8 x 16 FLOP
// per 256 bytes of e4m3 = 16 FLOP/B, 69 TFLOP/s at 4.3 TB/s, a small fraction of mma.sync's rate (the 4
// dependent mma per slab and warp, ~30 clocks each, are covered by the other warps). Shared memory: per
// slab a lane reads 32 (FP8) or 16 (bf16) bytes of activations for 32 weight bytes, well under 128
// B/clock per SM. Bytes in flight: 2-3 stages of 2 KB a warp with the rings (4 KB with U = 4 slabs in
// registers); registers (MoE FP8: 92-99 per thread with the rings, 115-117 without) leave 16-20 warps per SM:
// 64-96 KB, twice or more the ~30 KB per SM that 4.3 TB/s x ~1 us of loaded latency needs -- provided the
// grid has that many warps, which is why the dense launcher splits K when the matrix has few 16-row groups
// (gemm_skinny.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/gemm/gemm.h"
#include "kernels/cuda/ptx.cuh"
#include "core/device/cuda_check.h"

namespace sparrow::cuda::skinny {

using bf16 = __nv_bfloat16;

// How the weight rows are stored: bf16; e4m3 with DeepSeek's 128x128 block scales (fp32, Fp8); or as the
// MX / NV formats are released, with one scale per group of consecutive values along a row (OCP MX v1.0;
// ModelOpt NVFP4), row-major [rows, K / group] beside the codes: FP4 two E2M1 codes a byte (element 2i in
// the low nibble) with an E4M3 scale per 16 values (NVFP4, and a per-matrix global scale) or an E8M0 scale
// per 32 (MXFP4); MXFP8 one e4m3 code a byte with an E8M0 scale per 32.
using Codes = WeightCodes;  // gemm.h
__host__ __device__ constexpr bool is_fp4(Codes c) { return c == Codes::Nvfp4 || c == Codes::Mxfp4; }
// Group-scaled codes (the scales read per row and group, not per 128x128 block).
__host__ __device__ constexpr bool has_groups(Codes c) { return is_fp4(c) || c == Codes::Mxfp8; }
// Weight columns in a lane's 16-byte piece: 8 bf16, 16 e4m3, 32 e2m1.
__host__ __device__ constexpr int piece_cols(Codes c) { return c == Codes::Bf16 ? 8 : is_fp4(c) ? 32 : 16; }
// Columns per group scale.
__host__ __device__ constexpr int group_size(Codes c) { return c == Codes::Nvfp4 ? 16 : 32; }
// Bytes of one weight row of K columns.
__host__ __device__ constexpr int64_t row_bytes_of(Codes c, int64_t K) { return K * 16 / piece_cols(c); }

constexpr int MAX_ROWS = 8;             // rows per pass: the n of mma.m16n8k16
constexpr int SLAB = 64;                // weight bytes per row and slab
// The weights reach registers through shared memory: a warp copies its 16 rows a stage of two slabs at a
// time (16 x 128 bytes, whole 128-byte lines an instruction: 1.17-1.27x the bandwidth of the half lines a
// direct load of the fragments asks for, bench/probes/stream_probe.cu), STAGES stages deep.
// When the rings would cost an SM one of its CTAs (8 staged rows of 6-7K columns: two CTAs of ~100-115 KB
// fit, not with 48 KB of rings each), the warps load their fragments straight from global memory instead, U
// slabs ahead in registers (make_plan decides; kernels.md has both measured).
constexpr int STAGE_BYTES = 16 * 2 * SLAB;
constexpr int STAGES = 3;
constexpr int RING_BYTES = STAGES * STAGE_BYTES;  // per warp
constexpr int U = 4;                    // slabs in flight per lane without rings
constexpr int MAX_THREADS = 256;        // 4 or 8 warps per CTA (make_plan)
constexpr int SMEM_CAP = 113 * 1024;    // staged activations: two CTAs per SM fit (228 KB per SM, 1 KB reserved per CTA)
constexpr int MAX_SMEM = 227 * 1024;    // a CTA's limit: the staged rows and the warps' rings

// What a CTA works on: rows [begin, end) of its slice's activations (MoE: the expert's sorted rows; dense:
// all m rows) against the slice's weights (MoE: expert `index`; dense: index 0).
struct Slice {
  int32_t index, begin, end;
};

// The two weight rows of a lane (row starts; they need not exist: lo_ok / hi_ok), their block scales
// (FP8: one fp32 per 128 columns, s_lo[kb] for column block kb; FP4: the rows' group scales, q_lo[kg]
// for column group kg), and the output columns they feed.
struct LaneRows {
  const uint8_t* lo;
  const uint8_t* hi;
  const float* s_lo;
  const float* s_hi;
  const uint8_t* q_lo;
  const uint8_t* q_hi;
  int64_t lo_col, hi_col;
  bool active, lo_ok, hi_ok;  // active: the warp's group exists (uniform over the warp)
};

// The rows of one plain [N, K] weight matrix (a dense product's, or one expert's down projection) that
// lane g of 16-row group `group` streams: rows 16 group + g and + 8, inside one 128-row scale block, the
// last group possibly partial. `scales`: the matrix's [ceil(N/128), ceil(K/128)] block scales (FP8, fp32)
// or [N, K / group] group scales (one byte each).
template <Codes C>
__device__ __forceinline__ LaneRows matrix_lane_rows(const uint8_t* w, const void* scales, int64_t N, int64_t K,
                                                     int64_t group, int g) {
  const int64_t row_bytes = row_bytes_of(C, K);
  LaneRows r{};
  r.lo_col = 16 * group + g;
  r.hi_col = r.lo_col + 8;
  r.lo = w + r.lo_col * row_bytes;
  r.hi = w + r.hi_col * row_bytes;
  r.active = 16 * group < N;
  r.lo_ok = r.lo_col < N;
  r.hi_ok = r.hi_col < N;
  if constexpr (C == Codes::Fp8)
    r.s_lo = r.s_hi = static_cast<const float*>(scales) + ((16 * group) / 128) * ((K + 127) / 128);
  if constexpr (has_groups(C)) {
    r.q_lo = static_cast<const uint8_t*>(scales) + r.lo_col * (K / group_size(C));
    r.q_hi = static_cast<const uint8_t*>(scales) + r.hi_col * (K / group_size(C));
  }
  return r;
}

// 16 weight bytes, read once: no L1 allocation (nothing else reads them in this kernel), and the L2 asked
// to fetch the whole aligned 256-byte block around them (the row's next pieces are this lane's next
// slabs, past a row's end the next row's first; an aligned block never straddles a page, so a prefetch
// past the tensor's end cannot fault).
__device__ __forceinline__ uint4 ldg_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The two e4m3 codes in the low 16 bits of `two` (lower byte first) as a bf16 pair: e4m3 -> f16 exact
// (cvt.rn.f16x2.e4m3x2), f16 -> f32 exact, f32 -> bf16 exact (an e4m3 value has 4 significant bits and
// an exponent in [-9, 8]).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(hr));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  uint32_t bits;
  memcpy(&bits, &b, sizeof(bits));
  return bits;
}

// a * b in bf16 pairs, rounded once (fma.rn.bf16x2 with -0: exact whenever the product is, subnormals
// included; PTX ISA "Half Precision Floating Point Instructions: fma").
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Eight E2M1 codes (one 32-bit word, code k in bits 4k..4k+3: sign, two exponent bits, one mantissa bit;
// OCP MX v1.0 5.3.3) -> four bf16 pairs times the group scale pair `scale` (fp4_scale_pairs: the scale
// times 2^110): pair i = codes i and i + 4, so the same two shifts place both halves. A code's magnitude
// bits at bf16 bits 8..6 read as its value times 2^-126 (code 1 = 0.5 as the subnormal 2^-127), its sign
// at bit 15; one product with the scale pair gives e2m1 * scale * 2^-16, exact in bf16 (E2M1 values have 2
// significant bits, an E4M3 scale 4, an E8M0 scale is a power of two; every E4M3 scale and the E8M0
// scales 2^-110 .. 2^17 stay in bf16's normal range: weights' MX scales sit far inside it). The Job
// multiplies its fp32 sums by 2^16 (FP4_UNSCALE).
// Per pair: two shifts, two logic operations and one bf16x2 product.
constexpr float FP4_UNSCALE = 65536.0f;
__device__ __forceinline__ void fp4_to_bf16x2(uint32_t w, uint32_t scale, uint32_t out[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t mag = (i < 2 ? w << (6 - 4 * i) : w >> (4 * i - 6)) & 0x01C001C0u;
    const uint32_t sign = (w << (12 - 4 * i)) & 0x80008000u;
    out[i] = bf16x2_mul(mag | sign, scale);
  }
}

// A lane's group scales (load: the raw bytes of its 16-byte piece) as bf16 pairs of scale * 2^110 for the
// piece's two 16-column halves: NVFP4 two E4M3 codes (2^-9 .. 448: exact in bf16 after the shift),
// MXFP4 one E8M0 code for both (2^(e - 127 + 110): exponent field e + 110; a scale above 2^17, e > 144,
// and the NaN code 255 read as infinity, one below 2^-110 loses bits to bf16's subnormals).
template <Codes C>
__device__ __forceinline__ void fp4_scale_pairs(uint32_t raw, uint32_t pairs[2]) {
  if constexpr (C == Codes::Nvfp4) {
    // 0x7680 = 2^110 in bf16; the e4m3 values are exact in bf16 and so are their products with it.
    const uint32_t two = bf16x2_mul(e4m3x2_to_bf16x2(raw), 0x76807680u);
    pairs[0] = __byte_perm(two, 0, 0x1010);
    pairs[1] = __byte_perm(two, 0, 0x3232);
  } else {
    const uint32_t e = (raw & 0xffu) + 110u;
    const uint32_t bits = e >= 255u ? 0x7F80u : e << 7;
    pairs[0] = pairs[1] = bits | (bits << 16);
  }
}

// An E8M0 scale (2^(e - 127); OCP MX v1.0 5.4.1) as a bf16 pair: bf16's exponent has the same bias, so
// the code is the exponent field (e = 0, 2^-127, is bf16's subnormal 0x0040; the NaN code 255 reads as
// NaN). Times an e4m3 value (4 significant bits) the product is exact while it stays in bf16's normal
// range, which weights' scales do.
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t e) {
  e &= 0xffu;
  const uint32_t bits = e == 0u ? 0x0040u : e == 255u ? 0x7FC0u : e << 7;
  return bits | (bits << 16);
}

// Eight bf16 activations (a0..a7, lowest address first) in the FP4 pair order: (a0, a4), (a1, a5),
// (a2, a6), (a3, a7), the columns fp4_to_bf16x2's pairs hold.
__device__ __forceinline__ uint4 fp4_pair_order(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                    __byte_perm(v.y, v.w, 0x7632));
}

// The staged activation row pitch (bytes) for `cols` columns. Lanes 0-7 of a fragment read (one
// shared-memory phase of a 16-byte load) are rows g = 0, 1 at the same 4 column pieces, so the second
// row must land on the other banks: FP8: pieces of 32 bytes at stride 32 (row bytes 0-15 of each, then
// 16-31): a pitch = 16 (mod 32) interleaves them; bf16: 64 contiguous bytes per row: a pitch = 64
// (mod 128) puts the second row's 64 bytes on the other half of the banks. FP4: lane t reads 64 bytes
// at 64 t, its 16-byte chunk v at chunk v ^ (t & 2) (the staging swizzles chunk c to c ^ 2 when c's bit 3
// is set), so lanes 0-3 of a row hit 4 distinct chunk positions mod 8 and a pitch = 16 (mod 128) puts row
// 1 on the other 4.
inline int64_t pitch_bytes(int64_t cols, Codes c) {
  if (c == Codes::Fp8 || c == Codes::Mxfp8) return 2 * cols + 16;
  if (is_fp4(c)) return (2 * cols + 127) / 128 * 128 + 16;
  return (2 * cols + 63) / 128 * 128 + 64;
}

// Rows per pass, shared memory and CTA size for a K range of `cols` columns and up to `max_rows` rows
// per slice: up to 8 rows (never more than a slice can have), their staging within SMEM_CAP. 4 warps per
// CTA while >= 4 CTAs fit an SM by shared memory (registers then allow 4 FP8 or 6 bf16 CTAs: 16-24 warps
// per SM), else 8 warps. Shared memory: the staged rows, then each warp's ring.
struct Plan {
  int rows, pitch, warps;
  bool rings;  // the weights through shared memory (else straight into registers)
  size_t smem;
};
__host__ __device__ constexpr size_t ring_offset(int rows, int pitch) { return (size_t(rows) * pitch + 127) / 128 * 128; }
inline Plan make_plan(int64_t max_rows, int64_t cols, Codes codes) {
  Plan d{};
  d.pitch = int(pitch_bytes(cols, codes));
  d.rows = int(std::min<int64_t>({MAX_ROWS, max_rows, SMEM_CAP / d.pitch}));
  // Warps an SM holds by shared memory (at most 16: the registers' limit), with and without the rings.
  auto warps_per_sm = [&](bool rings, int& warps) {
    const size_t staged = ring_offset(d.rows, d.pitch);
    warps = (228 * 1024) / (staged + (rings ? 4 * RING_BYTES : 0) + 1024) >= 4 ? 4 : 8;
    const size_t cta = staged + (rings ? size_t(warps) * RING_BYTES : 0) + 1024;
    return std::min<size_t>(16, (228 * 1024) / cta * warps);
  };
  // Where the rings cost warps (8 staged rows of 6-7K columns: 8 warps an SM with them, 16 without), they
  // still win up to 64 rows in all (a decode step of up to 64 tokens) for bf16 and e4m3 weights (FP8
  // experts of DeepSeek-V3.2 at 8-64 tokens 1.13-1.19x, MXFP8 1.35-1.39x), not for FP4 codes, whose
  // registers are the tighter (MXFP4 0.90-0.93x), nor beyond 64 tokens (bench/results/kernels.md, "Whole
  // lines through shared memory").
  int ring_warps = 0, direct_warps = 0;
  const int with_rings = warps_per_sm(true, ring_warps), without = warps_per_sm(false, direct_warps);
  d.rings = with_rings >= without || (max_rows <= 64 && !is_fp4(codes));
  d.warps = d.rings ? ring_warps : direct_warps;
  d.smem = ring_offset(d.rows, d.pitch) + (d.rings ? size_t(d.warps) * RING_BYTES : 0);
  return d;
}

// Job: the caller's description of the product, passed by value. Fields the kernel reads:
//   int64_t K;        columns (weights per row)
//   int rows, pitch;  activation rows per pass (1..MAX_ROWS) and their staged pitch (make_plan)
//   int chunk_slabs;  SPLIT_K only: slabs per blockIdx.z (even for FP8: a 128-column block never
//                     straddles two ranges)
// constants
//   static constexpr bool SPLIT_K;         blockIdx.z selects a K range (else one range, the whole row)
//   static constexpr bool TWO_SCALE_ROWS;  FP8: rows lo and hi lie in different 128-row scale blocks
//                                          (gate/up); else s_hi is not read (one scale load per slab)
// and device methods:
//   bool slice(Slice&) const;                         blockIdx.x's slice; false: a surplus CTA, exit
//   LaneRows lane_rows(const Slice&, int64_t group, int g) const;
//   const bf16* act_row(const Slice&, int64_t row) const;   activation row `row` (begin <= row < end)
//   void store(const Slice&, int64_t row, int64_t group, int g, float lo, float hi) const;
//                    the two sums of pass row `row` (columns lo_col, hi_col of lane_rows(slice, group, g);
//                    recomputed there rather than kept live across the K loop: registers)
template <class Job, Codes C, bool RINGS>
__global__ void __launch_bounds__(MAX_THREADS) kernel(const Job job) {
  // FP8: 128x128 block scales on the block partials; MX8: e4m3 codes times their group scale in bf16;
  // GROUPED: the group-scaled codes (FP4 and MX8), scaled in registers before the products.
  constexpr bool FP8 = C == Codes::Fp8, FP4 = is_fp4(C), MX8 = C == Codes::Mxfp8, GROUPED = has_groups(C);
  extern __shared__ __align__(128) uint8_t act_smem[];  // [rows][pitch] bf16 activation rows (the K range),
                                                        // then each warp's ring (ring_offset)
  Slice slice;
  if (!job.slice(slice)) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int64_t group = int64_t(blockIdx.y) * (blockDim.x / 32) + warp;
  const int64_t K = job.K;
  constexpr int64_t CPB = piece_cols(C);     // columns per 16 weight bytes
  constexpr bool TWO_SCALE_ROWS = Job::TWO_SCALE_ROWS;
  const int64_t row_bytes = row_bytes_of(C, K);  // a multiple of 16 (K % 8 bf16, % 16 FP8, % 32 FP4)
  const int nslabs = int((row_bytes + SLAB - 1) / SLAB);
  // This CTA's K range: slabs [s_begin, s_end), columns [s_begin * SLAB / ES, ...).
  // (Compile-time off for the MoE jobs: the run-time range cost them 6-29 registers per thread, up to a
  // third of the bf16 gate/up product's occupancy.)
  int s_begin = 0, s_end = nslabs;
  if constexpr (Job::SPLIT_K) {
    s_begin = int(blockIdx.z) * job.chunk_slabs;
    s_end = min(nslabs, s_begin + job.chunk_slabs);
  }
  const int64_t byte_begin = int64_t(s_begin) * SLAB;  // staged activations start at this weight byte's column
  const int64_t col_begin = byte_begin * CPB / 16, col_end = min(K, int64_t(s_end) * SLAB * CPB / 16);

  const LaneRows lr = job.lane_rows(slice, group, g);
  // The copies: lane l moves chunk l % 8 (16 bytes) of the warp's rows 4 i + l / 8, i = 0..3, a stage's 128
  // bytes of each row (rows 0..7 are the lanes' lo rows, 8..15 their hi rows). Chunk c of row r sits at
  // chunk c ^ 4 (r & 1) of the row's 128 bytes in the ring, so that the fragment reads below (lanes of rows
  // g, g + 1 at the same chunks) hit all 32 banks.
  const int copy_chunk = lane % 8;
  const uint8_t* copy_row[4];
  bool copy_ok[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * i + lane / 8, owner = 4 * (r % 8);
    const uint8_t* lo = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(lr.lo), owner));
    const uint8_t* hi = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(lr.hi), owner));
    const bool lo_ok = __shfl_sync(0xffffffffu, lr.lo_ok, owner), hi_ok = __shfl_sync(0xffffffffu, lr.hi_ok, owner);
    copy_row[i] = r < 8 ? lo : hi;
    copy_ok[i] = r < 8 ? lo_ok : hi_ok;
  }
  uint8_t* const ring = act_smem + ring_offset(job.rows, job.pitch) + warp * RING_BYTES;
  auto ring_chunk = [&](int buffer, int r, int c) { return ring + buffer * STAGE_BYTES + r * 128 + ((c ^ ((r & 1) << 2)) << 4); };

  // Scales ride beside the bytes, as far ahead: slot u (compile-time after unrolling) is slab s's, with
  // rings slab h of buffer b in slot 2 b + h, without the slab (s - s_begin) % U.
  constexpr int SLOTS = RINGS ? 2 * STAGES : U;
  float c_lo[SLOTS], c_hi[SLOTS];     // FP8: the slab's block scales
  uint32_t q_lo[SLOTS], q_hi[SLOTS];  // GROUPED: the raw group scales of the lane's piece
  uint4 r_lo[RINGS ? 1 : U], r_hi[RINGS ? 1 : U];  // without rings: the slabs' weight pieces
  auto load_scales = [&](int u, int s) {
    const int64_t off = int64_t(s) * SLAB;
    const bool in = off + t * 16 < row_bytes;  // the lane's 16 bytes are all in or all out of the row
    if constexpr (FP8) {
      c_lo[u] = __ldg(lr.s_lo + s / 2);  // slab s (64 columns) lies in block s / 2
      c_hi[u] = TWO_SCALE_ROWS ? __ldg(lr.s_hi + s / 2) : c_lo[u];
    }
    if constexpr (FP4) {  // the piece's columns 128 s + 32 t ..+ 32: groups 8 s + 2 t, + 1 (NVFP4), 4 s + t (MX)
      if constexpr (C == Codes::Nvfp4) {
        q_lo[u] = in && lr.lo_ok ? __ldg(reinterpret_cast<const unsigned short*>(lr.q_lo + 8 * s + 2 * t)) : 0u;
        q_hi[u] = in && lr.hi_ok ? __ldg(reinterpret_cast<const unsigned short*>(lr.q_hi + 8 * s + 2 * t)) : 0u;
      } else {
        q_lo[u] = in && lr.lo_ok ? __ldg(lr.q_lo + 4 * s + t) : 0u;
        q_hi[u] = in && lr.hi_ok ? __ldg(lr.q_hi + 4 * s + t) : 0u;
      }
    }
    if constexpr (MX8) {  // the piece's columns 64 s + 16 t ..+ 16: group 2 s + t / 2
      q_lo[u] = in && lr.lo_ok ? __ldg(lr.q_lo + 2 * s + t / 2) : 0u;
      q_hi[u] = in && lr.hi_ok ? __ldg(lr.q_hi + 2 * s + t / 2) : 0u;
    }
  };
  // Stage p (slabs s_begin + 2p, + 1) into ring buffer `buffer`: its copies and its slabs' scales.
  auto issue = [&](int buffer, int p) {
    const int64_t at = int64_t(s_begin + 2 * p) * SLAB + copy_chunk * 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool in = copy_ok[i] && at < row_bytes;
      ptx::cp_async16_l2(ring_chunk(buffer, 4 * i + lane / 8, copy_chunk), copy_row[i] + (in ? at : 0), in);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = s_begin + 2 * p + h;
      if (s < s_end) load_scales(2 * buffer + h, s);
    }
  };
  // Without rings: slab s's pieces of rows lo and hi straight from global memory (half lines: 8 rows x 64
  // bytes an instruction), into slot u.
  auto load_direct = [&](int u, int s) {
    const int64_t off = int64_t(s) * SLAB + t * 16;
    const bool in = off < row_bytes;  // the lane's 16 bytes are all in or all out of the row
    r_lo[u] = in && lr.lo_ok ? ldg_stream(lr.lo + off) : make_uint4(0, 0, 0, 0);
    r_hi[u] = in && lr.hi_ok ? ldg_stream(lr.hi + off) : make_uint4(0, 0, 0, 0);
    load_scales(u, s);
  };

  const int R = job.rows, pitch = job.pitch;
  for (int first = slice.begin; first < slice.end; first += R) {  // one pass per `R` rows of the slice
    const int rows = min(R, slice.end - first);
    const int nstages = (s_end - s_begin + 1) / 2;
    if (lr.active) {  // the first loads go out before the activations are staged
      if constexpr (RINGS) {
#pragma unroll
        for (int b = 0; b < STAGES - 1; ++b) {
          if (b < nstages) issue(b, b);
          ptx::cp_async_commit();
        }
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (s_begin + u < s_end) load_direct(u, s_begin + u);
      }
    }
    // Stage the pass's activation rows (the K range's columns), warp w rows w, w + warps, ... (the rows'
    // indices are read in parallel); K % 8 == 0 and the range starts at a multiple of 32 columns: whole
    // 16-byte pieces of 16-byte aligned rows.
    for (int r = warp; r < rows; r += int(blockDim.x / 32)) {
      const bf16* src = job.act_row(slice, first + r) + col_begin;
      for (int64_t c = lane; c < (col_end - col_begin) / 8; c += 32) {
        if constexpr (FP4) {  // in fp4_pair_order, chunk c at c ^ 2 when its bit 3 is set (pitch_bytes)
          const uint4 v = fp4_pair_order(*reinterpret_cast<const uint4*>(src + c * 8));
          *reinterpret_cast<uint4*>(act_smem + r * pitch + (c ^ (((c >> 3) & 1) << 1)) * 16) = v;
        } else {
          ptx::cp_async16(act_smem + r * pitch + c * 16, src + c * 8, true);
        }
      }
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();

    if (lr.active) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // FP8: the current 128-column block's raw sums
      // GROUPED: the odd mmas' sums (two chains of 4 dependent mmas a slab instead of one of 8: the chain, ~30
      // clocks an mma, would otherwise outlast the slab's loads), added to acc after the K loop.
      float odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint8_t* a_row = act_smem + g * pitch;
      const bool has_row = g < rows;  // row g of the pass exists (B column g)
      // Slab s's products, its weight pieces in hand and its scales in slot u.
      auto product = [&](int u, int s, const uint4& r_lo_u, const uint4& r_hi_u) {
          const int64_t off = int64_t(s) * SLAB + t * 16;  // the lane's byte offset in its weight rows
          constexpr int J = CPB / 4;                       // mmas per slab: 4 columns of the lane's piece each
          // B: the lane's columns of row g, as bf16 pairs (zero past the pass's rows or past K, so that
          // garbage never meets the zero weights there).
          uint32_t b[2 * J];
          if (has_row && off < row_bytes) {
            const uint8_t* src = a_row + (off - byte_begin) * CPB / 8;  // 2 bytes per column
#pragma unroll
            for (int v = 0; v < J / 2; ++v) {  // FP4: chunk v staged at v ^ (t & 2) (pitch_bytes)
              const uint4 x = *reinterpret_cast<const uint4*>(src + 16 * (FP4 ? v ^ (t & 2) : v));
              b[4 * v] = x.x, b[4 * v + 1] = x.y, b[4 * v + 2] = x.z, b[4 * v + 3] = x.w;
            }
          } else {
#pragma unroll
            for (int i = 0; i < 2 * J; ++i) b[i] = 0;
          }
          // A: the weight pieces of rows lo and hi as bf16 pairs (pair i = the piece's columns 2i, 2i + 1;
          // FP4: word i / 4's columns i % 4 and i % 4 + 4, the order its activations were staged in).
          uint32_t a_lo[2 * J], a_hi[2 * J];
          const uint32_t w_lo4[4] = {r_lo_u.x, r_lo_u.y, r_lo_u.z, r_lo_u.w};
          const uint32_t w_hi4[4] = {r_hi_u.x, r_hi_u.y, r_hi_u.z, r_hi_u.w};
          if constexpr (FP4) {
            uint32_t sc_lo[2], sc_hi[2];  // the two 16-column halves' scales as bf16 pairs
            fp4_scale_pairs<C>(q_lo[u], sc_lo);
            fp4_scale_pairs<C>(q_hi[u], sc_hi);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              fp4_to_bf16x2(w_lo4[i], sc_lo[i / 2], &a_lo[4 * i]);
              fp4_to_bf16x2(w_hi4[i], sc_hi[i / 2], &a_hi[4 * i]);
            }
          }
          if constexpr (MX8) {  // e4m3 pairs to bf16, each times the group scale (exact)
            const uint32_t sc_lo = e8m0_bf16x2(q_lo[u]), sc_hi = e8m0_bf16x2(q_hi[u]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              a_lo[2 * i] = bf16x2_mul(e4m3x2_to_bf16x2(w_lo4[i]), sc_lo);
              a_lo[2 * i + 1] = bf16x2_mul(e4m3x2_to_bf16x2(w_lo4[i] >> 16), sc_lo);
              a_hi[2 * i] = bf16x2_mul(e4m3x2_to_bf16x2(w_hi4[i]), sc_hi);
              a_hi[2 * i + 1] = bf16x2_mul(e4m3x2_to_bf16x2(w_hi4[i] >> 16), sc_hi);
            }
          }
#pragma unroll
          for (int i = 0; i < 4 && !GROUPED; ++i) {
            if constexpr (FP8) {
              a_lo[2 * i] = e4m3x2_to_bf16x2(w_lo4[i]);
              a_lo[2 * i + 1] = e4m3x2_to_bf16x2(w_lo4[i] >> 16);
              a_hi[2 * i] = e4m3x2_to_bf16x2(w_hi4[i]);
              a_hi[2 * i + 1] = e4m3x2_to_bf16x2(w_hi4[i] >> 16);
            } else {
              a_lo[i] = w_lo4[i];
              a_hi[i] = w_hi4[i];
            }
          }
          // mma j: A regs {row g, k 2t..2t+1}, {row g+8, same k}, {row g, k 2t+8..2t+9}, {row g+8, same k}
          // = pairs 2j (columns 4j, 4j+1) and 2j + 1 (columns 4j+2, 4j+3); B regs: the same pairs of row g.
#pragma unroll
          for (int j = 0; j < J; ++j) {
            const uint32_t a[4] = {a_lo[2 * j], a_hi[2 * j], a_lo[2 * j + 1], a_hi[2 * j + 1]};
            ptx::mma_bf16(FP8 ? part : GROUPED && (j & 1) ? odd : acc, a, b[2 * j], b[2 * j + 1]);
          }
          if constexpr (FP8) {
            if ((s & 1) || s == s_end - 1) {  // the block's last slab: scale its partial into acc
              acc[0] = __fmaf_rn(c_lo[u], part[0], acc[0]);
              acc[1] = __fmaf_rn(c_lo[u], part[1], acc[1]);
              acc[2] = __fmaf_rn(c_hi[u], part[2], acc[2]);
              acc[3] = __fmaf_rn(c_hi[u], part[3], acc[3]);
#pragma unroll
              for (int i = 0; i < 4; ++i) part[i] = 0.0f;
            }
          }
      };
      if constexpr (RINGS) {
#pragma unroll 1
        for (int p0 = 0; p0 < nstages; p0 += STAGES) {
#pragma unroll
          for (int buf = 0; buf < STAGES; ++buf) {  // stage p in ring buffer buf
            const int p = p0 + buf;
            if (p >= nstages) break;
            __syncwarp();  // every lane is done with the buffer the next issue refills (stage p - 1's)
            if (p + STAGES - 1 < nstages) issue((buf + STAGES - 1) % STAGES, p + STAGES - 1);
            ptx::cp_async_commit();
            ptx::cp_async_wait<STAGES - 1>();  // this lane's copies of stage p have landed
            __syncwarp();                      // and every other lane's
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int s = s_begin + 2 * p + h;
              if (s >= s_end) break;
              product(2 * buf + h, s, *reinterpret_cast<const uint4*>(ring_chunk(buf, g, 4 * h + t)),
                      *reinterpret_cast<const uint4*>(ring_chunk(buf, g + 8, 4 * h + t)));
            }
          }
        }
      } else {
#pragma unroll 1
        for (int s0 = s_begin; s0 < s_end; s0 += U) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int s = s0 + u;
            if (s >= s_end) break;
            product(u, s, r_lo[u], r_hi[u]);
            if (s + U < s_end) load_direct(u, s + U);
          }
        }
      }
      if constexpr (GROUPED) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += odd[i];
      }
      // acc: {row lo, pass row 2t}, {row lo, pass row 2t+1}, {row hi, pass row 2t}, {row hi, pass row 2t+1}.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int n = 2 * t + q;
        if (n < rows) job.store(slice, int64_t(first + n), group, g, acc[q], acc[2 + q]);
      }
    }
    __syncthreads();  // the next pass restages the activation rows
  }
}

// Launches kernel<Job, C> with `plan`'s CTA size and shared memory (the kernel's attributes set on first
// use: up to MAX_SMEM of dynamic shared memory, and all of the SM's 228 KB as shared memory, none as L1:
// the weights bypass it).
template <class Job, Codes C, bool RINGS>
void launch_with(const Job& job, dim3 grid, const Plan& plan, cudaStream_t stream) {
  static const bool configured = [] {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel<Job, C, RINGS>, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_SMEM));
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel<Job, C, RINGS>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            int(cudaSharedmemCarveoutMaxShared)));
    return true;
  }();
  (void)configured;
  kernel<Job, C, RINGS><<<grid, plan.warps * 32, plan.smem, stream>>>(job);
  SPARROW_CUDA_CHECK_LAUNCH();
}
template <class Job, Codes C>
void launch(const Job& job, dim3 grid, const Plan& plan, cudaStream_t stream) {
  SPARROW_CHECK(plan.smem <= size_t(MAX_SMEM), "skinny product: ", plan.smem, " bytes of shared memory a CTA");
  if (plan.rings) launch_with<Job, C, true>(job, grid, plan, stream);
  else launch_with<Job, C, false>(job, grid, plan, stream);
}

}  // namespace sparrow::cuda::skinny
