#include "distributed/gloo_communicator.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include "core/bfloat16.h"
#include "core/error.h"
#include "distributed/tcp_store.h"

namespace sparrow {
namespace {

// Point-to-point messages travel on a slot of their own, apart from the collectives' (gloo/types.h uses
// prefixes 0x01 .. 0x08); gloo matches the sends and recvs of one slot between two ranks in order.
constexpr uint8_t kSendRecvSlotPrefix = 0x10;
constexpr uint8_t kBroadcastSlotPrefix = 0x11;
// Up to this size an all-reduce sends every rank's whole buffer to every rank (one round trip); above it,
// a reduce-scatter and an all-gather (two round trips, less traffic once there are more than two ranks).
constexpr size_t kDirectAllReduceBytes = size_t(1) << 18;

template <typename T>
void add(void* out, const void* a, const void* b, size_t n) {
  T* sum = static_cast<T*>(out);
  const T *x = static_cast<const T*>(a), *y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) sum[i] = x[i] + y[i];
}

void add_bf16(void* out, const void* a, const void* b, size_t n) {
  uint16_t* sum = static_cast<uint16_t*>(out);
  const uint16_t *x = static_cast<const uint16_t*>(a), *y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) sum[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

// gloo's reductions take the element type as a template argument (it cuts the work into segments of
// whole elements): `body` is called with a value of the type that stores `type`.
template <typename Body>
void with_element_type(ScalarType type, const char* op, Body&& body) {
  switch (type) {
    case ScalarType::F32: return body(float{});
    case ScalarType::BF16: return body(uint16_t{});
    case ScalarType::I32: return body(int32_t{});
    case ScalarType::I64: return body(int64_t{});
    default: fail(op, ": cannot sum ", scalar_name(type), " (float32, bfloat16, int32 and int64 only)");
  }
}

// out = a + b, elementwise (out may be a); the reduction of one step.
gloo::AllreduceOptions::Func sum_function(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return add<float>;
    case ScalarType::BF16: return add_bf16;
    case ScalarType::I32: return add<int32_t>;
    case ScalarType::I64: return add<int64_t>;
    default: fail("cannot sum ", scalar_name(type));
  }
}

bool is_loopback(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in&>(addr).sin_addr.s_addr) >> 24) == 127;
  return addr.ss_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr);
}

std::vector<sockaddr_storage> resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::vector<sockaddr_storage> addresses;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return addresses;
  for (addrinfo* at = found; at; at = at->ai_next) {
    sockaddr_storage address{};
    std::memcpy(&address, at->ai_addr, at->ai_addrlen);
    addresses.push_back(address);
  }
  ::freeaddrinfo(found);
  return addresses;
}

socklen_t address_length(const sockaddr_storage& addr) {
  return addr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

std::string numeric_host(const sockaddr_storage& addr) {
  char host[NI_MAXHOST];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), address_length(addr), host, sizeof host, nullptr, 0,
                    NI_NUMERICHOST) != 0)
    return "";
  return host;
}

// The address this host sends from to reach `to`: connecting a UDP socket chooses the route and sends
// nothing. Empty when there is no route.
std::string address_towards(sockaddr_storage to) {
  // A port for connect(2) to take; nothing is sent to it.
  if (to.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(to).sin_port = htons(9);
  if (to.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(to).sin6_port = htons(9);
  int fd = ::socket(to.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_storage from{};
  socklen_t length = sizeof from;
  bool routed = ::connect(fd, reinterpret_cast<const sockaddr*>(&to), address_length(to)) == 0 &&
                ::getsockname(fd, reinterpret_cast<sockaddr*>(&from), &length) == 0;
  ::close(fd);
  return routed && !is_loopback(from) ? numeric_host(from) : "";
}

// Where gloo listens for its peers (connect_gloo's header says why).
gloo::transport::tcp::attr listen_attr(const std::string& master_addr) {
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
    attr.iface = iface;
    return attr;
  }
  const std::vector<sockaddr_storage> master = resolve(master_addr);
  if (!master.empty() && std::all_of(master.begin(), master.end(), is_loopback)) {
    attr.hostname = "127.0.0.1";
    return attr;
  }
  char name[HOST_NAME_MAX + 1] = {};
  ::gethostname(name, sizeof name - 1);
  // The resolved address goes to gloo as a number: gloo's own lookup of a name that does not resolve
  // reads an uninitialized result instead of failing.
  for (const sockaddr_storage& own : resolve(name)) {
    if (is_loopback(own)) continue;
    attr.hostname = numeric_host(own);
    break;
  }
  if (attr.hostname.empty() && !master.empty()) attr.hostname = address_towards(master[0]);
  SPARROW_CHECK(!attr.hostname.empty(), "cannot tell which address to listen on for the group: this host's name '",
                name, "' resolves to no address but loopback, and there is no route to the master address '",
                master_addr, "'; set GLOO_SOCKET_IFNAME to the network interface to use");
  return attr;
}

void check_options(const GroupOptions& options) {
  SPARROW_CHECK(options.size >= 1 && options.rank >= 0 && options.rank < options.size, "rank ", options.rank,
                " is not a rank of a group of ", options.size);
  SPARROW_CHECK(options.timeout.count() > 0, "the group's timeout must be positive, not ", options.timeout.count(),
                " ms");
  SPARROW_CHECK(!options.prefix.empty(), "the group's store prefix must not be empty");
}

void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Store> store, std::shared_ptr<gloo::Context> context)
      : store_(std::move(store)), context_(std::move(context)) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  Device device() const override { return Device::Cpu; }
  std::string backend() const override { return "gloo/tcp"; }

  // Every collective is built on one exchange (gloo's all-to-all: each rank posts its receives and sends to
  // all peers at once), which costs one round trip; gloo's own ring and tree algorithms measured 0.6-3 ms a
  // call between two processes on one host against ~0.1 ms for the exchange (docs/parallel.md). Sums run
  // here, in rank order, so every rank gets the same bits whatever the group's size or the buffer's.
  void all_reduce(void* data, int64_t count, ScalarType type) override {
    with_element_type(type, "all_reduce", [&](auto element) {
      using T = decltype(element);
      if (!check_count("all_reduce", count) || size() == 1) return;
      T* values = static_cast<T*>(data);
      const gloo::AllreduceOptions::Func sum = sum_function(type);
      const size_t n = size_t(count), ranks = size_t(size());
      if (n * sizeof(T) <= kDirectAllReduceBytes || n < ranks) {
        // Small (a decode step's activations): every rank's whole buffer to every rank.
        T* copies = scratch<T>(0, n * ranks);
        T* all = scratch<T>(1, n * ranks);
        for (size_t r = 0; r < ranks; ++r) std::copy(values, values + n, copies + r * n);
        exchange("all_reduce", copies, all, n * sizeof(T));
        sum_in_rank_order(sum, all, n, values);
        return;
      }
      // Large (a prefill's): each rank sums one share of every rank's buffer (a reduce-scatter), then the
      // shares go to every rank (an all-gather): 2 (size - 1) / size of the buffer each way, as a ring's.
      const size_t share = (n + ranks - 1) / ranks;
      T* padded = scratch<T>(0, share * ranks);
      T* parts = scratch<T>(1, share * ranks);
      T* mine = scratch<T>(2, share);
      std::copy(values, values + n, padded);
      std::fill(padded + n, padded + share * ranks, T{});
      exchange("all_reduce", padded, parts, share * sizeof(T));
      sum_in_rank_order(sum, parts, share, mine);
      for (size_t r = 0; r < ranks; ++r) std::copy(mine, mine + share, parts + r * share);
      exchange("all_reduce", parts, padded, share * sizeof(T));
      std::copy(padded, padded + n, values);
    });
  }

  void all_gather(const void* send, void* recv, int64_t count, ScalarType type) override {
    if (!check_count("all_gather", count)) return;
    const size_t bytes = size_t(count * scalar_size(type));
    uint8_t* copies = scratch<uint8_t>(0, bytes * size());
    for (int r = 0; r < size(); ++r) std::memcpy(copies + r * bytes, send, bytes);
    exchange("all_gather", copies, recv, bytes);
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType type) override {
    // Every rank's part for this rank (an all-to-all moves just these), summed here in rank order.
    with_element_type(type, "reduce_scatter", [&](auto element) {
      using T = decltype(element);
      if (!check_count("reduce_scatter", count)) return;
      T* parts = scratch<T>(0, size_t(count) * size());
      exchange("reduce_scatter", send, parts, size_t(count) * sizeof(T));
      sum_in_rank_order(sum_function(type), parts, size_t(count), static_cast<T*>(recv));
    });
  }

  void all_to_all(const void* send, void* recv, int64_t count, ScalarType type) override {
    if (check_count("all_to_all", count)) exchange("all_to_all", send, recv, size_t(count * scalar_size(type)));
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    SPARROW_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of a group of ", size());
    if (!check_count("broadcast", bytes) || size() == 1) return;
    // The root sends to every peer at once; the others receive from it.
    run("broadcast", [&] {
      const uint64_t slot = gloo::Slot::build(kBroadcastSlotPrefix, 0);
      auto buffer = context_->createUnboundBuffer(data, size_t(bytes));
      if (rank() != root) {
        buffer->recv(root, slot);
        buffer->waitRecv(context_->getTimeout());
        return;
      }
      for (int peer = 0; peer < size(); ++peer)
        if (peer != root) buffer->send(peer, slot);
      for (int peer = 1; peer < size(); ++peer) buffer->waitSend(context_->getTimeout());
    });
  }

  void send(const void* data, int64_t bytes, int peer) override {
    check_peer("send", peer);
    if (!check_count("send", bytes)) return;
    run("send", [&] {
      auto buffer = context_->createUnboundBuffer(readable(data), size_t(bytes));
      buffer->send(peer, gloo::Slot::build(kSendRecvSlotPrefix, 0));
      buffer->waitSend(context_->getTimeout());
    });
  }

  void recv(void* data, int64_t bytes, int peer) override {
    check_peer("recv", peer);
    if (!check_count("recv", bytes)) return;
    run("recv", [&] {
      auto buffer = context_->createUnboundBuffer(data, size_t(bytes));
      buffer->recv(peer, gloo::Slot::build(kSendRecvSlotPrefix, 0));
      buffer->waitRecv(context_->getTimeout());
    });
  }

  void barrier() override {
    // A byte to and from every rank: no rank leaves before every rank has arrived.
    std::vector<uint8_t> out(static_cast<size_t>(size())), in(static_cast<size_t>(size()));
    if (size() > 1) exchange("barrier", out.data(), in.data(), 1);
  }

 private:
  // Staging buffers reused from call to call (grown, never shrunk): a fresh vector of a prefill's
  // activations on every call cost a page fault per 4 KB first touched, which made a 1 MB all-reduce 5x
  // its two exchanges (bench/results/collectives.md).
  std::vector<uint8_t> scratch_[3];
  template <typename T>
  T* scratch(int slot, size_t count) {
    std::vector<uint8_t>& buffer = scratch_[slot];
    if (buffer.size() < count * sizeof(T)) buffer.resize(count * sizeof(T));
    return reinterpret_cast<T*>(buffer.data());
  }

  // gloo's buffers are not const, but it only reads those it sends from.
  static uint8_t* readable(const void* data) { return const_cast<uint8_t*>(static_cast<const uint8_t*>(data)); }

  // out = parts[0] + parts[1] + ... (rank order), `n` elements each.
  template <typename T>
  void sum_in_rank_order(const gloo::AllreduceOptions::Func& sum, const T* parts, size_t n, T* out) const {
    std::copy(parts, parts + n, out);
    for (int r = 1; r < size(); ++r) sum(out, out, parts + size_t(r) * n, n);
  }

  // all_to_all on bytes: `part` bytes to and from each rank.
  void exchange(const char* op, const void* send, void* recv, size_t part) {
    run(op, [&] {
      gloo::AlltoallOptions options(context_);
      options.setInput(readable(send), part * size());
      options.setOutput(static_cast<uint8_t*>(recv), part * size());
      gloo::alltoall(options);
    });
  }

  // Whether there is anything to move; a negative count is the caller's error.
  static bool check_count(const char* op, int64_t count) {
    SPARROW_CHECK(count >= 0, op, ": negative count ", count);
    return count > 0;
  }

  void check_peer(const char* op, int peer) const {
    SPARROW_CHECK(peer >= 0 && peer < size() && peer != rank(), op, ": rank ", rank(), " has no peer ", peer,
                  " in a group of ", size());
  }

  // Runs one collective; gloo's errors (a peer closed its connection, a wait timed out) become the group's
  // failure, reported by this call and every later one.
  template <typename Body>
  void run(const char* op, Body&& body) {
    SPARROW_CHECK(failure_.empty(), "rank ", rank(), ": ", op, ": the group failed earlier (", failure_, ")");
    std::string error;
    try {
      body();
      return;
    } catch (const gloo::Exception& e) {
      error = e.what();
    } catch (const gloo::EnforceNotMet& e) {
      error = e.what();
    } catch (const std::system_error& e) {
      error = e.what();
    }
    failure_ = cat("rank ", rank(), ": ", op, " failed: ", error, " (a peer died or timed out)");
    throw Error(failure_);
  }

  std::shared_ptr<gloo::rendezvous::Store> store_;  // rank 0's serves the ranks that are still connecting
  std::shared_ptr<gloo::Context> context_;
  std::string failure_;
};

}  // namespace

std::unique_ptr<Communicator> connect_gloo(const GroupOptions& options) {
  check_options(options);
  SPARROW_CHECK(options.master_port >= 1 && options.master_port <= 65535, "rank ", options.rank,
                ": the rendezvous port ", options.master_port,
                " is not a port (1..65535; --master-port / MASTER_PORT)");
  std::shared_ptr<TcpStore> store;
  try {
    store = std::make_shared<TcpStore>(options.master_addr, options.master_port, options.rank == 0, options.timeout);
  } catch (const Error& e) {
    fail("rank ", options.rank, ": ", e.what());
  }
  return connect_gloo(options, std::move(store));
}

std::unique_ptr<Communicator> connect_gloo(const GroupOptions& options,
                                           std::shared_ptr<gloo::rendezvous::Store> store) {
  check_options(options);
  ignore_sigpipe();
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  context->setTimeout(options.timeout);
  try {
    std::shared_ptr<gloo::transport::Device> device =
        gloo::transport::tcp::CreateDevice(listen_attr(options.master_addr));
    gloo::rendezvous::PrefixStore prefixed(options.prefix, *store);
    context->connectFullMesh(prefixed, device);
  } catch (const std::exception& e) {  // the store's errors, gloo's, and the system's
    fail("rank ", options.rank, ": connecting group '", options.prefix, "' of ", options.size, " failed: ", e.what());
  }
  if (options.collective_timeout.count() > 0) context->setTimeout(options.collective_timeout);
  return std::make_unique<GlooCommunicator>(std::move(store), std::move(context));
}

}  // namespace sparrow
