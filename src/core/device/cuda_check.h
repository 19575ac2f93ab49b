// Every CUDA runtime call and every kernel launch is checked, in the runtime (core/device) and the
// kernels alike; a failure becomes a sparrow::Error whose one-line message names the call, the file and
// line, and CUDA's own description.
#pragma once
#include <cuda_runtime_api.h>

#include "core/error.h"

#define SPARROW_CUDA_CHECK(call)                                                                      \
  do {                                                                                                \
    const cudaError_t sparrow_cuda_status_ = (call);                                                  \
    if (sparrow_cuda_status_ != cudaSuccess)                                                          \
      ::sparrow::fail("CUDA error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",                   \
                      cudaGetErrorString(sparrow_cuda_status_));                                      \
  } while (0)

// After a <<<...>>> launch: a bad configuration is reported here, a fault inside the kernel at the next
// synchronising call.
#define SPARROW_CUDA_CHECK_LAUNCH() SPARROW_CUDA_CHECK(cudaGetLastError())
