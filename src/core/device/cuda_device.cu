// The device runtime on CUDA (core/device/device.h, stream.h): device probe, the engine's stream, a caching pool over cudaMalloc, checked copies.
//
// Pool design (why it looks like this):
//   * Sizes are rounded up to a size class: multiples of 256 B up to 64 KiB, then four classes per power
//     of two (2^k, 1.25·2^k, 1.5·2^k, 1.75·2^k), so a reused block wastes at most 25% and a decode step
//     that asks for the same sizes every step finds them all in the free lists (no cudaMalloc once warm,
//     which also keeps addresses stable for CUDA graph replay).
//   * From 1 GiB on, a block is rounded to 2 MiB (the driver's own granularity) instead: blocks that large
//     are weights (a layer's stacked experts), the KV cache and the recurrent state, allocated once and
//     kept, where up to 25% is gigabytes (Kimi-Linear-48B's 26 expert stacks of 2.4 + 1.2 GB lost 10.5 GB
//     to the classes, and its sweep ran out of memory mid-run, 2026-11-30). A step's scratch stays below.
//   * Freed blocks are handed out again at once. That is safe because all engine work is ordered on the
//     one stream(): a block freed by the host after enqueuing its last use is only reused by work enqueued
//     later on the same stream. Work on other streams must not free into the pool while still running.
//   * On out-of-memory the pool returns its cached blocks to the driver and retries once.
//   * CUDA graphs get a pool of their own (begin_graph_pool / end_graph_pool, around a capture): a
//     captured graph bakes in the addresses of its scratch, so those blocks must never be handed to
//     anyone else. They are shared by all graphs (vLLM shares one graph pool the same way): graphs run
//     one at a time on the one stream, and none keeps data in its scratch from one replay to the next.
#include "core/device/device.h"
#include "core/device/sm_count.h"
#include "core/device/stream.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/device/cuda_check.h"
#include "core/device/sm_count.h"

namespace sparrow::device {

namespace {

struct Block {
  size_t size_class;
  bool graph;  // from the graph pool
};

struct Pool {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_blocks;        // size class -> blocks
  std::map<size_t, std::vector<void*>> free_graph_blocks;  // the same for the graph pool
  std::unordered_map<void*, Block> live;                   // handed out
  bool capturing = false;                                  // between begin_graph_pool and end_graph_pool
  size_t in_use = 0;                                 // bytes of live blocks (by class)
  size_t peak = 0;                                   // the most in_use has been since reset_peak
  size_t cached = 0;                                 // bytes held in free lists
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: tensors freed during static destruction still find it
  return *p;
}

}  // namespace

size_t pool_size_class(size_t bytes) {
  if (bytes == 0) bytes = 1;
  constexpr size_t kSmall = size_t(64) << 10, kLarge = size_t(1) << 30, kDriverGranule = size_t(2) << 20;
  if (bytes <= kSmall) return (bytes + 255) / 256 * 256;
  if (bytes >= kLarge) return (bytes + kDriverGranule - 1) / kDriverGranule * kDriverGranule;
  size_t pow2 = size_t(1) << (63 - __builtin_clzll(bytes));  // largest power of two <= bytes
  size_t step = pow2 / 4;
  return (bytes + step - 1) / step * step;
}

namespace {

void release_locked(Pool& p) {
  for (auto& [cls, blocks] : p.free_blocks)
    for (void* b : blocks) cudaFree(b);  // errors ignored: the memory is gone either way
  p.free_blocks.clear();
  p.cached = 0;
}

}  // namespace

bool available() {
  // Probed once. cudaGetDeviceCount reports a missing driver or device as an error code, never by
  // throwing; the sticky-free error it leaves is cleared so later checks do not see it.
  static const bool available = [] {
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return available;
}

void require() {
  if (available()) return;
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  cudaGetLastError();
  if (status != cudaSuccess)
    fail("no usable CUDA device: ", cudaGetErrorString(status), " (use --device cpu)");
  fail("no CUDA device found (use --device cpu)");
}

void select_for_local_rank(int local_rank) {
  require();
  int count = 0;
  cudaGetDeviceCount(&count);
  const cudaError_t status = cudaSetDevice(local_rank % count);
  if (status != cudaSuccess) fail("cannot use CUDA device ", local_rank % count, ": ", cudaGetErrorString(status));
}

int count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

void* alloc(size_t bytes) {
  const size_t cls = pool_size_class(bytes);
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  auto& free_lists = p.capturing ? p.free_graph_blocks : p.free_blocks;
  auto it = free_lists.find(cls);
  void* ptr = nullptr;
  if (it != free_lists.end() && !it->second.empty()) {
    ptr = it->second.back();
    it->second.pop_back();
    if (!p.capturing) p.cached -= cls;
  } else {
    require();
    cudaError_t status = cudaMalloc(&ptr, cls);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear, then retry with the cache handed back to the driver
      release_locked(p);
      status = cudaMalloc(&ptr, cls);
    }
    if (status != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      cudaGetLastError();
      fail("CUDA out of memory: could not allocate ", cls, " bytes (", p.in_use, " bytes in use by sparrow, ",
           free_b, " of ", total_b, " bytes free on the device): ", cudaGetErrorString(status));
    }
  }
  p.live.emplace(ptr, Block{cls, p.capturing});
  p.in_use += cls;
  p.peak = std::max(p.peak, p.in_use);
  return ptr;  // cudaMalloc returns 256-byte aligned memory
}

void free(void* ptr) {
  if (ptr == nullptr) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.live.find(ptr);
  SPARROW_CHECK(it != p.live.end(), "device::free: pointer was not allocated by the pool");
  const Block block = it->second;
  p.live.erase(it);
  p.in_use -= block.size_class;
  if (block.graph) {
    p.free_graph_blocks[block.size_class].push_back(ptr);  // kept for graphs, whoever frees it
    return;
  }
  p.free_blocks[block.size_class].push_back(ptr);
  p.cached += block.size_class;
}

void begin_graph_pool() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  SPARROW_CHECK(!p.capturing, "begin_graph_pool: a capture is already under way");
  p.capturing = true;
}

void end_graph_pool() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.capturing = false;
}

size_t bytes_in_use() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.in_use;
}

size_t peak_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.peak;
}

void reset_peak() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.peak = p.in_use;
}

void memory_info(size_t& free_bytes, size_t& total_bytes) {
  require();
  SPARROW_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
}

void release_cached_memory() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.cached == 0) return;
  // Blocks in the free lists may still be read by enqueued work that freed them; wait for it first.
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  release_locked(p);
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  // From pageable host memory the driver stages the bytes before returning, so `src` may be reused;
  // from pinned memory it must stay alive until the stream reaches the copy.
  SPARROW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda::stream()));
}

void copy_to_host_sync(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  SPARROW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda::stream()));
  SPARROW_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
}

void copy_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  SPARROW_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::stream()));
}

void copy_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) {
  if (width == 0 || rows == 0) return;
  SPARROW_CUDA_CHECK(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, cuda::stream()));
}

void zero(void* dst, size_t bytes) {
  if (bytes == 0) return;
  SPARROW_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::stream()));
}

void synchronize() { SPARROW_CUDA_CHECK(cudaStreamSynchronize(cuda::stream())); }

Event record_event() {
  cudaEvent_t event = nullptr;
  SPARROW_CUDA_CHECK(cudaEventCreate(&event));
  SPARROW_CUDA_CHECK(cudaEventRecord(event, cuda::stream()));
  return static_cast<Event>(event);
}

float elapsed_ms(Event from, Event to) {
  SPARROW_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(to)));
  float ms = 0;
  SPARROW_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
  return ms;
}

void destroy_event(Event event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));  // a release: nothing to report if the context is already gone
}

}  // namespace sparrow::device

namespace sparrow::cuda {

cudaStream_t stream() {
  static cudaStream_t s = [] {
    device::require();
    cudaStream_t created = nullptr;
    SPARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    SPARROW_CUDA_CHECK(cudaGetDevice(&device));
    SPARROW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return std::max(sms, 1);
  }();
  return count;
}

}  // namespace sparrow::cuda
