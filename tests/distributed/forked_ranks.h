// Real processes for the distributed tests: a free loopback port for a group's rendezvous, `size` forked
// ranks running a body, waited for with a deadline, and the same ranks joined in a gloo group. Shared by the gloo, tensor-parallel and data-parallel
// tests (tests/distributed).
#pragma once
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "distributed/gloo_communicator.h"

namespace sparrow::testing {

// A free port below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): the
// connections the ranks open while rank 0 starts can never be given it.
inline int free_port() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  std::mt19937 pick(std::random_device{}());
  std::uniform_int_distribution<int> ports(10000, std::max(10001, ephemeral_low - 1));
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = ports(pick);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(uint16_t(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    close(fd);
    if (free) return port;
  }
  fail("no free port found");
}

// Runs body(rank) in `size` forked processes and waits for them, at most `deadline` (then kills them).
// Returns what went wrong, one clause per failed rank; empty when every rank exited 0.
inline std::string run_ranks(int size, const std::function<void(int rank)>& body,
                             std::chrono::seconds deadline = std::chrono::seconds(60)) {
  std::fflush(nullptr);  // what this process buffered must not be written again by the children
  std::vector<pid_t> pids;
  for (int rank = 0; rank < size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        body(rank);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = 1;
      }
      _exit(code);
    }
    if (pid < 0) {
      for (pid_t started : pids) kill(started, SIGKILL);
      for (pid_t started : pids) waitpid(started, nullptr, 0);
      return "fork failed";
    }
    pids.push_back(pid);
  }
  std::vector<std::optional<int>> status(size);
  const auto until = std::chrono::steady_clock::now() + deadline;
  for (int running = size; running > 0 && std::chrono::steady_clock::now() < until;) {
    for (int rank = 0; rank < size; ++rank) {
      int s = 0;
      if (!status[rank] && waitpid(pids[rank], &s, WNOHANG) == pids[rank]) {
        status[rank] = s;
        --running;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string failures;
  for (int rank = 0; rank < size; ++rank) {
    if (!status[rank]) {
      kill(pids[rank], SIGKILL);
      waitpid(pids[rank], nullptr, 0);
      failures += cat("rank ", rank, " still ran after ", deadline.count(), " s; ");
    } else if (WIFSIGNALED(*status[rank])) {
      failures += cat("rank ", rank, " was killed by signal ", WTERMSIG(*status[rank]), "; ");
    } else if (WEXITSTATUS(*status[rank]) != 0) {
      failures += cat("rank ", rank, " exited with ", WEXITSTATUS(*status[rank]), "; ");
    }
  }
  return failures;
}

// Rank `rank` of a gloo group of `size` on localhost meeting at `port` (a test's timeouts: 60 s).
inline std::unique_ptr<Communicator> connect_local(int rank, int size, int port) {
  GroupOptions options;
  options.rank = rank;
  options.size = size;
  options.master_port = port;
  options.timeout = std::chrono::seconds(60);
  return connect_gloo(options);
}

// Forks `size` ranks, each joining one gloo group on localhost and running body(its communicator); "" when
// all exited 0 (run_ranks' report otherwise).
inline std::string run_group(int size, const std::function<void(Communicator&)>& body,
                             std::chrono::seconds deadline = std::chrono::seconds(120)) {
  const int port = free_port();
  return run_ranks(
      size, [&](int rank) { body(*connect_local(rank, size, port)); }, deadline);
}

}  // namespace sparrow::testing
