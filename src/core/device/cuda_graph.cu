#include "core/device/graph.h"

#include <exception>
#include <string>

#include <cuda_runtime_api.h>

#include "core/device/cuda_check.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::device {

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));  // errors ignored: nothing to do about them here
}

void Graph::capture(const std::function<void()>& work) {
  SPARROW_CHECK(exec_ == nullptr, "device::Graph::capture: already captured");
  cudaStream_t s = cuda::stream();
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
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA graph instantiation failed: ", cudaGetErrorString(made));
  }
  exec_ = exec;
}

void Graph::replay() {
  SPARROW_CHECK(exec_ != nullptr, "device::Graph::replay: nothing captured");
  SPARROW_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), cuda::stream()));
}

}  // namespace sparrow::device
