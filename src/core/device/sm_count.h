// The GPU's streaming multiprocessor count, which kernel launchers size their grids by (src/kernels/cuda).
// Only code built with the CUDA backend includes this header.
#pragma once

namespace sparrow::cuda {

// Of this process's GPU (one per process: device::select_for_local_rank), read once; at least 1.
int sm_count();

}  // namespace sparrow::cuda
