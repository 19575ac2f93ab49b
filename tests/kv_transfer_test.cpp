// The KV transfer agent on UCX (distributed/ucx_kv_transfer.h): regions arrive whole and in place, one
// message each; unknown, repeated and expired offers, cancelled fetches and a producer that dies mid-fetch
// end in failed completions, never a hang. The engine-level test with two servers is
// tests/server/test_disaggregation.py.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <numeric>
#include <thread>

#include "core/error.h"
#include "distributed/ucx_kv_transfer.h"

namespace sparrow {
namespace {

using namespace std::chrono_literals;

// Polls until `n` completions came (or 20 s passed: a hang fails the test instead of stalling it).
std::vector<KvTransferCompletion> wait_for(KvTransferAgent& agent, size_t n) {
  std::vector<KvTransferCompletion> all;
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (all.size() < n && std::chrono::steady_clock::now() < until) {
    for (auto& c : agent.poll()) all.push_back(std::move(c));
    std::this_thread::sleep_for(1ms);
  }
  return all;
}

std::vector<std::byte> pattern(size_t bytes, int seed) {
  std::vector<std::byte> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = std::byte((i * 131 + size_t(seed) * 7) & 0xff);
  return data;
}

struct Pair {
  std::unique_ptr<KvTransferAgent> producer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  std::unique_ptr<KvTransferAgent> consumer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
};

TEST(KvTransfer, RegionsArriveInPlaceOneMessageEach) {
  Pair pair;
  // Four "block rows" of different sizes (a large one goes UCX's rendezvous way) and a state region.
  const std::vector<size_t> sizes = {4096, 3 << 20, 100, 65536, 777};
  std::vector<std::vector<std::byte>> offered, received;
  std::vector<KvRegion> regions;
  for (size_t i = 0; i < sizes.size(); ++i) {
    offered.push_back(pattern(sizes[i], int(i) + 1));
    received.emplace_back(sizes[i], std::byte{0});
    regions.push_back({offered.back().data(), int64_t(sizes[i])});
  }
  pair.producer->offer("req-1", regions, 10s);
  // The consumer holds region 0 already (a prefix-cache hit): it asks for 1..4 only, into its own rows.
  std::vector<std::pair<int64_t, KvRegion>> wanted;
  for (int64_t i = 1; i < int64_t(sizes.size()); ++i) wanted.push_back({i, {received[i].data(), int64_t(sizes[i])}});
  const uint64_t ticket = pair.consumer->fetch(pair.producer->address(), "req-1", wanted, 10s);

  const auto fetched = wait_for(*pair.consumer, 1);
  ASSERT_EQ(fetched.size(), 1u);
  EXPECT_TRUE(fetched[0].ok) << fetched[0].error;
  EXPECT_EQ(fetched[0].ticket, ticket);
  EXPECT_EQ(fetched[0].regions, 4);
  EXPECT_EQ(fetched[0].bytes, int64_t(std::accumulate(sizes.begin() + 1, sizes.end(), size_t(0))));
  for (size_t i = 1; i < sizes.size(); ++i) EXPECT_EQ(received[i], offered[i]) << "region " << i;
  EXPECT_EQ(received[0], std::vector<std::byte>(sizes[0], std::byte{0}));  // not asked for, not written

  const auto served = wait_for(*pair.producer, 1);
  ASSERT_EQ(served.size(), 1u);
  EXPECT_EQ(served[0].kind, KvTransferCompletion::Kind::Offer);
  EXPECT_TRUE(served[0].ok) << served[0].error;
  EXPECT_EQ(served[0].id, "req-1");
  EXPECT_EQ(served[0].regions, 4);
}

TEST(KvTransfer, UnknownRepeatedAndExpiredOffersFailTheFetch) {
  Pair pair;
  std::vector<std::byte> row = pattern(1024, 3), into(1024);
  pair.producer->offer("once", {{row.data(), 1024}}, 10s);
  pair.producer->offer("short-lived", {{row.data(), 1024}}, 1ms);
  std::this_thread::sleep_for(200ms);  // "short-lived" expires (its completion: not ok)

  pair.consumer->fetch(pair.producer->address(), "never-offered", {{0, {into.data(), 1024}}}, 10s);
  auto done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_NE(done[0].error.find("no transfer 'never-offered'"), std::string::npos) << done[0].error;

  pair.consumer->fetch(pair.producer->address(), "short-lived", {{0, {into.data(), 1024}}}, 10s);
  done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);

  pair.consumer->fetch(pair.producer->address(), "once", {{0, {into.data(), 1024}}}, 10s);
  done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok) << done[0].error;
  EXPECT_EQ(into, row);
  pair.consumer->fetch(pair.producer->address(), "once", {{0, {into.data(), 1024}}}, 10s);
  done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_NE(done[0].error.find("no transfer"), std::string::npos) << done[0].error;

  // The producer saw: "short-lived" expired, "once" served.
  const auto offers = wait_for(*pair.producer, 2);
  ASSERT_EQ(offers.size(), 2u);
  for (const auto& c : offers) EXPECT_EQ(c.ok, c.id == "once") << c.id << ": " << c.error;
}

TEST(KvTransfer, WithdrawnOfferAndOutOfRangeRegionFail) {
  Pair pair;
  std::vector<std::byte> row = pattern(256, 5), into(256);
  pair.producer->offer("gone", {{row.data(), 256}}, 10s);
  pair.producer->withdraw("gone");
  auto offers = wait_for(*pair.producer, 1);
  ASSERT_EQ(offers.size(), 1u);
  EXPECT_FALSE(offers[0].ok);
  EXPECT_EQ(offers[0].error, "withdrawn");

  pair.producer->offer("small", {{row.data(), 256}}, 10s);
  pair.consumer->fetch(pair.producer->address(), "small", {{3, {into.data(), 256}}}, 10s);
  auto done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_NE(done[0].error.find("region 3 of 1"), std::string::npos) << done[0].error;
  offers = wait_for(*pair.producer, 1);
  ASSERT_EQ(offers.size(), 1u);
  EXPECT_FALSE(offers[0].ok);
}

// A cancelled fetch ends as failed, but only once the producer's messages are in: the producer's offer ends
// too (its sends are not left waiting for receives that are gone, which would hold its memory forever).
TEST(KvTransfer, CancelledFetchEndsOnBothSides) {
  Pair pair;
  std::vector<std::byte> row = pattern(4 << 20, 6), into(4 << 20);
  pair.producer->offer("cancel-me", {{row.data(), int64_t(row.size())}}, 10s);
  const uint64_t ticket = pair.consumer->fetch(pair.producer->address(), "cancel-me", {{0, {into.data(), int64_t(into.size())}}}, 10s);
  pair.consumer->cancel(ticket);
  const auto done = wait_for(*pair.consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket, ticket);
  EXPECT_FALSE(done[0].ok);
  EXPECT_EQ(done[0].error, "cancelled");
  const auto offers = wait_for(*pair.producer, 1);
  ASSERT_EQ(offers.size(), 1u) << "the producer's offer must end";
}

TEST(KvTransfer, NobodyListeningFailsTheFetchNotTheProcess) {
  auto consumer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  // A port nobody listens on: take one from an agent, then let that agent go.
  KvPeer gone;
  { gone = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1")->address(); }
  std::vector<std::byte> into(64);
  consumer->fetch(gone, "x", {{0, {into.data(), 64}}}, 5s);
  const auto done = wait_for(*consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
}

TEST(KvTransfer, TakenPortIsAClearError) {
  auto first = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  try {
    make_ucx_kv_transfer("127.0.0.1", first->address().port, "127.0.0.1");
    FAIL() << "a second listener on the same port";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen"), std::string::npos) << e.what();
  }
}

// A producer in another process that is killed before the fetch: the fetch fails (the endpoint's error or
// its timeout), and the consumer's agent serves the next fetch from a live producer.
TEST(KvTransfer, DeadProducerFailsTheFetchCleanly) {
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The producer: offers a region, says where it listens, and is killed before anyone fetches... or
    // while the fetch is under way; either way the consumer must not hang.
    auto producer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
    static std::vector<std::byte> row(8 << 20, std::byte{1});
    producer->offer("dying", {{row.data(), int64_t(row.size())}}, 60s);
    const int port = producer->address().port;
    (void)!write(ready[1], &port, sizeof(port));
    pause();
    _exit(0);
  }
  int port = 0;
  ASSERT_EQ(read(ready[0], &port, sizeof(port)), ssize_t(sizeof(port)));
  auto consumer = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
  std::vector<std::byte> into(8 << 20);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  consumer->fetch({"127.0.0.1", port}, "dying", {{0, {into.data(), int64_t(into.size())}}}, 5s);
  auto done = wait_for(*consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);

  Pair live;
  std::vector<std::byte> row = pattern(512, 9), again(512);
  live.producer->offer("alive", {{row.data(), 512}}, 10s);
  consumer->fetch(live.producer->address(), "alive", {{0, {again.data(), 512}}}, 10s);
  done = wait_for(*consumer, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok) << done[0].error;
  EXPECT_EQ(again, row);
}

}  // namespace
}  // namespace sparrow
