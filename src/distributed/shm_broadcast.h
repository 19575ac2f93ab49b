// One writer and a few readers on one machine, through POSIX shared memory: how rank 0 hands each step's plan
// to the workers of its node (issue 23: "on one node through shared memory"), as vLLM's MessageQueue does
// (vllm/distributed/device_communicators/shm_broadcast.py) where a gloo broadcast over localhost costs two
// TCP round trips a step.
//
// The segment is a ring of `slots` slots of `slot_bytes` each. A message larger than a slot goes out in
// pieces over consecutive slots, so any size passes; the writer waits for a slot until every reader has read
// what it held. Waiting spins for a few microseconds (a decode step's plan is due right away), then sleeps on
// a futex (the ring's sequence word, shared between processes), so idle workers take no CPU. Every wait
// also checks, every 100 ms, that the processes it waits for are alive (their pids are in the segment), and
// throws a one-line error rather than hang when one is gone.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/communicator.h"

namespace sparrow {

struct ShmRingHeader;  // the segment's layout (shm_broadcast.cpp)

class ShmBroadcast {
 public:
  // The writer's end: creates a segment for `readers` readers under a fresh name (name() says it; hand it to
  // the readers by other means, e.g. the group's communicator).
  static std::unique_ptr<ShmBroadcast> create(int readers, size_t slot_bytes = size_t(1) << 20, int slots = 8);
  // Reader `index` (0 .. readers - 1) of the segment `name`; it may open before or after the writer's first
  // send and reads every message from the first.
  static std::unique_ptr<ShmBroadcast> open(const std::string& name, int index);
  ~ShmBroadcast();
  ShmBroadcast(const ShmBroadcast&) = delete;
  ShmBroadcast& operator=(const ShmBroadcast&) = delete;

  const std::string& name() const { return name_; }
  // Removes the name (the mapping stays): once every reader has opened the segment, so that nothing is
  // left behind in /dev/shm when the processes end, however they end.
  void unlink();
  // The writer blocks until each reader has opened the segment, or `timeout` passes (an error).
  void wait_for_readers(std::chrono::milliseconds timeout);

  // Writer only.
  void send(std::span<const uint8_t> bytes);
  // Reader only: the next message, in order.
  std::vector<uint8_t> receive();

 private:
  ShmBroadcast() = default;
  uint8_t* slot_data(int64_t slot) const;

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  ShmRingHeader* header_ = nullptr;
  int index_ = -1;          // the reader's index; -1: the writer
  uint64_t next_seq_ = 0;   // the next piece to write or read
};

// A group's plan channel on one machine (distributed/process_group.cpp): `inner`'s collectives, except that a
// broadcast from rank 0 goes through a ShmBroadcast ring (rank 0 writes, the others read). Every rank of
// `inner` calls it together: rank 0 offers a ring, every other rank tries to open it, and unless all of them
// can (ranks on other machines; no room in /dev/shm), every rank keeps `inner` as it is.
std::unique_ptr<Communicator> with_shm_broadcast(std::unique_ptr<Communicator> inner);

}  // namespace sparrow
