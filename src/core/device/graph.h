// CUDA graphs: the kernels a decode step enqueues on the stream, captured once and replayed with one
// launch, which removes the per-kernel launch cost that dominates small decode batches
// (CUDA Programming Guide, "CUDA Graphs": stream capture, instantiate, launch).
//
// A graph replays fixed addresses and launch shapes: whatever changes between steps must be data read
// from device buffers that the caller refills before replay() (runner/decode_graphs.h).
#pragma once
#include <functional>

namespace sparrow::device {

class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Records what `work` enqueues on the stream without running it; memory it allocates comes from the
  // graph pool (device.h). Throws sparrow::Error, with the capture abandoned and the stream usable, when
  // `work` throws or does something a capture cannot hold (a synchronisation, a copy from pageable
  // memory).
  void capture(const std::function<void()>& work);
  // Enqueues the captured work on the stream.
  void replay();
  bool captured() const { return exec_ != nullptr; }

 private:
  void* exec_ = nullptr;  // a cudaGraphExec_t
};

}  // namespace sparrow::device
