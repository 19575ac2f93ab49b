// Row-major products through cuBLASLt (column-major).
//
// A row-major matrix [r, c] with row stride ld is the column-major matrix [c, r] with the same ld, so
// the row-major product y[m,n] = x · op(w) is, read column-major, yᵀ[n,m] = op(w)ᵀ · xᵀ: cuBLASLt is
// called with A = w, B = x, C = D = y and its (M, N, K) = (n, m, k).
//   gemm_nt: w row-major [n, k] is column-major [k, n]; we need [n, k]  -> transa = T.
//   gemm_nn: w row-major [k, n] is column-major [n, k]                  -> transa = N.
//   x row-major [m, k] is column-major [k, m], which is what B must be   -> transb = N.
// Compute is fp32 (CUBLAS_COMPUTE_32F) with fp32 alpha/beta; A, B are bf16; C/D are bf16 or fp32.
//
// A null stream means the engine's stream (runtime/device.h stream()).
// One cuBLASLt handle per process and a 32 MiB workspace per stream; the heuristic's first choice is cached per
// (shape, strides, types, pointer alignment) so steady-state calls do no heuristic search. In batch-invariant
// mode (core/batch_invariance.h) the choice is made once for the product without its row count m, at
// kInvariantRows rows and without a split of K (cublaslt.cuh), and used for every m.
#include "kernels/cuda/gemm/gemm.h"

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

// Everything that changes the plan. Pointer alignment is part of it: the heuristic is told the
// alignment of each operand, and an algorithm chosen for 16-byte alignment may refuse a 2-byte one.
struct PlanKey {
  bool trans_a;
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  int out_type;
  bool beta_zero;
  uint32_t align_a, align_b, align_c;
  bool invariant;  // batch-invariant mode: the algorithm comes from the product without m
  auto tie() const {
    return std::tie(trans_a, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, out_type, beta_zero,
                    align_a, align_b, align_c, invariant);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }

  // The same product without its row count: m dropped, and a batch stride of x or y that is a whole
  // operand (ld * m) marked -1, so that the key, and the algorithm chosen for it, is the same for every m.
  PlanKey without_rows() const {
    PlanKey free = *this;
    free.m = 0;
    if (batch > 1 && stride_b == ldb * m) free.stride_b = -1;
    if (batch > 1 && stride_c == ldc * m) free.stride_c = -1;
    // Alignments count up to 16 bytes only: a view into a pool block may sit less aligned than the block's
    // start, and one product must not get a second algorithm for that.
    free.align_a = std::min(align_a, 16u), free.align_b = std::min(align_b, 16u), free.align_c = std::min(align_c, 16u);
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
};

Context& context() {
  static Context* ctx = new Context;  // never destroyed (plans outlive static destruction of callers)
  return *ctx;
}

cudaDataType_t cuda_type(ElemType t) { return t == ElemType::F32 ? CUDA_R_32F : CUDA_R_16BF; }
int64_t elem_size(ElemType t) { return t == ElemType::F32 ? 4 : 2; }

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  SPARROW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t count = int32_t(batch);
    SPARROW_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    SPARROW_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                          &stride, sizeof(stride)));
  }
  return layout;
}

void destroy(Plan& plan) {
  cublasLtMatrixLayoutDestroy(plan.a);
  cublasLtMatrixLayoutDestroy(plan.b);
  cublasLtMatrixLayoutDestroy(plan.c);
  cublasLtMatmulDescDestroy(plan.op);
}

// Batch-invariant mode: the algorithm for the product at kInvariantRows rows (`free` is key.without_rows()),
// chosen once per such product; layouts a and the descriptor are the real plan's (they do not involve m).
bool invariant_algo(Context& ctx, const PlanKey& free, ElemType out_type, const Plan& plan,
                    cublasLtMatmulPreference_t pref, cublasLtMatmulAlgo_t* algo) {
  auto it = ctx.invariant_algos.find(free);
  if (it == ctx.invariant_algos.end()) {
    const int64_t rows = kInvariantRows;
    const int64_t stride_b = free.stride_b < 0 ? free.ldb * rows : free.stride_b;
    const int64_t stride_c = free.stride_c < 0 ? free.ldc * rows : free.stride_c;
    cublasLtMatrixLayout_t b = make_layout(CUDA_R_16BF, free.k, rows, free.ldb, free.batch, stride_b);
    cublasLtMatrixLayout_t c = make_layout(cuda_type(out_type), free.n, rows, free.ldc, free.batch, stride_c);
    cublasLtMatmulAlgo_t chosen{};
    const bool found = unsplit_algo(plan.op, plan.a, b, c, pref, &chosen);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    if (!found) return false;
    it = ctx.invariant_algos.emplace(free, chosen).first;
  }
  *algo = it->second;
  return true;
}

Plan make_plan(Context& ctx, const PlanKey& key, ElemType out_type) {
  Plan plan;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Column-major view: M = n, N = m, K = k. A is stored [k, n] (trans) or [n, k]; B is [k, m]; C is [n, m].
  const int64_t M = key.n, N = key.m, K = key.k;
  plan.a = key.trans_a ? make_layout(CUDA_R_16BF, K, M, key.lda, key.batch, key.stride_a)
                       : make_layout(CUDA_R_16BF, M, K, key.lda, key.batch, key.stride_a);
  plan.b = make_layout(CUDA_R_16BF, K, N, key.ldb, key.batch, key.stride_b);
  plan.c = make_layout(cuda_type(out_type), M, N, key.ldc, key.batch, key.stride_c);

  // The alignments the heuristic is told: the call's own, or in batch-invariant mode the row-free key's.
  const PlanKey told = key.invariant ? key.without_rows() : key;
  cublasLtMatmulPreference_t pref = nullptr;
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kCublasWorkspaceBytes;
  SPARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &told.align_a, sizeof(key.align_a)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &told.align_b, sizeof(key.align_b)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &told.align_c, sizeof(key.align_c)));
  SPARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &told.align_c, sizeof(key.align_c)));
  if (key.invariant) {
    const bool found = invariant_algo(ctx, key.without_rows(), out_type, plan, pref, &plan.algo);
    cublasLtMatmulPreferenceDestroy(pref);
    if (!found || !algo_takes(plan.op, plan.a, plan.b, plan.c, plan.algo)) {
      destroy(plan);
      fail("batch-invariant mode: cuBLASLt has no ", found ? "algorithm chosen at " : "unsplit algorithm at ",
           kInvariantRows, " rows that also runs the bf16 product m=", key.m, " n=", key.n, " k=", key.k,
           " batch=", key.batch, " (lda=", key.lda, " ldb=", key.ldb, " ldc=", key.ldc, ")");
    }
    return plan;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), plan.op, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(plan);
    fail("cuBLASLt has no algorithm for a bf16 product m=", key.m, " n=", key.n, " k=", key.k,
         " batch=", key.batch, " (lda=", key.lda, " ldb=", key.ldb, " ldc=", key.ldc, "): ",
         cublasLtGetStatusString(status));
  }
  plan.algo = result.algo;
  return plan;
}

void check_operand(const char* what, const GemmOperand& op, int64_t rows, int64_t cols, int64_t batch) {
  SPARROW_CHECK(op.data != nullptr, "gemm: ", what, " is null");
  SPARROW_CHECK(op.type == ElemType::BF16, "gemm: ", what, " must be bf16");
  SPARROW_CHECK(op.ld >= cols, "gemm: ", what, " leading dimension ", op.ld, " < ", cols);
  SPARROW_CHECK(batch == 1 || op.batch_stride >= 0, "gemm: ", what, " batch stride must be >= 0");
  (void)rows;
}

void gemm(bool trans_w, int64_t m, int64_t n, int64_t k, const GemmOperand& x, const GemmOperand& w,
          const GemmOutput& y, float alpha, float beta, int64_t batch, cudaStream_t stream) {
  SPARROW_CHECK(m >= 0 && n >= 0 && k >= 0 && batch >= 1, "gemm: bad sizes m=", m, " n=", n, " k=", k,
                " batch=", batch);
  if (m == 0 || n == 0) return;
  check_operand("x", x, m, k, batch);
  if (trans_w) check_operand("w", w, n, k, batch);
  else check_operand("w", w, k, n, batch);
  SPARROW_CHECK(y.data != nullptr, "gemm: y is null");
  SPARROW_CHECK(y.ld >= n, "gemm: y leading dimension ", y.ld, " < ", n);
  if (stream == nullptr) stream = cuda::stream();
  if (k == 0) {
    // cuBLASLt rejects K = 0; y = beta * y is what the product means then. Only the common beta = 0
    // case is needed (an empty reduction): clear the rows.
    SPARROW_CHECK(beta == 0.0f, "gemm: k = 0 with beta != 0 is not supported");
    const int64_t es = elem_size(y.type);
    for (int64_t b = 0; b < batch; ++b)
      SPARROW_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(y.data) + b * y.batch_stride * es, y.ld * es, 0,
                                           n * es, m, stream));
    return;
  }
  Context& ctx = context();
  PlanKey key{trans_w,
              m,
              n,
              k,
              w.ld,
              x.ld,
              y.ld,
              batch,
              batch > 1 ? w.batch_stride : 0,
              batch > 1 ? x.batch_stride : 0,
              batch > 1 ? y.batch_stride : 0,
              int(y.type),
              beta == 0.0f,
              pointer_alignment(w.data),
              pointer_alignment(x.data),
              pointer_alignment(y.data),
              batch_invariant()};
  std::lock_guard<std::mutex> lock(ctx.mu);
  auto it = ctx.plans.find(key);
  if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key, y.type)).first;
  const Plan& plan = it->second;
  SPARROW_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.op, &alpha, w.data, plan.a, x.data, plan.b, &beta,
                                      y.data, plan.c, y.data, plan.c, &plan.algo, cublaslt_workspace(stream),
                                      kCublasWorkspaceBytes, stream));
}

}  // namespace

void gemm_nt(int64_t m, int64_t n, int64_t k, const GemmOperand& x, const GemmOperand& w, const GemmOutput& y,
             float alpha, float beta, int64_t batch, cudaStream_t stream) {
  gemm(true, m, n, k, x, w, y, alpha, beta, batch, stream);
}

void gemm_nn(int64_t m, int64_t n, int64_t k, const GemmOperand& x, const GemmOperand& w, const GemmOutput& y,
             float alpha, float beta, int64_t batch, cudaStream_t stream) {
  gemm(false, m, n, k, x, w, y, alpha, beta, batch, stream);
}

}  // namespace sparrow::cuda
