#include "distributed/nccl_communicator.h"

#include <gloo/rendezvous/store.h>

#include "core/error.h"

#if SPARROW_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>  // the types; the library is opened at run time (below)

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/device/device.h"
#include "core/device/stream.h"
#endif

namespace sparrow {

#if SPARROW_HAVE_CUDA

namespace {

// libnccl.so.2 is opened when a run first needs it, as vLLM's pynccl does, not linked: the binary then
// starts where NCCL is not installed (most single-GPU and CPU runs need none), and where it lives elsewhere
// (a Python environment's nvidia/nccl/lib) SPARROW_NCCL_LIBRARY or LD_LIBRARY_PATH names it.
struct Nccl {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  int version = 0;
};

const Nccl& nccl() {
  static Nccl lib;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    const char* env = std::getenv("SPARROW_NCCL_LIBRARY");
    const std::string path = env && *env ? env : "libnccl.so.2";
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
      error = cat("cannot open NCCL (", path, ": ", dlerror(), "): put its folder on LD_LIBRARY_PATH or name the "
                  "library in SPARROW_NCCL_LIBRARY (docs/parallel.md), or run with SPARROW_HOST_COLLECTIVES=1");
      return;
    }
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
      if (!fn && error.empty()) error = cat(path, " has no ", name, ": not a usable NCCL");
    };
    load(lib.GetVersion, "ncclGetVersion");
    load(lib.GetErrorString, "ncclGetErrorString");
    load(lib.GetUniqueId, "ncclGetUniqueId");
    load(lib.CommInitRank, "ncclCommInitRank");
    load(lib.CommDestroy, "ncclCommDestroy");
    load(lib.AllReduce, "ncclAllReduce");
    load(lib.AllGather, "ncclAllGather");
    load(lib.ReduceScatter, "ncclReduceScatter");
    load(lib.Broadcast, "ncclBroadcast");
    load(lib.Send, "ncclSend");
    load(lib.Recv, "ncclRecv");
    load(lib.GroupStart, "ncclGroupStart");
    load(lib.GroupEnd, "ncclGroupEnd");
    if (error.empty()) lib.GetVersion(&lib.version);
  });
  SPARROW_CHECK(error.empty(), error);
  return lib;
}

void check(ncclResult_t result, const char* op, int rank) {
  SPARROW_CHECK(result == ncclSuccess, "nccl ", op, " on rank ", rank, ": ", nccl().GetErrorString(result));
}

ncclDataType_t nccl_type(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return ncclFloat32;
    case ScalarType::BF16: return ncclBfloat16;
    case ScalarType::I32: return ncclInt32;
    case ScalarType::I64: return ncclInt64;
    default: fail("nccl: collectives take f32, bf16, i32 or i64, not ", scalar_name(type));
  }
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, const ncclUniqueId& id) : rank_(rank), size_(size) {
    check(nccl().CommInitRank(&comm_, size, id, rank), "init", rank);
  }
  ~NcclCommunicator() override {
    if (comm_) nccl().CommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::Cuda; }
  std::string backend() const override {
    const int v = nccl().version;  // e.g. 22809: 2.28.9
    return cat("nccl ", v / 10000, ".", v / 100 % 100, ".", v % 100);
  }

  void all_reduce(void* data, int64_t count, ScalarType type) override {
    check(nccl().AllReduce(data, data, size_t(count), nccl_type(type), ncclSum, comm_, cuda::stream()), "all_reduce",
          rank_);
  }
  void all_gather(const void* send, void* recv, int64_t count, ScalarType type) override {
    check(nccl().AllGather(send, recv, size_t(count), nccl_type(type), comm_, cuda::stream()), "all_gather", rank_);
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType type) override {
    check(nccl().ReduceScatter(send, recv, size_t(count), nccl_type(type), ncclSum, comm_, cuda::stream()),
          "reduce_scatter", rank_);
  }
  void all_to_all(const void* send, void* recv, int64_t count, ScalarType type) override {
    const size_t bytes = size_t(count) * scalar_size(type);
    check(nccl().GroupStart(), "all_to_all", rank_);
    for (int peer = 0; peer < size_; ++peer) {
      check(nccl().Send(static_cast<const char*>(send) + peer * bytes, size_t(count), nccl_type(type), peer, comm_,
                     cuda::stream()),
            "all_to_all", rank_);
      check(nccl().Recv(static_cast<char*>(recv) + peer * bytes, size_t(count), nccl_type(type), peer, comm_,
                     cuda::stream()),
            "all_to_all", rank_);
    }
    check(nccl().GroupEnd(), "all_to_all", rank_);
  }
  void broadcast(void* data, int64_t bytes, int root) override {
    check(nccl().Broadcast(data, data, size_t(bytes), ncclUint8, root, comm_, cuda::stream()), "broadcast", rank_);
  }
  void send(const void* data, int64_t bytes, int peer) override {
    check(nccl().Send(data, size_t(bytes), ncclUint8, peer, comm_, cuda::stream()), "send", rank_);
  }
  void recv(void* data, int64_t bytes, int peer) override {
    check(nccl().Recv(data, size_t(bytes), ncclUint8, peer, comm_, cuda::stream()), "recv", rank_);
  }
  void barrier() override {
    if (!scratch_) scratch_ = device::alloc(sizeof(int32_t));
    all_reduce(scratch_, 1, ScalarType::I32);
    device::synchronize();
  }

 private:
  int rank_, size_;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;  // the barrier's one int (kept: freeing it would need the stream idle)
};

}  // namespace

bool nccl_available() {
  try {
    nccl();
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::unique_ptr<Communicator> connect_nccl(int rank, int size, std::shared_ptr<gloo::rendezvous::Store> store,
                                           const std::string& prefix) {
  SPARROW_CHECK(size >= 1 && rank >= 0 && rank < size, "connect_nccl: rank ", rank, " of ", size);
  device::require();
  ncclUniqueId id;
  const std::string key = prefix + "/nccl_unique_id";
  if (rank == 0) {
    check(nccl().GetUniqueId(&id), "get_unique_id", rank);
    store->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
  } else {
    const std::vector<char> bytes = store->get(key);
    SPARROW_CHECK(bytes.size() == sizeof(id.internal), "connect_nccl: a unique id of ", bytes.size(), " bytes under '",
                  key, "' (NCCL's is ", sizeof(id.internal), ": ranks from different builds?)");
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  return std::make_unique<NcclCommunicator>(rank, size, id);
}

#else

bool nccl_available() { return false; }

std::unique_ptr<Communicator> connect_nccl(int, int, std::shared_ptr<gloo::rendezvous::Store>, const std::string&) {
  fail("this build has no NCCL backend (build with the CUDA backend: docs/parallel.md)");
}

#endif

}  // namespace sparrow
