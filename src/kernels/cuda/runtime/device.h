// The GPU runtime: one device, one stream, and a caching memory pool over plain cudaMalloc (never
// managed memory). Every call is checked (runtime/cuda_check.h).
//
// The pool keeps freed blocks by size class and hands them out again, so a decode step allocates no
// memory from the driver once warm (and a CUDA graph replays over the same addresses).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sparrow::cuda {

bool device_available();            // a CUDA device exists and can be used
void require_device();              // throws sparrow::Error with a clear message when none does
cudaStream_t stream();              // the engine's stream (created on first use, non-blocking)

void* device_alloc(size_t bytes);   // from the pool; 256-byte aligned; throws on out-of-memory
void device_free(void* p);          // back to the pool (nullptr is ignored)
size_t device_bytes_in_use();       // for tests and the memory planner
size_t pool_size_class(size_t bytes);  // the bytes a request of `bytes` takes from the pool (device.cu says why)
size_t device_peak_bytes();         // the most device_bytes_in_use() has been since reset_device_peak()
void reset_device_peak();           // (profiling a step's scratch: EngineCore's gpu_kv_cache_bytes)
void device_memory_info(size_t& free_bytes, size_t& total_bytes);  // the driver's cudaMemGetInfo
void release_cached_memory();       // return pooled blocks to the driver (the graph pool's stay)

// Between these, device_alloc serves from the CUDA graphs' own pool (device.cu says why); its blocks
// go back to that pool when freed, at any time.
void begin_graph_pool();
void end_graph_pool();

// Copies on stream(); the _sync forms wait for completion.
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host_sync(void* dst, const void* src, size_t bytes);
void copy_device(void* dst, const void* src, size_t bytes);
void zero_device(void* dst, size_t bytes);
void synchronize();

// Timing marks on stream() (profiling): an event recorded after the work queued so far; the milliseconds
// between two of them (waits for the later one); and its release.
cudaEvent_t record_event();
float elapsed_ms(cudaEvent_t from, cudaEvent_t to);
void destroy_event(cudaEvent_t event);

}  // namespace sparrow::cuda
