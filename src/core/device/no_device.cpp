// The device runtime of a build without the CUDA backend (CMakeLists.txt links this file instead of
// cuda_device.cu and cuda_graph.cu when nvcc was not found): there is no device, and anything that would
// need one fails with the same clear message instead of a link error or a crash.
#include "core/device/device.h"
#include "core/device/graph.h"
#include "core/error.h"

namespace sparrow::device {

namespace {
[[noreturn]] void no_backend() {
  fail("this build of sparrow has no CUDA backend (nvcc was not found when it was built): use --device cpu");
}
}  // namespace

bool available() { return false; }
void require() { no_backend(); }
void select_for_local_rank(int) { no_backend(); }
int count() { return 0; }
void* alloc(size_t) { no_backend(); }
void free(void* p) {
  if (p != nullptr) no_backend();
}
size_t bytes_in_use() { return 0; }
size_t pool_size_class(size_t bytes) { return bytes; }
size_t peak_bytes() { return 0; }
void reset_peak() {}
void memory_info(size_t&, size_t&) { no_backend(); }
void release_cached_memory() {}
void begin_graph_pool() { no_backend(); }
void end_graph_pool() {}
void copy_to_device(void*, const void*, size_t) { no_backend(); }
void copy_to_host_sync(void*, const void*, size_t) { no_backend(); }
void copy_device(void*, const void*, size_t) { no_backend(); }
void copy_device_2d(void*, size_t, const void*, size_t, size_t, size_t) { no_backend(); }
void zero(void*, size_t) { no_backend(); }
void synchronize() { no_backend(); }
Event record_event() { no_backend(); }
float elapsed_ms(Event, Event) { no_backend(); }
void destroy_event(Event) {}

Graph::~Graph() = default;
void Graph::capture(const std::function<void()>&) { no_backend(); }
void Graph::replay() { no_backend(); }

}  // namespace sparrow::device
