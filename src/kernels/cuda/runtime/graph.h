// CUDA graphs: the kernels a decode step enqueues on stream(), captured once and replayed with one
// launch, which removes the per-kernel launch cost that dominates small decode batches
// (CUDA Programming Guide, "CUDA Graphs": stream capture, instantiate, launch).
//
// A graph replays fixed addresses and launch shapes: whatever changes between steps must be data read
// from device buffers that the caller refills before replay() (model/decode_graphs.h).
#pragma once
#include <cuda_runtime_api.h>

#include <functional>

namespace sparrow::cuda {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Records what `work` enqueues on stream() without running it; memory it allocates comes from the
  // graph pool (runtime/device.h). Throws sparrow::Error, with the capture abandoned and the stream
  // usable, when `work` throws or does something a capture cannot hold (a synchronisation, a copy
  // from pageable memory).
  void capture(const std::function<void()>& work);
  // Enqueues the captured work on stream().
  void replay();
  bool captured() const { return exec_ != nullptr; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace sparrow::cuda
