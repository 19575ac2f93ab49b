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

bool algo_takes(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                cublasLtMatrixLayout_t c, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t result{};
  return cublasLtMatmulAlgoCheck(cublaslt_handle(), op, a, b, c, c, &algo, &result) == CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= kCublasWorkspaceBytes;
}

bool unsplit_algo(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                  cublasLtMatrixLayout_t c, cublasLtMatmulPreference_t pref, cublasLtMatmulAlgo_t* algo) {
  constexpr int kAsked = 32;
  cublasLtMatmulHeuristicResult_t results[kAsked] = {};
  auto ask = [&](uint32_t mask) {
    SPARROW_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), op, a, b, c, c, pref, kAsked, results, &found) !=
        CUBLAS_STATUS_SUCCESS)
      return 0;
    return found;
  };
  auto splits_of = [](const cublasLtMatmulAlgo_t& candidate) {
    uint32_t splits = 1;
    size_t written = 0;
    SPARROW_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&candidate, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                                              sizeof(splits), &written));
    return splits;
  };
  // First asked to leave out every reduction scheme (a split of K needs one), then the unfiltered list read
  // algorithm by algorithm (the FP8 block-scaled products of an H100 offered nothing filtered).
  for (const uint32_t mask : {uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE), uint32_t(CUBLASLT_REDUCTION_SCHEME_MASK)}) {
    const int found = ask(mask);
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && splits_of(results[i].algo) <= 1) {
        *algo = results[i].algo;
        return true;
      }
  }
  // Every algorithm offered splits K (an H100's FP8 block-scaled products at DeepSeek-V3.2's k = 7168): the
  // first that still runs with its split turned off.
  const int found = ask(uint32_t(CUBLASLT_REDUCTION_SCHEME_MASK));
  for (int i = 0; i < found; ++i) {
    cublasLtMatmulAlgo_t candidate = results[i].algo;
    const uint32_t one = 1, none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&candidate, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&candidate, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                             sizeof(none)) != CUBLAS_STATUS_SUCCESS)
      continue;
    if (algo_takes(op, a, b, c, candidate)) {
      *algo = candidate;
      return true;
    }
  }
  return false;
}


}  // namespace sparrow::cuda
