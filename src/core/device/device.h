// The device runtime, on the ground floor: one GPU, one stream, a caching memory pool over plain
// cudaMalloc (never managed memory), checked copies, the driver's memory figures and timing events.
// Everything above it (tensors, the KV cache, the runner, the engine) reaches the GPU through this
// header, which names no CUDA type, so it is the same in every build: a build without the CUDA backend
// links core/device/no_device.cpp, where available() is false and the rest fails with a clear message.
// Kernels launch on cuda::stream() (core/device/stream.h); cuda_device.cu implements both.
//
// The pool keeps freed blocks by size class and hands them out again, so a decode step allocates no
// memory from the driver once warm (and a CUDA graph replays over the same addresses).
#pragma once
#include <cstddef>

namespace sparrow::device {

bool available();  // a CUDA device exists and can be used (false in a build without the CUDA backend)
void require();    // throws sparrow::Error with a clear message when none does
// One process per GPU (docs/parallel.md): the process's GPU is the local rank's, local_rank % the visible
// devices (ranks share GPUs round-robin when there are fewer); called before the first allocation.
void select_for_local_rank(int local_rank);
int count();  // the visible CUDA devices (0 without the CUDA backend or a driver)

void* alloc(size_t bytes);  // from the pool; 256-byte aligned; throws on out-of-memory
void free(void* p);         // back to the pool (nullptr is ignored)
size_t bytes_in_use();      // for tests and the memory planner
size_t pool_size_class(size_t bytes);  // the bytes a request of `bytes` takes from the pool (cuda_device.cu says why)
size_t peak_bytes();        // the most bytes_in_use() has been since reset_peak()
void reset_peak();          // (profiling a step's scratch: runner/memory_profile.h)
void memory_info(size_t& free_bytes, size_t& total_bytes);  // the driver's cudaMemGetInfo
void release_cached_memory();  // return pooled blocks to the driver (the graph pool's stay)

// Between these, alloc serves from the CUDA graphs' own pool (cuda_device.cu says why); its blocks go
// back to that pool when freed, at any time.
void begin_graph_pool();
void end_graph_pool();

// Copies on the stream; the _sync forms wait for completion.
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host_sync(void* dst, const void* src, size_t bytes);
void copy_device(void* dst, const void* src, size_t bytes);
// `rows` rows of `width` bytes, `src_pitch` bytes apart, to `dst_pitch` bytes apart (a block of columns).
void copy_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows);
void zero(void* dst, size_t bytes);
void synchronize();

// Timing marks on the stream (profiling): an event recorded after the work queued so far; the
// milliseconds between two of them (waits for the later one); and its release.
using Event = void*;  // a cudaEvent_t
Event record_event();
float elapsed_ms(Event from, Event to);
void destroy_event(Event event);

}  // namespace sparrow::device
