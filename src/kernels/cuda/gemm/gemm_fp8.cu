// FP8 E4M3 block-scaled products through cuBLASLt (see gemm_fp8.h for the layouts and requirements).
//
// Row-major <-> column-major mapping as in gemm.cu: y[m,n] = x · Wᵀ is, read column-major,
// yᵀ[n,m] = W · xᵀ, so cuBLASLt gets A = w (row-major [n, k] = column-major [k, n], transa = T),
// B = the quantised x (row-major [m4, k] = column-major [k, m4], transb = N), C = D = y (column-major
// [n, m4]) and (M, N, K) = (n, m4, k). That is the "TN" form cuBLASLt requires for FP8 on Hopper
// ("A must be transposed and B non-transposed"), so no operand is copied.
// Scale modes: A = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F (the checkpoint's weight_scale_inv),
// B = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (DeepSeek's per-token, per-128-channel activation scales);
// cuBLAS lists (VEC128, BLK128x128), (BLK128x128, VEC128) and (VEC128, VEC128) as the supported pairs.
#include "kernels/cuda/gemm/gemm_fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/gemm/cublaslt.cuh"
#include "core/batch_invariance.h"
#include "core/device/cuda_check.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::cuda {

namespace {

constexpr int64_t kBlock = 128;       // DeepSeek's block: 128 channels (activations), 128x128 (weights)
constexpr float kE4m3Max = 448.0f;    // largest finite E4M3 value

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
const char* type_name(ElemType t) { return t == ElemType::F32 ? "fp32" : "bf16"; }
int64_t elem_size(ElemType t) { return t == ElemType::F32 ? 4 : 2; }

// ---- kernels ----------------------------------------------------------------------------------------

// One warp per (row, 128-column group); lane l holds columns 128g + 4l .. 4l+3, so a warp reads 256
// contiguous bytes of x and writes 128 of q. Rows in [m, m_pad) are padding for cuBLASLt's "N multiple
// of 4": zero codes and a zero scale. kVec: x is 8-byte and q 4-byte addressable per lane (x aligned,
// ldx, k multiples of 4), so each lane does one 8-byte load and one 4-byte store.
constexpr int kQuantWarps = 8;

template <bool kVec>
__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_rows_kernel(int64_t m, int64_t m_pad, int64_t k, int64_t groups, const __nv_bfloat16* __restrict__ x,
                         int64_t ldx, uint8_t* __restrict__ q, float* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  if (item >= m_pad * groups) return;  // whole warps leave together: the shuffles below stay full-warp
  const int64_t row = item / groups, g = item % groups;
  const int64_t c0 = g * kBlock + 4 * lane;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (row < m) {
    const __nv_bfloat16* xr = x + row * ldx;
    if (kVec && c0 + 3 < k) {
      const uint2 raw = *reinterpret_cast<const uint2*>(xr + c0);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else {
      for (int j = 0; j < 4; ++j)
        if (c0 + j < k) v[j] = __bfloat162float(xr[c0 + j]);
    }
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  // act_quant: s = amax / 448, y = x / s. Both divisions correctly rounded (__fdiv_rn) whatever the
  // compiler flags, so the CPU reference (float division) reproduces every code bit for bit.
  const float scale = __fdiv_rn(amax, kE4m3Max);
  uint8_t code[4];
  for (int j = 0; j < 4; ++j)
    code[j] = amax == 0.0f ? uint8_t(0)
                           : uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(v[j], scale), __NV_SATFINITE, __NV_E4M3));
  uint8_t* qr = q + row * k;
  if (kVec && c0 + 3 < k) {
    *reinterpret_cast<uint32_t*>(qr + c0) =
        uint32_t(code[0]) | uint32_t(code[1]) << 8 | uint32_t(code[2]) << 16 | uint32_t(code[3]) << 24;
  } else {
    for (int j = 0; j < 4; ++j)
      if (c0 + j < k) qr[c0 + j] = code[j];
  }
  if (lane == 0) scales[g * m_pad + row] = scale;  // VEC128 for B: the row (cuBLASLt's N) is contiguous
}

__device__ __forceinline__ float e4m3_to_float(uint8_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));  // exact: e4m3 ⊂ fp16
}

// kVec: 8 consecutive elements per thread (cols % 8 == 0, w 8-byte and out 16-byte aligned); 8 divides
// 128, so the 8 share one scale.
template <bool kVec>
__global__ void dequantize_blocks_kernel(int64_t rows, int64_t cols, int64_t col_blocks, const uint8_t* __restrict__ w,
                                         const float* __restrict__ s, __nv_bfloat16* __restrict__ out) {
  constexpr int kPer = kVec ? 8 : 1;
  const int64_t total = rows * cols / kPer;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = t * kPer, row = e / cols, col = e % cols;
    const float sc = s[(row / kBlock) * col_blocks + col / kBlock];
    if constexpr (kVec) {
      const uint2 raw = *reinterpret_cast<const uint2*>(w + e);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
      __align__(16) __nv_bfloat16 o[8];
      for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16_rn(__fmul_rn(e4m3_to_float(b[j]), sc));
      *reinterpret_cast<uint4*>(out + e) = *reinterpret_cast<const uint4*>(o);
    } else {
      out[e] = __float2bfloat16_rn(__fmul_rn(e4m3_to_float(w[e]), sc));
    }
  }
}

// Quantises m rows into q [m_pad, k] (row stride k) and scales [groups, m_pad]; rows m..m_pad-1 zero.
void launch_quantize(int64_t m, int64_t m_pad, int64_t k, const void* x, int64_t ldx, uint8_t* q, float* scales,
                     cudaStream_t stream) {
  const int64_t groups = ceil_div(k, kBlock);
  const int64_t items = m_pad * groups;
  if (items == 0) return;
  const int64_t blocks = ceil_div(items, kQuantWarps);
  SPARROW_CHECK(blocks <= 0x7fffffff, "quantize_fp8_rows: ", m, " x ", k, " is too large for one launch");
  const bool vec = aligned(x, 8) && ldx % 4 == 0 && k % 4 == 0 && aligned(q, 4);
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  if (vec)
    quantize_rows_kernel<true><<<unsigned(blocks), kQuantWarps * 32, 0, stream>>>(m, m_pad, k, groups, xb, ldx, q, scales);
  else
    quantize_rows_kernel<false><<<unsigned(blocks), kQuantWarps * 32, 0, stream>>>(m, m_pad, k, groups, xb, ldx, q, scales);
  SPARROW_CUDA_CHECK_LAUNCH();
}

// ---- cuBLASLt plans ----------------------------------------------------------------------------------

// Everything that changes the plan (the heuristic is told each operand's pointer alignment, as in gemm.cu).
struct PlanKey {
  int64_t n, m_pad, k, ldc;
  int out_type;
  uint32_t align_a, align_c;
  bool invariant;  // batch-invariant mode: the algorithm comes from the product without m (gemm.cu)
  auto tie() const { return std::tie(n, m_pad, k, ldc, out_type, align_a, align_c, invariant); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
  PlanKey without_rows() const {
    PlanKey free = *this;
    free.m_pad = 0;
    // Alignments count up to 16 bytes only, as in gemm.cu: the output may be y itself or a workspace copy.
    free.align_a = std::min(align_a, 16u), free.align_c = std::min(align_c, 16u);
    return free;
  }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

struct Context {
  std::mutex mu;
  std::map<PlanKey, Plan> plans;
  std::map<PlanKey, cublasLtMatmulAlgo_t> invariant_algos;  // batch-invariant mode, by PlanKey::without_rows
  cudaEvent_t done = nullptr;                // orders the engine stream after work on other streams
};

Context& context() {
  static Context* ctx = [] {
    auto* c = new Context;  // never destroyed (plans outlive static destruction of callers)
    // The block-scale modes arrived in cuBLAS 12.9; an older library would reject the attributes with a
    // less helpful message.
    const size_t version = cublasLtGetVersion();
    SPARROW_CHECK(version >= 120900, "gemm_fp8_block_scaled: cuBLASLt ", version,
                  " lacks the FP8 block-scale modes (VEC128_32F / BLK128x128_32F need cuBLAS 12.9 or newer)");
    SPARROW_CUDA_CHECK(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
    return c;
  }();
  return *ctx;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  SPARROW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, uint64_t(rows), uint64_t(cols), ld));
  return layout;
}

void set_scale_pointers(const Plan& plan, const float* a_scales, const float* b_scales) {
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales,
                                                      sizeof(a_scales)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales,
                                                      sizeof(b_scales)));
}

// The heuristic wants the scale pointers set (a block scale mode without its pointer is refused), so
// the first call's pointers go in; every call sets its own before the matmul.
void destroy(Plan& plan) {
  cublasLtMatrixLayoutDestroy(plan.a);
  cublasLtMatrixLayoutDestroy(plan.b);
  cublasLtMatrixLayoutDestroy(plan.c);
  cublasLtMatmulDescDestroy(plan.op);
}

Plan make_plan(Context& ctx, const PlanKey& key, const float* a_scales, const float* b_scales) {
  Plan plan;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  SPARROW_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
  SPARROW_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
  set_scale_pointers(plan, a_scales, b_scales);
  // Column-major: A stored [k, n] (transposed to n x k), B stored [k, m_pad], C = D [n, m_pad].
  plan.a = make_layout(CUDA_R_8F_E4M3, key.k, key.n, key.k);
  plan.b = make_layout(CUDA_R_8F_E4M3, key.k, key.m_pad, key.k);
  plan.c = make_layout(key.out_type == int(ElemType::F32) ? CUDA_R_32F : CUDA_R_16BF, key.n, key.m_pad, key.ldc);

  // The alignments the heuristic is told: the call's own, or in batch-invariant mode the row-free key's.
  const PlanKey told = key.invariant ? key.without_rows() : key;
  cublasLtMatmulPreference_t pref = nullptr;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kCublasWorkspaceBytes;
  const uint32_t align_b = 256;  // the quantised activations live at the start of a pool block
  SPARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &told.align_a, sizeof(key.align_a)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &align_b, sizeof(align_b)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &told.align_c, sizeof(key.align_c)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &told.align_c, sizeof(key.align_c)));
  if (key.invariant) {
    auto it = ctx.invariant_algos.find(told);
    bool found = it != ctx.invariant_algos.end();
    if (!found) {
      // The product at kInvariantRows rows (cublaslt.cuh): one algorithm for every m.
      cublasLtMatrixLayout_t b = make_layout(CUDA_R_8F_E4M3, key.k, kInvariantRows, key.k);
      cublasLtMatrixLayout_t c = make_layout(key.out_type == int(ElemType::F32) ? CUDA_R_32F : CUDA_R_16BF, key.n,
                                             kInvariantRows, key.ldc);
      cublasLtMatmulAlgo_t chosen{};
      found = unsplit_algo(plan.op, plan.a, b, c, pref, &chosen);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(c);
      if (found) it = ctx.invariant_algos.emplace(told, chosen).first;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (found) plan.algo = it->second;
    if (!found || !algo_takes(plan.op, plan.a, plan.b, plan.c, plan.algo)) {
      destroy(plan);
      fail("batch-invariant mode: cuBLASLt has no ", found ? "algorithm chosen at " : "unsplit algorithm at ",
           kInvariantRows, " rows that also runs the FP8 block-scaled product n=", key.n, " m=", key.m_pad,
           " k=", key.k, " (ldc=", key.ldc, ")");
    }
    return plan;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), plan.op, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(plan);
    fail("cuBLASLt has no algorithm for an FP8 block-scaled product n=", key.n, " m=", key.m_pad, " k=", key.k,
         " (", type_name(ElemType(key.out_type)), " out, ldc=", key.ldc,
         "): ", cublasLtGetStatusString(status),
         " (the VEC128_32F / BLK128x128_32F scale modes run on sm_90 (Hopper) only)");
  }
  plan.algo = result.algo;
  return plan;
}

// One pool block for everything the product needs besides cuBLASLt's workspace; it goes back to the pool
// on scope exit, after everything that uses it has been enqueued. Pool blocks are reused by later work on
// the engine stream (runtime/device.cu); when the product ran on another stream, the engine stream first
// waits for it, so that reuse cannot overtake it.
class Workspace {
 public:
  Workspace(size_t bytes, cudaStream_t stream) : p_(static_cast<char*>(device::alloc(bytes))), stream_(stream) {}
  ~Workspace() {
    if (stream_ != cuda::stream()) {
      Context& ctx = context();
      std::lock_guard<std::mutex> lock(ctx.mu);
      // Errors here cannot be thrown from a destructor; a failing stream reports at the next checked call.
      if (cudaEventRecord(ctx.done, stream_) == cudaSuccess) cudaStreamWaitEvent(cuda::stream(), ctx.done, 0);
    }
    device::free(p_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  char* at(size_t offset) const { return p_ + offset; }

 private:
  char* p_;
  cudaStream_t stream_;
};

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

void quantize_fp8_rows(int64_t m, int64_t k, const void* x_bf16, int64_t ldx, uint8_t* q, float* scales,
                       cudaStream_t stream) {
  SPARROW_CHECK(m >= 0 && k >= 0, "quantize_fp8_rows: bad sizes m=", m, " k=", k);
  if (m == 0 || k == 0) return;
  SPARROW_CHECK(x_bf16 != nullptr && q != nullptr && scales != nullptr, "quantize_fp8_rows: null pointer");
  SPARROW_CHECK(ldx >= k, "quantize_fp8_rows: x row stride ", ldx, " < k = ", k);
  if (stream == nullptr) stream = cuda::stream();
  launch_quantize(m, m, k, x_bf16, ldx, q, scales, stream);
}

void dequantize_fp8_blocks(int64_t rows, int64_t cols, const uint8_t* w, const float* w_scales, void* out_bf16,
                           cudaStream_t stream) {
  SPARROW_CHECK(rows >= 0 && cols >= 0, "dequantize_fp8_blocks: bad sizes rows=", rows, " cols=", cols);
  if (rows == 0 || cols == 0) return;
  SPARROW_CHECK(w != nullptr && w_scales != nullptr && out_bf16 != nullptr, "dequantize_fp8_blocks: null pointer");
  if (stream == nullptr) stream = cuda::stream();
  const int64_t col_blocks = ceil_div(cols, kBlock);
  const bool vec = cols % 8 == 0 && aligned(w, 8) && aligned(out_bf16, 16);
  const int64_t work = vec ? rows * cols / 8 : rows * cols;
  const int64_t blocks = std::min<int64_t>(ceil_div(work, 256), 132 * 16);  // grid-stride beyond ~16 per SM
  auto* out = static_cast<__nv_bfloat16*>(out_bf16);
  if (vec)
    dequantize_blocks_kernel<true><<<unsigned(blocks), 256, 0, stream>>>(rows, cols, col_blocks, w, w_scales, out);
  else
    dequantize_blocks_kernel<false><<<unsigned(blocks), 256, 0, stream>>>(rows, cols, col_blocks, w, w_scales, out);
  SPARROW_CUDA_CHECK_LAUNCH();
}

void gemm_fp8_block_scaled(int64_t m, int64_t n, int64_t k, const void* x_bf16, int64_t ldx, const uint8_t* w,
                           const float* w_scales, void* y, ElemType y_type, int64_t ldy, cudaStream_t stream) {
  static constexpr const char* kWhat = "gemm_fp8_block_scaled: ";
  SPARROW_CHECK(m >= 0 && n >= 0 && k >= 0, kWhat, "bad sizes m=", m, " n=", n, " k=", k);
  SPARROW_CHECK(y_type == ElemType::F32 || y_type == ElemType::BF16, kWhat, "y must be bf16 or fp32");
  if (m == 0 || n == 0) return;
  SPARROW_CHECK(y != nullptr, kWhat, "y is null");
  SPARROW_CHECK(ldy >= n, kWhat, "y row stride ", ldy, " < n = ", n);
  if (stream == nullptr) stream = cuda::stream();
  const int64_t es = elem_size(y_type);
  if (k == 0) {
    // An empty reduction (cuBLASLt rejects K = 0): y = 0.
    SPARROW_CUDA_CHECK(cudaMemset2DAsync(y, size_t(ldy * es), 0, size_t(n * es), size_t(m), stream));
    return;
  }
  SPARROW_CHECK(x_bf16 != nullptr && w != nullptr && w_scales != nullptr, kWhat, "null x, w or w_scales");
  SPARROW_CHECK(ldx >= k, kWhat, "x row stride ", ldx, " < k = ", k);
  SPARROW_CHECK(k % 16 == 0, kWhat, "k = ", k,
                " must be a multiple of 16 (cuBLASLt FP8 products need the e4m3 operands' K extent and leading "
                "dimension to span multiples of 16 bytes)");
  SPARROW_CHECK((n * es) % 16 == 0, kWhat, "n = ", n, " must be a multiple of ", 16 / es, " for a ",
                type_name(y_type),
                " output (cuBLASLt FP8 products need the output's column-major rows, cuBLASLt's M, to span a "
                "multiple of 16 bytes; block scaling also needs M % 4 == 0)");
  SPARROW_CHECK(aligned(w, 16), kWhat,
                "w must be 16-byte aligned (cuBLASLt FP8 products need 16-byte aligned operand pointers)");

  const int64_t groups = ceil_div(k, kBlock), groups4 = round_up(groups, 4), n_blocks = ceil_div(n, kBlock);
  const int64_t m_pad = round_up(m, 4);  // cuBLASLt block scaling: "M and N must be multiples of 4"
  // w_scales is the BLK128x128 tensor itself when its column stride (groups) is a multiple of 4 and it
  // starts 16-byte aligned; otherwise it is copied into [n_blocks, groups4] with zero padding.
  const bool direct_scales = groups % 4 == 0 && aligned(w_scales, 16);
  // y is the output itself when cuBLASLt may write it: m_pad == m (no padding rows) and 16-byte rows.
  const bool direct_out = m_pad == m && (ldy * es) % 16 == 0 && aligned(y, 16);

  const size_t q_bytes = size_t(m_pad * k), xs_bytes = size_t(groups * m_pad) * 4;
  const size_t ws_bytes = direct_scales ? 0 : size_t(n_blocks * groups4) * 4;
  const size_t tmp_bytes = direct_out ? 0 : size_t(m_pad * n * es);
  const size_t off_xs = align256(q_bytes), off_ws = off_xs + align256(xs_bytes), off_tmp = off_ws + align256(ws_bytes);
  Context& ctx = context();  // first: the workspace's release needs it, and it may refuse an old cuBLASLt
  Workspace work(off_tmp + tmp_bytes, stream);
  auto* q = reinterpret_cast<uint8_t*>(work.at(0));
  auto* xs = reinterpret_cast<float*>(work.at(off_xs));

  launch_quantize(m, m_pad, k, x_bf16, ldx, q, xs, stream);
  const float* a_scales = w_scales;
  if (!direct_scales) {
    auto* padded = reinterpret_cast<float*>(work.at(off_ws));
    SPARROW_CUDA_CHECK(cudaMemsetAsync(padded, 0, ws_bytes, stream));
    SPARROW_CUDA_CHECK(cudaMemcpy2DAsync(padded, size_t(groups4) * 4, w_scales, size_t(groups) * 4,
                                         size_t(groups) * 4, size_t(n_blocks), cudaMemcpyDeviceToDevice, stream));
    a_scales = padded;
  }
  void* out = direct_out ? y : work.at(off_tmp);
  const int64_t ldc = direct_out ? ldy : n;
  {
    const PlanKey key{n, m_pad, k, ldc, int(y_type), pointer_alignment(w), pointer_alignment(out), batch_invariant()};
    std::lock_guard<std::mutex> lock(ctx.mu);
    auto it = ctx.plans.find(key);
    if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key, a_scales, xs)).first;
    const Plan& plan = it->second;
    set_scale_pointers(plan, a_scales, xs);
    const float alpha = 1.0f, beta = 0.0f;
    SPARROW_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.op, &alpha, w, plan.a, q, plan.b, &beta, out, plan.c, out,
                                        plan.c, &plan.algo, cublaslt_workspace(stream), kCublasWorkspaceBytes, stream));
  }
  if (!direct_out)
    SPARROW_CUDA_CHECK(cudaMemcpy2DAsync(y, size_t(ldy * es), out, size_t(n * es), size_t(n * es), size_t(m),
                                         cudaMemcpyDeviceToDevice, stream));
}

}  // namespace sparrow::cuda
