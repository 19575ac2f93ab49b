#include "kernels/cuda/runtime/graph.h"

#include <exception>
#include <string>

#include "kernels/cuda/runtime/cuda_check.h"
#include "kernels/cuda/runtime/device.h"

namespace sparrow::cuda {

CudaGraph::~CudaGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);  // errors ignored: nothing to do about them here
}

void CudaGraph::capture(const std::function<void()>& work) {
  SPARROW_CHECK(exec_ == nullptr, "CudaGraph::capture: already captured");
  cudaStream_t s = stream();
  // Relaxed mode: the capture allows cudaMalloc (the graph pool may need fresh blocks), which the
  // global mode forbids; nothing else runs on this thread meanwhile.
  SPARROW_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  begin_graph_pool();
  std::string failure;
  try {
    work();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  end_graph_pool();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  if (failure.empty() && ended != cudaSuccess)
    failure = std::string("the capture was invalidated: ") + cudaGetErrorString(ended);
  cudaGetLastError();  // an invalidated capture leaves its error behind; it is reported below instead
  if (!failure.empty()) {
    if (graph) cudaGraphDestroy(graph);
    fail("CUDA graph capture failed: ", failure);
  }
  const cudaError_t made = cudaGraphInstantiate(&exec_, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    exec_ = nullptr;
    cudaGetLastError();
    fail("CUDA graph instantiation failed: ", cudaGetErrorString(made));
  }
}

void CudaGraph::replay() {
  SPARROW_CHECK(exec_ != nullptr, "CudaGraph::replay: nothing captured");
  SPARROW_CUDA_CHECK(cudaGraphLaunch(exec_, stream()));
}

}  // namespace sparrow::cuda
