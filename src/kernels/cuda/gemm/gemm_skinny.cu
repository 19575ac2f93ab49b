// Decode-sized dense products on skinny::kernel (gemm_skinny.h says what they compute).
//
// Grid. A warp streams one group of 16 weight rows, and an SM needs ~30 KB of loads in flight for its
// share of 4.3 TB/s (~1 us loaded latency x 32.6 GB/s); a warp has U = 4 slabs x 2 rows x 512 B = 4 KB in
// flight, so the chip needs ~8+ streaming warps per SM, ~1000-2000 in all (registers allow 16 FP8 / ~24
// bf16 warps per SM). Large matrices have that many groups (q_b 24576 rows: 1536; the lm_heads 8080-12504),
// small ones do not (kv_a 576 rows: 36 groups = 36 warps, ~150 KB in flight on the whole chip: ~5% of HBM
// at best). So K is split over blockIdx.z into `splits` ranges of chunk_slabs 64-byte slabs, enough that
// groups x splits ~ 16 warps per SM (splits = SMs x 16 / groups, at most one range per 4 slabs -- one
// ring fill -- and a range an even number of slabs, so that an FP8 128-column scale block lies in one
// range). Each range's fp32 partial sums go to the workspace, [splits][m][n], and reduce_kernel adds them
// in split order (fixed: the result is the same on every run) and rounds once to y's type. With one range
// the kernel stores y itself. The partials cost splits x m x n x 8 bytes of traffic (written and read
// back, mostly in L2): with ranges of at least 4 slabs (splits <= k x bytes per weight / 256) that is at
// most m / 32 of the weights' bytes (25% at m = 8, 3% at m = 1), and a second launch (~2 us outside
// graphs). Examples on 132 SMs (2112 warps wanted): kv_a 576x7168 e4m3: 36 groups, 28 ranges of 4 slabs
// (1008 warps, bounded by the 4-slab minimum); q_a 1536x7168: 96 groups, 22 ranges of 6 slabs (19 ranges);
// o_proj 7168x16384: 448 groups, 4 ranges; q_b 24576x1536 and the lm_heads: one range.
//
// Shared memory: a CTA stages only its K range of the m rows (skinny::make_plan: 4 warps per CTA while 4
// CTAs fit an SM, else 8); a range is shortened until m rows of it fit skinny::SMEM_CAP.
#include "kernels/cuda/gemm/gemm_skinny.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/gemm/skinny.cuh"
#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::cuda {

namespace {

using skinny::bf16;
using skinny::LaneRows;
using skinny::Slice;

// skinny::kernel's Job for y[m, N] = x[m, K] · W[N, K]ᵀ (the MoE down product's row mapping, one slice).
template <skinny::Codes C>
struct DenseJob {
  static constexpr bool SPLIT_K = true;
  static constexpr bool TWO_SCALE_ROWS = false;  // rows 16 group + g and + 8 share a 128-row scale block
  int64_t K;
  int rows, pitch, chunk_slabs;
  const bf16* x;
  int64_t ldx;
  int m;
  const uint8_t* w;
  const void* w_scales;    // FP8: fp32 [ceil(N/128), ceil(K/128)]; group-scaled: bytes [N, K / group]
  const float* w_global;   // NVFP4: the matrix's global scale (one fp32 on the device)
  int64_t N;
  void* y;
  int64_t ldy;
  bool y_f32;
  float* partial;  // splits > 1: [splits][m][N] fp32, else null (the store writes y)

  __device__ bool slice(Slice& s) const {
    s = Slice{0, 0, m};
    return true;
  }
  __device__ LaneRows lane_rows(const Slice&, int64_t group, int g) const {
    return skinny::matrix_lane_rows<C>(w, w_scales, N, K, group, g);
  }
  __device__ const bf16* act_row(const Slice&, int64_t row) const { return x + row * ldx; }
  __device__ void put(int64_t row, int64_t col, float v) const {
    if (partial != nullptr) partial[(int64_t(blockIdx.z) * m + row) * N + col] = v;
    else if (y_f32) static_cast<float*>(y)[row * ldy + col] = v;
    else static_cast<bf16*>(y)[row * ldy + col] = __float2bfloat16_rn(v);
  }
  __device__ void store(const Slice&, int64_t row, int64_t group, int g, float lo, float hi) const {
    if constexpr (skinny::is_fp4(C)) {  // the 2^-16 of the register dequantisation, NVFP4's global scale
      lo *= skinny::FP4_UNSCALE, hi *= skinny::FP4_UNSCALE;
      if constexpr (C == skinny::Codes::Nvfp4) {
        const float global = __ldg(w_global);
        lo = __fmul_rn(lo, global), hi = __fmul_rn(hi, global);
      }
    }
    const int64_t lo_col = 16 * group + g, hi_col = lo_col + 8;
    if (lo_col < N) put(row, lo_col, lo);
    if (hi_col < N) put(row, hi_col, hi);
  }
};

// y[i][j] = Σ_s partial[s][i][j], s = 0, 1, ... in order (fp32), rounded once to y's type.
__global__ void reduce_kernel(const float* partial, int splits, int m, int64_t n, void* y, int64_t ldy, bool y_f32) {
  const int64_t total = int64_t(m) * n;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    float v = partial[e];
    for (int s = 1; s < splits; ++s) v = __fadd_rn(v, partial[int64_t(s) * total + e]);
    const int64_t i = e / n, j = e % n;
    if (y_f32) static_cast<float*>(y)[i * ldy + j] = v;
    else static_cast<bf16*>(y)[i * ldy + j] = __float2bfloat16_rn(v);
  }
}


constexpr int kWarpsPerSmTarget = 16;  // FP8's register-limited residency; ~64 KB of loads in flight per SM

struct DensePlan {
  skinny::Plan cta;
  int chunk_slabs, splits;
  int64_t groups;
};

DensePlan dense_plan(int64_t m, int64_t n, int64_t k, skinny::Codes codes) {
  const int64_t cols_per_slab = skinny::SLAB * skinny::piece_cols(codes) / 16;
  const int64_t nslabs = (skinny::row_bytes_of(codes, k) + skinny::SLAB - 1) / skinny::SLAB;
  DensePlan p{};
  p.groups = (n + 15) / 16;
  const int64_t rows = std::clamp<int64_t>(m, 1, skinny::MAX_ROWS);
  // The longest range whose m rows fit the shared-memory cap (pitch <= 2 cols + 143 in every layout),
  // in whole pairs of slabs.
  const int64_t max_cols = (skinny::SMEM_CAP / rows - 143) / 2;
  const int64_t max_chunk = std::max<int64_t>(2, max_cols / cols_per_slab / 2 * 2);
  const int64_t want = std::max<int64_t>(1, int64_t(sm_count()) * kWarpsPerSmTarget / p.groups);
  const int64_t splits = std::clamp<int64_t>(want, 1, std::max<int64_t>(1, nslabs / skinny::U));
  int64_t chunk = (nslabs + splits - 1) / splits;
  chunk = std::min(max_chunk, (chunk + 1) / 2 * 2);
  p.chunk_slabs = int(chunk);
  p.splits = int((nslabs + chunk - 1) / chunk);
  p.cta = skinny::make_plan(rows, chunk * cols_per_slab, codes);
  return p;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <skinny::Codes C>
void run(int64_t m, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w, const void* w_scales,
         const float* w_global, void* y, ElemType y_type, int64_t ldy, void* workspace, size_t workspace_bytes,
         cudaStream_t stream) {
  const DensePlan plan = dense_plan(m, n, k, C);
  float* partial = plan.splits > 1 ? static_cast<float*>(workspace) : nullptr;
  const DenseJob<C> job{k,
                        plan.cta.rows,
                        plan.cta.pitch,
                        plan.chunk_slabs,
                        static_cast<const bf16*>(x),
                        ldx,
                        int(m),
                        static_cast<const uint8_t*>(w),
                        w_scales,
                        w_global,
                        n,
                        y,
                        ldy,
                        y_type == ElemType::F32,
                        partial};
  const dim3 grid(1, unsigned((plan.groups + plan.cta.warps - 1) / plan.cta.warps), unsigned(plan.splits));
  SPARROW_CHECK(grid.y <= 65535 && grid.z <= 65535, "gemm_skinny: n=", n, " k=", k, " too large for the grid");
  skinny::launch<DenseJob<C>, C>(job, grid, plan.cta, stream);
  if (partial != nullptr) {
    const int blocks = int(std::min<int64_t>((m * n + 255) / 256, 4 * int64_t(sm_count())));
    reduce_kernel<<<blocks, 256, 0, stream>>>(partial, plan.splits, int(m), n, y, ldy, y_type == ElemType::F32);
    SPARROW_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

const char* gemm_skinny_unsupported(int64_t m, int64_t n, int64_t k, WeightCodes codes, const void* x, int64_t ldx,
                                    const void* w, const void* w_scales, const float* w_global, const void* y,
                                    ElemType y_type, int64_t ldy) {
  const int64_t k_multiple = codes == WeightCodes::Bf16 ? 8 : codes == WeightCodes::Fp8 ? 16 : 32;
  if (m < 0 || m > kSkinnyMaxRows) return "m must be in [0, 8]";
  if (n < 1 || k < 1) return "n and k must be positive";
  if (k % k_multiple != 0)
    return k_multiple == 8 ? "k must be a multiple of 8" : k_multiple == 16 ? "k must be a multiple of 16"
                                                                            : "k must be a multiple of 32";
  if (x == nullptr || w == nullptr || y == nullptr) return "null operand";
  if (codes != WeightCodes::Bf16 && w_scales == nullptr) return "null weight scales";
  if (codes == WeightCodes::Nvfp4 && w_global == nullptr) return "null global scale (NVFP4's weight_scale_2)";
  if (!aligned(x, 16) || !aligned(w, 16)) return "x and w must be 16-byte aligned";
  if (ldx < k || ldx % 8 != 0) return "x row stride must be >= k and a multiple of 8 (16-byte aligned rows)";
  if (codes == WeightCodes::Fp8 && !aligned(w_scales, 4)) return "weight scales must be 4-byte aligned";
  if (codes == WeightCodes::Nvfp4 && !aligned(w_global, 4)) return "the global scale must be 4-byte aligned";
  if (ldy < n) return "y row stride must be >= n";
  if (!aligned(y, y_type == ElemType::F32 ? 4 : 2)) return "y must be aligned to its element size";
  // Grid limits (blockIdx.y: groups of 4-8 warps of 16 rows; blockIdx.z: K ranges of >= 2 slabs).
  if ((n + 15) / 16 > 65535 * 4 || (skinny::row_bytes_of(codes, k) + 127) / 128 > 65535) return "n or k too large";
  return nullptr;
}

size_t gemm_skinny_workspace_bytes(int64_t m, int64_t n, int64_t k, WeightCodes codes) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const DensePlan plan = dense_plan(m, n, k, codes);
  return plan.splits > 1 ? size_t(plan.splits) * size_t(m) * size_t(n) * sizeof(float) : 0;
}

void gemm_skinny(int64_t m, int64_t n, int64_t k, WeightCodes codes, const void* x_bf16, int64_t ldx, const void* w,
                 const void* w_scales, const float* w_global, void* y, ElemType y_type, int64_t ldy, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream) {
  if (const char* why = gemm_skinny_unsupported(m, n, k, codes, x_bf16, ldx, w, w_scales, w_global, y, y_type, ldy))
    fail("gemm_skinny: ", why, " (m=", m, " n=", n, " k=", k, " ldx=", ldx, " ldy=", ldy, ")");
  if (m == 0) return;
  const size_t need = gemm_skinny_workspace_bytes(m, n, k, codes);
  SPARROW_CHECK(need == 0 || (workspace != nullptr && workspace_bytes >= need && aligned(workspace, 16)),
                "gemm_skinny: needs a 16-byte aligned workspace of ", need, " bytes, got ", workspace_bytes);
  if (stream == nullptr) stream = cuda::stream();
  using skinny::Codes;
  const auto launch = [&]<Codes C>() {
    run<C>(m, n, k, x_bf16, ldx, w, w_scales, w_global, y, y_type, ldy, workspace, workspace_bytes, stream);
  };
  switch (codes) {
    case Codes::Bf16: return launch.operator()<Codes::Bf16>();
    case Codes::Fp8: return launch.operator()<Codes::Fp8>();
    case Codes::Nvfp4: return launch.operator()<Codes::Nvfp4>();
    case Codes::Mxfp4: return launch.operator()<Codes::Mxfp4>();
    case Codes::Mxfp8: return launch.operator()<Codes::Mxfp8>();
  }
  fail("gemm_skinny: unknown weight codes");
}

}  // namespace sparrow::cuda
