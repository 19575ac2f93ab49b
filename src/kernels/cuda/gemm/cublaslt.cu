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

}  // namespace sparrow::cuda
