// What gemm.cu and gemm_fp8.cu share about cuBLASLt: the status check, one handle per process, one
// workspace per stream (products on two streams may overlap), and the pointer alignment that plans
// are chosen for. Internal to the gemm folder (CUDA sources only).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/error.h"

#define SPARROW_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                               \
    const cublasStatus_t sparrow_cublas_status_ = (call);                                            \
    if (sparrow_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                             \
      ::sparrow::fail("cuBLASLt error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",              \
                      cublasLtGetStatusName(sparrow_cublas_status_), " (",                           \
                      cublasLtGetStatusString(sparrow_cublas_status_), ")");                        \
  } while (0)

namespace sparrow::cuda {

// cuBLAS's advice for Hopper: 32 MiB of workspace.
inline constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;

cublasLtHandle_t cublaslt_handle();
// The workspace of `stream` (kCublasWorkspaceBytes, from the device pool, kept for the process).
void* cublaslt_workspace(cudaStream_t stream);
// The largest power of two up to 256 that divides the address: the heuristic is told each operand's
// alignment, and an algorithm chosen for 16-byte alignment may refuse a 2-byte one.
uint32_t pointer_alignment(const void* p);

// Batch-invariant mode (core/batch_invariance.h): a product's algorithm must not change with its number of
// rows m (cuBLASLt's N in these files) and must not split K, so that a row's sums run in one order however
// many rows share the call. The callers describe the product at kInvariantRows rows and take
// unsplit_algo's choice for every m; each real layout is then confirmed with check_algo.
inline constexpr int64_t kInvariantRows = 256;
// The heuristic's first algorithm with one pass over K (SPLITK_NUM 1, preferably of no reduction scheme)
// for these layouts, or else the first it offers that still runs with its split of K turned off; false
// when there is none. `pref` is the caller's preference (workspace, alignments).
bool unsplit_algo(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                  cublasLtMatrixLayout_t c, cublasLtMatmulPreference_t pref, cublasLtMatmulAlgo_t* algo);
// Whether `algo` runs the product with these layouts (cublasLtMatmulAlgoCheck).
bool algo_takes(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                cublasLtMatrixLayout_t c, const cublasLtMatmulAlgo_t& algo);

}  // namespace sparrow::cuda
