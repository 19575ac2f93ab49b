// Skinny products in the tiled kernels' order, for the batch-invariant mode (core/batch_invariance.h): the
// MoE decode path of moe/moe.cu in that mode. The same Job interface, grid and staged activation rows as
// skinny::kernel (skinny.cuh), but each output is the sum the tiled kernels (moe.cu's WMMA tiles and wgmma
// kernel) compute for its row, bit for bit, so that a token's experts give the same bits whether its step
// takes the decode path or a tiled one, and the invariant mode keeps the decode path's bandwidth:
//   - one fp32 chain per output over K in ascending 16-column chunks, one mma.sync m16n8k16 each, in the
//     PTX ISA's fragment layout ("Matrix Fragments for mma.m16n8k16"): lane (g, t) holds columns c + 2t,
//     c + 2t + 1 and c + 2t + 8, c + 2t + 9 of chunk c, for the weights (A: rows g, g + 8) and the
//     activations (B: pass row g) alike. The tiled kernels' chains are the same chunks in the same order
//     (wmma m16n16k16 is two such mmas; wgmma m64nNk16 takes a chunk an instruction), one accumulator each;
//     skinny::kernel instead gives each mma the columns of the lanes' own 16-byte pieces (other sums).
//   - FP8: the weights as the tiled kernels dequantise them, bf16(e4m3 * block scale) (moe.cu dequant2),
//     rather than the block scale on each 128-column partial.
// The price: a lane reads its weights 4 (bf16) or 2 (e4m3) bytes at a time instead of 16, straight into
// registers (no rings), and FP8 spends a product and a rounding on every weight. Bf16 and FP8 weights only;
// the group-scaled formats take the tiled kernels for every step in this mode (moe.cu).
#pragma once
#include "kernels/cuda/gemm/skinny.cuh"

namespace sparrow::cuda::skinny {

// bf16(e4m3 * scale) for the two codes in the low 16 bits of `two` (lower byte first): e4m3 -> f16 exact
// (cvt.rn.f16x2.e4m3x2), f16 -> f32 exact, one fp32 product, nearest-even to bf16 -- the tiled kernels'
// dequantised weights (moe.cu) and dequantize_fp8_blocks'.
__device__ __forceinline__ uint32_t e4m3x2_scaled_bf16x2(uint32_t two, float scale) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(hr));
  const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
  uint32_t bits;
  memcpy(&bits, &b, sizeof(bits));
  return bits;
}

constexpr int ORDERED_AHEAD = 2;  // slabs whose weights a lane loads before it multiplies

// The staged rows' pitch: 16 bytes past a multiple of 128, so that the 4-byte activation reads of a warp
// (rows g at columns c + 2t) hit 32 different banks.
inline int ordered_pitch(int64_t cols) { return int((2 * cols + 127) / 128 * 128 + 16); }

// Rows per pass, CTA size and shared memory for ordered_kernel: as make_plan without the rings.
inline Plan make_ordered_plan(int64_t max_rows, int64_t cols) {
  Plan d{};
  d.pitch = ordered_pitch(cols);
  d.rows = int(std::min<int64_t>({MAX_ROWS, max_rows, SMEM_CAP / d.pitch}));
  d.rings = false;
  d.smem = ring_offset(d.rows, d.pitch);
  d.warps = (228 * 1024) / (d.smem + 1024) >= 4 ? 4 : 8;
  return d;
}

template <class Job, Codes C>
__global__ void __launch_bounds__(MAX_THREADS) ordered_kernel(const Job job) {
  static_assert(C == Codes::Bf16 || C == Codes::Fp8, "the ordered products take bf16 or e4m3 weights");
  constexpr bool FP8 = C == Codes::Fp8;
  constexpr int ES = FP8 ? 1 : 2;              // weight bytes per column
  constexpr int SLAB_COLS = SLAB / ES;         // 64 e4m3 or 32 bf16 columns
  constexpr int J = SLAB_COLS / 16;            // mmas per slab
  extern __shared__ __align__(128) uint8_t act_smem[];  // [rows][pitch] bf16 activation rows
  Slice slice;
  if (!job.slice(slice)) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int64_t group = int64_t(blockIdx.y) * (blockDim.x / 32) + warp;
  const int64_t K = job.K;
  const int nslabs = int((K + SLAB_COLS - 1) / SLAB_COLS);
  const LaneRows lr = job.lane_rows(slice, group, g);

  // Piece p of slab s: columns 16 (p / 2) + 2t + 8 (p % 2) and the next (a bf16 pair, or two e4m3 codes in
  // the low 16 bits); zero past K or past the matrix's rows.
  uint32_t w_lo[ORDERED_AHEAD][2 * J], w_hi[ORDERED_AHEAD][2 * J];
  float c_lo[ORDERED_AHEAD], c_hi[ORDERED_AHEAD];  // FP8: the slab's block scales
  auto load = [&](int u, int s) {
#pragma unroll
    for (int p = 0; p < 2 * J; ++p) {
      const int64_t col = int64_t(s) * SLAB_COLS + 16 * (p / 2) + 2 * t + 8 * (p % 2);
      const bool in = col < K;  // K is even: the pair is whole
      if constexpr (FP8) {
        w_lo[u][p] = in && lr.lo_ok ? __ldg(reinterpret_cast<const unsigned short*>(lr.lo + col)) : 0u;
        w_hi[u][p] = in && lr.hi_ok ? __ldg(reinterpret_cast<const unsigned short*>(lr.hi + col)) : 0u;
      } else {
        w_lo[u][p] = in && lr.lo_ok ? __ldg(reinterpret_cast<const unsigned int*>(lr.lo + 2 * col)) : 0u;
        w_hi[u][p] = in && lr.hi_ok ? __ldg(reinterpret_cast<const unsigned int*>(lr.hi + 2 * col)) : 0u;
      }
    }
    if constexpr (FP8) {
      c_lo[u] = __ldg(lr.s_lo + s / 2);  // slab s (64 columns) lies in 128-column block s / 2
      c_hi[u] = Job::TWO_SCALE_ROWS ? __ldg(lr.s_hi + s / 2) : c_lo[u];
    }
  };

  const int R = job.rows, pitch = job.pitch;
  for (int first = slice.begin; first < slice.end; first += R) {  // one pass per `R` rows of the slice
    const int rows = min(R, slice.end - first);
    // Stage the pass's activation rows, warp w rows w, w + warps, ... (whole 16-byte pieces: K % 8 == 0).
    for (int r = warp; r < rows; r += int(blockDim.x / 32)) {
      const bf16* src = job.act_row(slice, first + r);
      for (int64_t c = lane; c < K / 8; c += 32) ptx::cp_async16(act_smem + r * pitch + c * 16, src + c * 8, true);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();

    if (lr.active) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint8_t* a_row = act_smem + g * pitch;
      const bool has_row = g < rows;  // row g of the pass exists (B column g)
#pragma unroll 1
      for (int s0 = 0; s0 < nslabs; s0 += ORDERED_AHEAD) {
#pragma unroll
        for (int u = 0; u < ORDERED_AHEAD; ++u)
          if (s0 + u < nslabs) load(u, s0 + u);
#pragma unroll
        for (int u = 0; u < ORDERED_AHEAD; ++u) {
          const int s = s0 + u;
          if (s >= nslabs) break;
#pragma unroll
          for (int j = 0; j < J; ++j) {
            const int64_t col = int64_t(s) * SLAB_COLS + 16 * j + 2 * t;
            const uint32_t b0 = has_row && col < K ? *reinterpret_cast<const uint32_t*>(a_row + 2 * col) : 0u;
            const uint32_t b1 = has_row && col + 8 < K ? *reinterpret_cast<const uint32_t*>(a_row + 2 * (col + 8)) : 0u;
            uint32_t a[4] = {w_lo[u][2 * j], w_hi[u][2 * j], w_lo[u][2 * j + 1], w_hi[u][2 * j + 1]};
            if constexpr (FP8) {
              a[0] = e4m3x2_scaled_bf16x2(a[0], c_lo[u]);
              a[1] = e4m3x2_scaled_bf16x2(a[1], c_hi[u]);
              a[2] = e4m3x2_scaled_bf16x2(a[2], c_lo[u]);
              a[3] = e4m3x2_scaled_bf16x2(a[3], c_hi[u]);
            }
            ptx::mma_bf16(acc, a, b0, b1);
          }
        }
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

// Launches ordered_kernel<Job, C> with `plan` (make_ordered_plan).
template <class Job, Codes C>
void launch_ordered(const Job& job, dim3 grid, const Plan& plan, cudaStream_t stream) {
  SPARROW_CHECK(plan.smem <= size_t(MAX_SMEM), "ordered skinny product: ", plan.smem, " bytes of shared memory a CTA");
  static const bool configured = [] {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(ordered_kernel<Job, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_SMEM));
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(ordered_kernel<Job, C>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            int(cudaSharedmemCarveoutMaxShared)));
    return true;
  }();
  (void)configured;
  ordered_kernel<Job, C><<<grid, plan.warps * 32, plan.smem, stream>>>(job);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda::skinny
