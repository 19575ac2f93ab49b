// The CPU communicator (distributed/gloo_communicator.h) between real processes: every collective checked
// exactly on groups of 2, 3 and 4 ranks (integer-valued sums, exact in any order), empty and large
// buffers, point to point in both directions, groups sharing one store, and peers that die or go silent.
// And its rendezvous, the TcpStore (distributed/tcp_store.h), within one process.
//
// Each rank is a fork() of the test process, made before it creates any thread of its own; a rank leaves
// with _exit (0 when its body returned, 1 after printing what it threw), so that nothing of the test
// process's state (gtest's, the parent's sockets) runs twice.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "forked_ranks.h"
#include "core/bfloat16.h"
#include "core/error.h"
#include "distributed/gloo_communicator.h"
#include "distributed/tcp_store.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using sparrow::testing::free_port;
using sparrow::testing::run_ranks;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::unique_ptr<Communicator> connect(int rank, int size, int port, std::chrono::milliseconds timeout = 30s,
                                      const std::string& master_addr = "127.0.0.1") {
  GroupOptions options;
  options.rank = rank;
  options.size = size;
  options.master_addr = master_addr;
  options.master_port = port;
  options.timeout = timeout;
  return connect_gloo(options);
}

// An IPv4 address of this host other than loopback; empty when it has none.
std::string own_address() {
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return "";
  std::string found;
  for (ifaddrs* at = interfaces; at && found.empty(); at = at->ifa_next) {
    if (!at->ifa_addr || at->ifa_addr->sa_family != AF_INET || (at->ifa_flags & IFF_LOOPBACK) ||
        !(at->ifa_flags & IFF_UP))
      continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(at->ifa_addr)->sin_addr, text, sizeof text);
    found = text;
  }
  freeifaddrs(interfaces);
  return found;
}

// A rank's check: throws (so the rank prints it and exits 1) at the first element that differs.
template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  if (got.size() != want.size()) fail(what, ": ", got.size(), " elements, expected ", want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) fail(what, ": element ", i, " is ", got[i], ", expected ", want[i]);
}

void expect_error(const std::function<void()>& call, std::initializer_list<std::string> parts,
                  const std::string& what) {
  const std::string message = error_message(call);
  if (!mentions(message, parts)) fail(what, ": ", mentions(message, parts).message());
}

std::vector<uint16_t> bf16s(const std::vector<float>& values) {
  std::vector<uint16_t> out;
  for (float v : values) out.push_back(float_to_bf16(v));
  return out;
}

constexpr int kSizes[] = {2, 3, 4};

}  // namespace

// --- the collectives ---------------------------------------------------------------------------------

TEST(GlooCommunicator, AllReduceSumsEveryTypeExactly) {
  for (int size : kSizes) {
    const int port = free_port();
    EXPECT_EQ(run_ranks(size, [&](int rank) {
      auto comm = connect(rank, size, port);
      if (comm->rank() != rank || comm->size() != size || comm->device() != Device::Cpu ||
          comm->backend() != "gloo/tcp")
        fail("wrong identity: rank ", comm->rank(), " of ", comm->size(), ", ", comm->backend());
      const int64_t rank_sum = int64_t(size) * (size + 1) / 2;  // sum over ranks of rank + 1
      for (int64_t count : {int64_t(1), int64_t(5), int64_t(1) << 20}) {
        std::vector<float> f(count), f_want(count);
        std::vector<int32_t> i32(count), i32_want(count);
        std::vector<int64_t> i64(count), i64_want(count);
        std::vector<float> b(count), b_want(count);
        for (int64_t i = 0; i < count; ++i) {
          f[i] = float((rank + 1) * (i % 1000));
          f_want[i] = float(rank_sum * (i % 1000));
          i32[i] = (rank - 1) * int32_t(i % 5000);
          i32_want[i] = int32_t((rank_sum - 2 * size) * (i % 5000));
          i64[i] = (int64_t(rank) << 40) + i;
          i64_want[i] = ((rank_sum - size) << 40) + size * i;
          b[i] = float((rank + 1) * (i % 8));  // partial sums stay below 256: exact in bfloat16
          b_want[i] = float(rank_sum * (i % 8));
        }
        std::vector<uint16_t> bf = bf16s(b);
        comm->all_reduce(f.data(), count, ScalarType::F32);
        comm->all_reduce(i32.data(), count, ScalarType::I32);
        comm->all_reduce(i64.data(), count, ScalarType::I64);
        comm->all_reduce(bf.data(), count, ScalarType::BF16);
        expect_equal(f, f_want, cat("float32 all_reduce of ", count));
        expect_equal(i32, i32_want, cat("int32 all_reduce of ", count));
        expect_equal(i64, i64_want, cat("int64 all_reduce of ", count));
        expect_equal(bf, bf16s(b_want), cat("bfloat16 all_reduce of ", count));
      }
      comm->all_reduce(nullptr, 0, ScalarType::F32);
    }), "") << size << " ranks";
  }
}

TEST(GlooCommunicator, FloatSumsAgreeOnEveryRank) {
  // Sums that round differently in different orders: every rank must still hold the same bits.
  const int size = 3, count = 4096;
  const int port = free_port();
  EXPECT_EQ(run_ranks(size, [&](int rank) {
    auto comm = connect(rank, size, port);
    std::vector<float> x(count);
    std::mt19937 random{uint32_t(rank)};
    for (float& v : x) v = std::uniform_real_distribution<float>(-1, 1)(random) * 1e4f;
    comm->all_reduce(x.data(), count, ScalarType::F32);
    std::vector<float> gathered(size_t(count) * size);
    comm->all_gather(x.data(), gathered.data(), count, ScalarType::F32);
    for (int r = 0; r < size; ++r)
      expect_equal(std::vector<float>(gathered.begin() + r * count, gathered.begin() + (r + 1) * count), x,
                   cat("rank ", r, "'s sum"));
  }), "");
}

TEST(GlooCommunicator, AllGatherAndAllToAll) {
  for (int size : kSizes) {
    const int port = free_port();
    EXPECT_EQ(run_ranks(size, [&](int rank) {
      auto comm = connect(rank, size, port);
      for (int64_t count : {int64_t(1), int64_t(3), int64_t(1) << 18}) {
        std::vector<int32_t> send(count), want(size_t(count) * size);
        for (int64_t i = 0; i < count; ++i) send[i] = rank * 1000000 + int32_t(i);
        for (int r = 0; r < size; ++r)
          for (int64_t i = 0; i < count; ++i) want[r * count + i] = r * 1000000 + int32_t(i);
        std::vector<int32_t> gathered(want.size(), -1);
        comm->all_gather(send.data(), gathered.data(), count, ScalarType::I32);
        expect_equal(gathered, want, cat("all_gather of ", count));
        // In place: this rank's part already where it goes.
        std::vector<int32_t> in_place(want.size(), -1);
        std::copy(send.begin(), send.end(), in_place.begin() + rank * count);
        comm->all_gather(in_place.data() + rank * count, in_place.data(), count, ScalarType::I32);
        expect_equal(in_place, want, cat("in-place all_gather of ", count));

        // all_to_all: part p of rank r's send goes to rank p, which keeps it at part r.
        std::vector<int32_t> parts(size_t(count) * size), received(parts.size(), -1), expected(parts.size());
        for (int p = 0; p < size; ++p)
          for (int64_t i = 0; i < count; ++i) {
            parts[p * count + i] = rank * 100000000 + p * 1000000 + int32_t(i);
            expected[p * count + i] = p * 100000000 + rank * 1000000 + int32_t(i);
          }
        comm->all_to_all(parts.data(), received.data(), count, ScalarType::I32);
        expect_equal(received, expected, cat("all_to_all of ", count));
      }
      // Element sizes other than 4 bytes: bfloat16 and int64.
      std::vector<uint16_t> b = bf16s({float(rank), float(rank + 1)}), b_all(2 * size_t(size));
      comm->all_gather(b.data(), b_all.data(), 2, ScalarType::BF16);
      for (int r = 0; r < size; ++r)
        expect_equal(std::vector<uint16_t>(b_all.begin() + 2 * r, b_all.begin() + 2 * r + 2),
                     bf16s({float(r), float(r + 1)}), "bfloat16 all_gather");
      std::vector<int64_t> wide(size), wide_back(size);
      for (int p = 0; p < size; ++p) wide[p] = (int64_t(rank) << 36) + p;
      comm->all_to_all(wide.data(), wide_back.data(), 1, ScalarType::I64);
      for (int r = 0; r < size; ++r)
        if (wide_back[r] != (int64_t(r) << 36) + rank) fail("int64 all_to_all: part ", r, " is ", wide_back[r]);
      comm->all_gather(nullptr, nullptr, 0, ScalarType::F32);
      comm->all_to_all(nullptr, nullptr, 0, ScalarType::F32);
    }), "") << size << " ranks";
  }
}

TEST(GlooCommunicator, ReduceScatterSumsEachRanksPart) {
  for (int size : kSizes) {
    const int port = free_port();
    EXPECT_EQ(run_ranks(size, [&](int rank) {
      auto comm = connect(rank, size, port);
      const int64_t rank_sum = int64_t(size) * (size + 1) / 2;
      for (int64_t count : {int64_t(1), int64_t(5), int64_t(1) << 18}) {
        const int64_t total = count * size;
        std::vector<float> f(total), b(total);
        std::vector<int64_t> i64(total);
        std::vector<int32_t> i32(total);
        for (int64_t j = 0; j < total; ++j) {
          f[j] = float((rank + 1) * (j % 997));
          b[j] = float((rank + 1) * (j % 4));
          i64[j] = (int64_t(rank) << 33) + j;
          i32[j] = (rank % 2 ? -1 : 1) * int32_t(j % 10000);
        }
        std::vector<float> f_out(count), f_want(count), b_want(count);
        std::vector<int64_t> i64_out(count), i64_want(count);
        std::vector<int32_t> i32_out(count), i32_want(count);
        std::vector<uint16_t> b_out(count);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t j = rank * count + i;  // this rank's part of every send
          f_want[i] = float(rank_sum * (j % 997));
          b_want[i] = float(rank_sum * (j % 4));
          i64_want[i] = ((rank_sum - size) << 33) + size * j;
          i32_want[i] = int32_t(size % 2) * int32_t(j % 10000);  // the odd ranks cancel the even ones
        }
        comm->reduce_scatter(f.data(), f_out.data(), count, ScalarType::F32);
        comm->reduce_scatter(bf16s(b).data(), b_out.data(), count, ScalarType::BF16);
        comm->reduce_scatter(i64.data(), i64_out.data(), count, ScalarType::I64);
        comm->reduce_scatter(i32.data(), i32_out.data(), count, ScalarType::I32);
        expect_equal(f_out, f_want, cat("float32 reduce_scatter of ", count));
        expect_equal(b_out, bf16s(b_want), cat("bfloat16 reduce_scatter of ", count));
        expect_equal(i64_out, i64_want, cat("int64 reduce_scatter of ", count));
        expect_equal(i32_out, i32_want, cat("int32 reduce_scatter of ", count));
      }
      comm->reduce_scatter(nullptr, nullptr, 0, ScalarType::BF16);
    }), "") << size << " ranks";
  }
}

TEST(GlooCommunicator, BroadcastFromAnyRoot) {
  for (int size : kSizes) {
    const int port = free_port();
    EXPECT_EQ(run_ranks(size, [&](int rank) {
      auto comm = connect(rank, size, port);
      for (int root : {size - 1, 0, 1}) {
        for (int64_t bytes : {int64_t(1), int64_t(13), int64_t(1) << 20}) {
          std::vector<uint8_t> want(bytes), data(bytes, 0xEE);
          for (int64_t i = 0; i < bytes; ++i) want[i] = uint8_t(i * 7 + root);
          if (rank == root) data = want;
          comm->broadcast(data.data(), bytes, root);
          expect_equal(data, want, cat("broadcast of ", bytes, " bytes from rank ", root));
        }
        comm->broadcast(nullptr, 0, root);
      }
    }), "") << size << " ranks";
  }
}

TEST(GlooCommunicator, SendRecvBetweenEveryPairBothWays) {
  // Every pair (a, b), a < b, in one order all ranks follow: a sends two messages then receives one,
  // b receives two then sends one (a send returns once the peer has received it).
  auto message = [](int from, int to, int64_t bytes) {
    std::vector<uint8_t> m(bytes);
    for (int64_t i = 0; i < bytes; ++i) m[i] = uint8_t(from * 31 + to * 7 + i);
    return m;
  };
  for (int size : kSizes) {
    const int port = free_port();
    EXPECT_EQ(run_ranks(size, [&](int rank) {
      auto comm = connect(rank, size, port);
      for (int a = 0; a < size; ++a)
        for (int b = a + 1; b < size; ++b) {
          if (rank != a && rank != b) continue;
          std::vector<uint8_t> small(100), large(int64_t(1) << 20), reply(17);
          if (rank == a) {
            comm->send(message(a, b, 100).data(), 100, b);
            comm->send(message(a, b, 1 << 20).data(), 1 << 20, b);
            comm->send(nullptr, 0, b);
            comm->recv(reply.data(), 17, b);
            expect_equal(reply, message(b, a, 17), cat("rank ", b, "'s reply"));
          } else {
            comm->recv(small.data(), 100, a);
            comm->recv(large.data(), 1 << 20, a);
            comm->recv(nullptr, 0, a);
            comm->send(message(b, a, 17).data(), 17, a);
            expect_equal(small, message(a, b, 100), cat("rank ", a, "'s first message"));
            expect_equal(large, message(a, b, 1 << 20), cat("rank ", a, "'s second message"));
          }
        }
      comm->barrier();
    }), "") << size << " ranks";
  }
}

TEST(GlooCommunicator, ManyCollectivesBackToBack) {
  const int size = 4;
  const int port = free_port();
  EXPECT_EQ(run_ranks(size, [&](int rank) {
    auto comm = connect(rank, size, port);
    for (int step = 0; step < 40; ++step) {
      const int64_t count = 1 + step * 37 % 300;
      std::vector<float> x(count, float(rank + step));
      comm->all_reduce(x.data(), count, ScalarType::F32);
      expect_equal(x, std::vector<float>(count, float(6 + 4 * step)), cat("step ", step, " all_reduce"));
      int32_t token = rank == step % size ? step * 3 : -1;
      comm->broadcast(&token, sizeof token, step % size);
      if (token != step * 3) fail("step ", step, " broadcast: ", token);
      std::vector<int64_t> ranks(size);
      const int64_t mine = rank * 100 + step;
      comm->all_gather(&mine, ranks.data(), 1, ScalarType::I64);
      for (int r = 0; r < size; ++r)
        if (ranks[r] != r * 100 + step) fail("step ", step, " all_gather: rank ", r, " gave ", ranks[r]);
      if (step % 5 == 0) comm->barrier();
    }
  }), "");
}

TEST(GlooCommunicator, OneRankGroup) {
  const int port = free_port();
  EXPECT_EQ(run_ranks(1, [&](int) {
    auto comm = connect(0, 1, port);
    std::vector<float> x = {1, 2, 3}, y(3);
    comm->all_reduce(x.data(), 3, ScalarType::F32);
    expect_equal(x, std::vector<float>{1, 2, 3}, "all_reduce");
    comm->all_gather(x.data(), y.data(), 3, ScalarType::F32);
    expect_equal(y, std::vector<float>{1, 2, 3}, "all_gather");
    std::fill(y.begin(), y.end(), 0.0f);
    comm->reduce_scatter(x.data(), y.data(), 3, ScalarType::F32);
    expect_equal(y, std::vector<float>{1, 2, 3}, "reduce_scatter");
    std::fill(y.begin(), y.end(), 0.0f);
    comm->all_to_all(x.data(), y.data(), 3, ScalarType::F32);
    expect_equal(y, std::vector<float>{1, 2, 3}, "all_to_all");
    comm->broadcast(x.data(), 12, 0);
    comm->barrier();
  }), "");
}

TEST(GlooCommunicator, ArgumentErrors) {
  GroupOptions options;
  options.rank = 2;
  options.size = 2;
  options.master_port = 29500;
  EXPECT_TRUE(mentions(error_message([&] { connect_gloo(options); }), {"rank 2 is not a rank of a group of 2"}));
  options.rank = 0;
  options.master_port = 0;
  EXPECT_TRUE(mentions(error_message([&] { connect_gloo(options); }), {"port 0 is not a port", "MASTER_PORT"}));
  options.master_port = 29500;
  options.timeout = 0ms;
  EXPECT_TRUE(mentions(error_message([&] { connect_gloo(options); }), {"timeout must be positive"}));

  const int port = free_port();
  EXPECT_EQ(run_ranks(2, [&](int rank) {
    auto comm = connect(rank, 2, port);
    float x = 1;
    expect_error([&] { comm->all_reduce(&x, 1, ScalarType::U8); }, {"all_reduce: cannot sum uint8"}, "uint8 sum");
    expect_error([&] { comm->all_reduce(&x, -1, ScalarType::F32); }, {"all_reduce: negative count -1"}, "count");
    expect_error([&] { comm->broadcast(&x, 4, 2); }, {"broadcast: root 2 is not a rank of a group of 2"}, "root");
    expect_error([&] { comm->send(&x, 4, rank); }, {"send: rank ", " has no peer"}, "send to itself");
    expect_error([&] { comm->recv(&x, 4, 5); }, {"recv: rank ", " has no peer 5"}, "recv from nobody");
    // Mistakes are the caller's, not the group's: it still works.
    comm->all_reduce(&x, 1, ScalarType::F32);
    if (x != 2) fail("all_reduce after the mistakes: ", x);
  }), "");
}

TEST(GlooCommunicator, GroupsShareAStoreUnderTheirPrefixes) {
  // Two groups of all three ranks and one of ranks 0 and 2 (ranks 0 and 1 there), met on one store.
  const int size = 3;
  const int port = free_port();
  EXPECT_EQ(run_ranks(size, [&](int rank) {
    auto store = std::make_shared<TcpStore>("127.0.0.1", port, rank == 0, 30s);
    auto group = [&](const std::string& prefix, int group_rank, int group_size) {
      GroupOptions options;
      options.rank = group_rank;
      options.size = group_size;
      options.master_port = port;
      options.timeout = 30s;
      options.prefix = prefix;
      return connect_gloo(options, store);
    };
    auto a = group("a", rank, size);
    auto b = group("b", rank, size);
    std::unique_ptr<Communicator> pair = rank == 1 ? nullptr : group("pair", rank / 2, 2);
    for (int step = 0; step < 5; ++step) {
      int64_t in_a = rank + step, in_b = 10 * rank;
      b->all_reduce(&in_b, 1, ScalarType::I64);
      a->all_reduce(&in_a, 1, ScalarType::I64);
      if (in_a != 3 + 3 * step || in_b != 30) fail("step ", step, ": a gave ", in_a, ", b gave ", in_b);
      if (pair) {
        int64_t in_pair = rank;
        pair->all_reduce(&in_pair, 1, ScalarType::I64);
        if (pair->size() != 2 || in_pair != 2) fail("step ", step, ": the pair gave ", in_pair);
      }
    }
    a->barrier();
  }), "");
}

TEST(GlooCommunicator, ListensWhereItIsTold) {
  // GLOO_SOCKET_IFNAME names the interface; a missing one is the error of connecting.
  int port = free_port();
  EXPECT_EQ(run_ranks(2, [&](int rank) {
    setenv("GLOO_SOCKET_IFNAME", "lo", 1);
    auto comm = connect(rank, 2, port);
    int32_t x = rank + 1;
    comm->all_reduce(&x, 1, ScalarType::I32);
    if (x != 3) fail("all_reduce over lo: ", x);
  }), "");
  port = free_port();
  EXPECT_EQ(run_ranks(1, [&](int) {
    setenv("GLOO_SOCKET_IFNAME", "no-such-if0", 1);
    expect_error([&] { connect(0, 1, port); }, {"rank 0: connecting group 'world' of 1 failed: ", "no-such-if0"},
                 "connect on a missing interface");
  }), "");

  // A rendezvous on a non-loopback address: the ranks listen on the host's own address (this host's name
  // may resolve to loopback only, as Debian's /etc/hosts has it: then on its route to the rendezvous).
  const std::string address = own_address();
  if (address.empty()) GTEST_SKIP() << "this host has no address but loopback";
  port = free_port();
  EXPECT_EQ(run_ranks(3, [&](int rank) {
    auto comm = connect(rank, 3, port, 30s, address);
    int64_t x = rank;
    comm->all_reduce(&x, 1, ScalarType::I64);
    if (x != 3) fail("all_reduce through ", address, ": ", x);
  }), "") << address;
}

// --- failures ------------------------------------------------------------------------------------------

TEST(GlooCommunicator, DeadPeerMakesTheCollectiveThrow) {
  const int port = free_port();
  EXPECT_EQ(run_ranks(2, [&](int rank) {
    auto comm = connect(rank, 2, port, 2s);
    comm->barrier();  // both connected before rank 1 goes
    if (rank == 1) _exit(0);
    std::vector<float> x(1 << 16, 1.0f);
    const Clock::time_point start = Clock::now();
    expect_error([&] { comm->all_reduce(x.data(), int64_t(x.size()), ScalarType::F32); },
                 {"rank 0: all_reduce failed: ", "(a peer died or timed out)"}, "all_reduce with a dead peer");
    if (seconds_since(start) > 10) fail("the dead peer was noticed only after ", seconds_since(start), " s");
    expect_error([&] { comm->barrier(); }, {"rank 0: barrier: the group failed earlier (rank 0: all_reduce failed"},
                 "barrier after the failure");
  }), "");
}

TEST(GlooCommunicator, SilentPeerTimesOut) {
  const int port = free_port();
  EXPECT_EQ(run_ranks(2, [&](int rank) {
    auto comm = connect(rank, 2, port, 2s);
    comm->barrier();
    if (rank == 1) {
      std::this_thread::sleep_for(4s);  // alive, connected, and never joining the all_reduce
      _exit(0);
    }
    float x = 1;
    const Clock::time_point start = Clock::now();
    expect_error([&] { comm->all_reduce(&x, 1, ScalarType::F32); }, {"rank 0: all_reduce failed: "},
                 "all_reduce with a silent peer");
    if (seconds_since(start) < 1.5 || seconds_since(start) > 3.9)
      fail("the 2 s timeout took ", seconds_since(start), " s");
  }), "");
}

TEST(GlooCommunicator, MissingRankFailsToConnect) {
  // Rank 1 of 2 never starts.
  const int port = free_port();
  EXPECT_EQ(run_ranks(1, [&](int) {
    const Clock::time_point start = Clock::now();
    expect_error([&] { connect(0, 2, port, 1s); },
                 {"rank 0: connecting group 'world' of 2 failed: ", "'world/1'", "within 1 s"}, "connect");
    if (seconds_since(start) > 5) fail("connecting gave up after ", seconds_since(start), " s");
  }), "");
}

TEST(GlooCommunicator, UnreachableRendezvous) {
  const int port = free_port();
  EXPECT_EQ(run_ranks(1, [&](int) {
    expect_error([&] { connect(1, 2, port, 500ms); },
                 {"rank 1: could not reach the rendezvous at 127.0.0.1:", " within 0.5 s (is rank 0 running?"},
                 "connect");
  }), "");
}

// --- the rendezvous store ----------------------------------------------------------------------------

TEST(TcpStore, SetGetWaitAcrossClients) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  ASSERT_GT(server.port(), 0);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  server.set("a", {'1', '2'});
  EXPECT_EQ(client.get("a"), std::vector<char>({'1', '2'}));
  client.set("a", {});  // overwritten, and empty values are values
  EXPECT_EQ(server.get("a"), std::vector<char>());
  std::vector<char> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = char(i * 13);
  client.set("big", big);
  EXPECT_EQ(server.get("big"), big);
  client.wait({"a", "big"});
  client.wait({"a"}, 10ms);
}

TEST(TcpStore, GetWaitsForALaterSet) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  std::thread setter([&] {
    TcpStore client("127.0.0.1", server.port(), false, 5s);
    std::this_thread::sleep_for(200ms);
    client.set("late", {'x'});
  });
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(server.get("late"), std::vector<char>({'x'}));
  EXPECT_GE(seconds_since(start), 0.15);
  setter.join();
}

TEST(TcpStore, MissingKeyTimesOutNamingIt) {
  TcpStore server("127.0.0.1", 0, true, 300ms);
  TcpStore client("127.0.0.1", server.port(), false, 300ms);
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(mentions(error_message([&] { client.get("world/rank_3"); }),
                       {"rendezvous at 127.0.0.1:", ": key 'world/rank_3' did not appear within 0.3 s"}));
  EXPECT_GE(seconds_since(start), 0.29);
  EXPECT_LT(seconds_since(start), 3);
  server.set("here", {'1'});
  EXPECT_TRUE(mentions(error_message([&] { client.wait({"here", "absent"}, 100ms); }),
                       {"key(s) 'here', 'absent' did not all appear within 0.1 s"}));
  // The client reconnects after a timeout; the server forgot the request it left waiting.
  EXPECT_EQ(client.get("here"), std::vector<char>({'1'}));
  client.set("absent", {'2'});
  client.wait({"here", "absent"});
}

TEST(TcpStore, UnreachableServerFailsWithinTheTimeout) {
  const int port = free_port();
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(mentions(error_message([&] { TcpStore("127.0.0.1", port, false, 500ms); }),
                       {cat("could not reach the rendezvous at 127.0.0.1:", port, " within 0.5 s "),
                        "(is rank 0 running? --master-addr / MASTER_ADDR)", "Connection refused"}));
  EXPECT_GE(seconds_since(start), 0.45);
  EXPECT_LT(seconds_since(start), 3);
  EXPECT_TRUE(mentions(error_message([&] { TcpStore("203.0.113.1", port, true, 200ms); }),
                       {"cannot listen for the rendezvous on 203.0.113.1:"}));
}

TEST(TcpStore, ClientMayStartBeforeTheServer) {
  const int port = free_port();
  std::vector<char> seen;
  std::thread early([&] {
    TcpStore client("127.0.0.1", port, false, 10s);
    seen = client.get("k");
  });
  std::this_thread::sleep_for(300ms);
  TcpStore server("127.0.0.1", port, true, 10s);
  server.set("k", {'v'});
  early.join();
  EXPECT_EQ(seen, std::vector<char>({'v'}));
}

TEST(TcpStore, ServesManyClientsAndSurvivesStrayOnes) {
  TcpStore server("0.0.0.0", 0, true, 10s);
  // Strangers: garbage, half a request, a frame announcing more than the server buffers, then gone.
  for (std::string bytes : {std::string("GET / HTTP/1.1\r\n\r\n"), std::string("\x20\0\0\0\x02", 5),
                            std::string("\xff\xff\xff\xff", 4)}) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(uint16_t(server.port()));
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
    close(fd);
  }
  const int clients = 12;
  std::vector<std::string> errors(clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      try {
        TcpStore client("127.0.0.1", server.port(), false, 10s);
        client.set(cat("rank_", c), {char('a' + c)});
        for (int other = 0; other < clients; ++other)
          if (client.get(cat("rank_", other)) != std::vector<char>{char('a' + other)}) errors[c] = "wrong value";
      } catch (const Error& e) {
        errors[c] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int c = 0; c < clients; ++c) EXPECT_EQ(errors[c], "") << "client " << c;
}

TEST(TcpStore, ShutsDownWithAClientStillWaiting) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, 10s);
  std::string error;
  std::thread waiting([&, port = server->port()] {
    TcpStore client("127.0.0.1", port, false, 10s);
    error = error_message([&] { client.get("never"); });
  });
  std::this_thread::sleep_for(200ms);
  const Clock::time_point start = Clock::now();
  server.reset();
  EXPECT_LT(seconds_since(start), 1);
  waiting.join();
  EXPECT_LT(seconds_since(start), 2);
  EXPECT_TRUE(mentions(error, {"the rendezvous at 127.0.0.1:", " closed the connection (did rank 0 exit?)"}));
}
