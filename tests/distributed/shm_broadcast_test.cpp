// The shared-memory broadcast ring (distributed/shm_broadcast.h) between real processes: every reader gets
// every message in order whatever its size (pieces over several slots, empty messages), also a reader that
// opens after the first sends; a dead reader or writer is an error, not a hang; an idle reader sleeps; and a
// gloo group's broadcasts from rank 0 go through it once every rank has opened it (with_shm_broadcast).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ctime>
#include <random>
#include <string>
#include <thread>

#include "distributed/shm_broadcast.h"
#include "../test_util.h"
#include "forked_ranks.h"

using namespace sparrow;
using sparrow::testing::run_ranks;

namespace {

// Message i: a size from 0 to a few slots, bytes derived from i and the position.
std::vector<uint8_t> message(int i, size_t slot_bytes) {
  std::mt19937 rng{uint32_t(i)};
  const size_t size = i % 7 == 0 ? 0 : rng() % (3 * slot_bytes + 5);
  std::vector<uint8_t> bytes(size);
  for (size_t j = 0; j < size; ++j) bytes[j] = uint8_t(i * 31 + j * 7);
  return bytes;
}

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

}  // namespace

TEST(ShmBroadcast, EveryReaderGetsEveryMessageInOrder) {
  constexpr int kReaders = 3, kMessages = 400;
  constexpr size_t kSlot = 256;
  auto ring = ShmBroadcast::create(kReaders, kSlot, 4);
  const std::string name = ring->name();
  std::string failures;
  std::thread readers([&] {
    failures = run_ranks(kReaders, [&](int r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));  // the last opens after the first sends
      auto reader = ShmBroadcast::open(name, r);
      for (int i = 0; i < kMessages; ++i)
        SPARROW_CHECK(reader->receive() == message(i, kSlot), "reader ", r, ": message ", i, " differs");
    });
  });
  for (int i = 0; i < kMessages; ++i) ring->send(message(i, kSlot));
  readers.join();
  EXPECT_EQ(failures, "");
}

TEST(ShmBroadcast, TheWriterWaitsForItsReadersToOpenAndUnlinksTheName) {
  auto ring = ShmBroadcast::create(2, 1024, 2);
  const std::string name = ring->name();
  EXPECT_TRUE(sparrow::testing::mentions(
      sparrow::testing::error_message([&] { ring->wait_for_readers(std::chrono::milliseconds(50)); }), {"timed out"}));
  std::string failures;
  std::thread readers([&] {
    failures = run_ranks(2, [&](int r) {
      auto reader = ShmBroadcast::open(name, r);
      const std::vector<uint8_t> want = {1, 2, 3};
      SPARROW_CHECK(reader->receive() == want, "reader ", r);
    });
  });
  ring->wait_for_readers(std::chrono::seconds(10));
  ring->unlink();
  EXPECT_NE(shm_open(name.c_str(), O_RDONLY, 0), 0);  // the name is gone; the mapping works on
  ring->send(std::vector<uint8_t>{1, 2, 3});
  readers.join();
  EXPECT_EQ(failures, "");
}

TEST(ShmBroadcast, ADeadReaderIsAnErrorForTheWriter) {
  auto ring = ShmBroadcast::create(2, 64, 2);
  const std::string name = ring->name();
  std::string failures;
  std::thread readers([&] {
    failures = run_ranks(2, [&](int r) {
      auto reader = ShmBroadcast::open(name, r);
      if (r == 1) return;  // opens and is gone
      reader->receive();
      reader->receive();
    });
  });
  ring->wait_for_readers(std::chrono::seconds(10));
  ring->send(std::vector<uint8_t>(10, 1));
  ring->send(std::vector<uint8_t>(10, 2));
  // The first slot again: reader 1 never read what it held.
  const std::string error = sparrow::testing::error_message([&] { ring->send(std::vector<uint8_t>(10, 3)); });
  readers.join();
  EXPECT_EQ(failures, "");
  EXPECT_NE(error.find("reader 1 died"), std::string::npos) << error;
}

TEST(ShmBroadcast, ADeadWriterIsAnErrorForAReader) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  std::string failures;
  std::thread writer([&] {
    failures = run_ranks(1, [&](int) {
      auto ring = ShmBroadcast::create(1, 64, 2);
      const std::string& name = ring->name();
      SPARROW_CHECK(write(pipe_fds[1], name.data(), name.size()) == ssize_t(name.size()), "pipe");
      ring->send(std::vector<uint8_t>{7});
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      _exit(0);  // gone without a word (and without unlinking the name)
    });
  });
  char buffer[256] = {};
  const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
  ASSERT_GT(n, 0);
  const std::string name(buffer, size_t(n));
  auto reader = ShmBroadcast::open(name, 0);
  reader->unlink();
  EXPECT_EQ(reader->receive(), std::vector<uint8_t>{7});
  const std::string error = sparrow::testing::error_message([&] { reader->receive(); });
  writer.join();
  EXPECT_EQ(failures, "");
  EXPECT_NE(error.find("the writer died"), std::string::npos) << error;
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

TEST(ShmBroadcast, AnIdleReaderSleeps) {
  auto ring = ShmBroadcast::create(1, 1024, 2);
  const std::string name = ring->name();
  std::string failures;
  std::thread reader([&] {
    failures = run_ranks(1, [&](int) {
      auto r = ShmBroadcast::open(name, 0);
      const double before = cpu_seconds();
      r->receive();  // 300 ms of waiting
      const double used = cpu_seconds() - before;
      SPARROW_CHECK(used < 0.05, "an idle reader used ", used, " s of CPU in 0.3 s");
    });
  });
  ring->wait_for_readers(std::chrono::seconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ring->send(std::vector<uint8_t>{1});
  reader.join();
  EXPECT_EQ(failures, "");
}

TEST(ShmBroadcast, AGroupOnOneMachineBroadcastsThroughIt) {
  const int port = sparrow::testing::free_port();
  EXPECT_EQ(run_ranks(3, [&](int rank) {
              std::unique_ptr<Communicator> group = with_shm_broadcast(sparrow::testing::connect_local(rank, 3, port));
              SPARROW_CHECK(group->backend().find("shm") != std::string::npos, "rank ", rank, ": ", group->backend());
              for (int i = 0; i < 50; ++i) {
                std::vector<uint8_t> bytes = rank == 0 ? message(i, 100000) : std::vector<uint8_t>(message(i, 100000).size());
                group->broadcast(bytes.data(), int64_t(bytes.size()), 0);
                SPARROW_CHECK(bytes == message(i, 100000), "rank ", rank, ": broadcast ", i, " differs");
              }
              int64_t from_one = rank == 1 ? 42 : 0;  // other roots: the group's own broadcast
              group->broadcast(&from_one, sizeof(from_one), 1);
              float sum = float(rank);
              group->all_reduce(&sum, 1, ScalarType::F32);
              SPARROW_CHECK(from_one == 42 && sum == 3.0f, "rank ", rank, ": ", from_one, ", ", sum);
            }),
            "");
}
