// The communicator for host memory (core/communicator.h): gloo's collectives over its TCP transport,
// the ranks finding each other through a TcpStore that rank 0 serves (as torch's gloo process group does).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "core/communicator.h"

namespace gloo::rendezvous {
class Store;
}

namespace sparrow {

struct GroupOptions {
  int rank = 0, size = 1;
  // Rank 0's rendezvous (rank 0 listens there). Also picks the address gloo listens on: 127.0.0.1 when
  // this is a loopback address, else the host's own (see connect_gloo).
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // How long connecting waits for the other ranks, and each collective for its peers.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Once connected, how long a collective waits instead (0: `timeout`): the step plans' group waits as long
  // as its server stays idle (a peer that dies still fails it at once: its connections close).
  std::chrono::milliseconds collective_timeout{0};
  // The group's namespace in the store: several groups can share one store, each under its own prefix,
  // and a prefix names one group once.
  std::string prefix = "world";
};

// Connects rank `options.rank` of a group of `options.size` processes: rank 0 serves a TcpStore on
// master_addr:master_port, and every rank meets every other there and connects to it directly (a full
// mesh of TCP connections). Returns once this rank is connected to all others; an Error naming the
// rendezvous or the missing rank when they are not all there within the timeout.
//
// gloo listens on the interface named by GLOO_SOCKET_IFNAME when set (as with torch), else on 127.0.0.1
// when master_addr is a loopback address (a single host), else on the address the host's name resolves
// to, or, where that is a loopback address (Debian's /etc/hosts maps the host's name to 127.0.1.1), on the
// address this host reaches master_addr from.
//
// Collectives reduce F32, BF16 (summed in fp32 and rounded to bf16 at each step), I32 and I64; every rank
// gets the same bits. send() returns once the peer's matching recv() has the bytes, so two ranks that
// both send to each other first wait for each other until the timeout. A communicator is used by one
// thread at a time. Connecting makes the process ignore SIGPIPE (where no handler was set): gloo writes to
// its sockets without MSG_NOSIGNAL, and a dead peer must make a collective throw, not kill this rank.
std::unique_ptr<Communicator> connect_gloo(const GroupOptions& options);

// The same over a store the caller made (a TcpStore every rank shares, one prefix per group); the
// communicator keeps it alive.
std::unique_ptr<Communicator> connect_gloo(const GroupOptions& options,
                                           std::shared_ptr<gloo::rendezvous::Store> store);

}  // namespace sparrow
