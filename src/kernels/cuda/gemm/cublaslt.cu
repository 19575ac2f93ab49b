#include "kernels/cuda/gemm/cublaslt.cuh"

#include <map>
#include <mutex>

#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::cuda {

namespace {
struct Shared {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  std::map<cudaStream_t, void*> workspaces;
};
Shared& shared() {
  static Shared* s = [] {
    auto* created = new Shared;  // never destroyed: callers may run during static destruction
    SPARROW_CUBLAS_CHECK(cublasLtCreate(&created->handle));
    return created;
  }();
  return *s;
}
}  // namespace

cublasLtHandle_t cublaslt_handle() { return shared().handle; }

void* cublaslt_workspace(cudaStream_t stream) {
  Shared& s = shared();
  std::lock_guard<std::mutex> lock(s.mu);
  void*& workspace = s.workspaces[stream];
  if (workspace == nullptr) workspace = device::alloc(kCublasWorkspaceBytes);
  return workspace;
}

uint32_t pointer_alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

bool unsplit_algo(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                  cublasLtMatrixLayout_t c, cublasLtMatmulPreference_t pref, cublasLtMatmulAlgo_t* algo) {
  // First asked to leave out every reduction scheme (a split of K needs one); where that leaves nothing (the
  // FP8 block-scaled products on an H100 did), the unfiltered list, read algorithm by algorithm.
  for (const bool filtered : {true, false}) {
    const uint32_t mask = filtered ? uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE) : uint32_t(CUBLASLT_REDUCTION_SCHEME_MASK);
    SPARROW_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
    constexpr int kAsked = 32;
    cublasLtMatmulHeuristicResult_t results[kAsked] = {};
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), op, a, b, c, c, pref, kAsked, results, &found) !=
        CUBLAS_STATUS_SUCCESS)
      continue;
    for (int i = 0; i < found; ++i) {
      uint32_t splits = 1;
      size_t written = 0;
      SPARROW_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                                &splits, sizeof(splits), &written));
      if (results[i].state == CUBLAS_STATUS_SUCCESS && splits <= 1) {
        *algo = results[i].algo;
        return true;
      }
    }
  }
  return false;
}

bool algo_takes(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                cublasLtMatrixLayout_t c, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t result{};
  return cublasLtMatmulAlgoCheck(cublaslt_handle(), op, a, b, c, c, &algo, &result) == CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= kCublasWorkspaceBytes;
}

}  // namespace sparrow::cuda
