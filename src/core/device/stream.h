// The engine's CUDA stream, for kernel launchers (src/kernels/cuda): all engine work is ordered on it,
// which is what lets the pool (core/device/device.h) hand a freed block out again at once. Only code
// built with the CUDA backend includes this header.
#pragma once
#include <cuda_runtime_api.h>

namespace sparrow::cuda {

cudaStream_t stream();  // created on first use, non-blocking

}  // namespace sparrow::cuda
