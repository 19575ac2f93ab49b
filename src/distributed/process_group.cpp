#include "distributed/process_group.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "distributed/gloo_communicator.h"
#include "distributed/nccl_communicator.h"
#include "distributed/shm_broadcast.h"
#include "distributed/tcp_store.h"

extern char** environ;

namespace sparrow {

namespace {

constexpr int kDefaultPort = 29500;  // torchrun's
// How long ranks wait for each other when meeting and inside a step: SPARROW_DISTRIBUTED_TIMEOUT_S, else 300 s.
std::chrono::milliseconds distributed_timeout() {
  if (const char* env = std::getenv("SPARROW_DISTRIBUTED_TIMEOUT_S")) {
    char* end = nullptr;
    const double seconds = std::strtod(env, &end);
    SPARROW_CHECK(end != env && *end == '\0' && seconds > 0, "SPARROW_DISTRIBUTED_TIMEOUT_S=", env,
                  ": not a positive number of seconds");
    return std::chrono::milliseconds(int64_t(seconds * 1000));
  }
  return std::chrono::seconds(300);
}
// A worker waits for its next step plan for as long as rank 0 has nothing to run (an idle server): ten years.
constexpr auto kIdleWait = std::chrono::hours(24 * 3650);

std::string exit_description(int status) {
  if (WIFEXITED(status)) return cat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return cat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "stopped";
}

}  // namespace

std::unique_ptr<ProcessGroup> ProcessGroup::start(const ParallelConfig& config, const LaunchEnv& env, char** argv) {
  SPARROW_CHECK(config.tensor_parallel_size >= 1, "--tensor-parallel-size must be at least 1, got ",
                config.tensor_parallel_size);
  SPARROW_CHECK(config.data_parallel_size >= 1, "--data-parallel-size must be at least 1, got ",
                config.data_parallel_size);
  const int world = config.world_size();
  // How the flags name the run's size in messages.
  const std::string sizes = config.data_parallel_size == 1
                                ? cat("--tensor-parallel-size ", world)
                                : cat("--tensor-parallel-size ", config.tensor_parallel_size, " x --data-parallel-size ",
                                      config.data_parallel_size, " = ", world, " ranks");
  std::unique_ptr<ProcessGroup> group(new ProcessGroup());
  const bool launched = !env.launcher.empty();
  const int nodes = config.nnodes;
  if (launched) {
    // The launcher says where every rank runs; node flags, when given (as the workers a node starts inherit
    // them), must say the same.
    SPARROW_CHECK(nodes == 1 || (nodes * env.local_world_size == env.world_size &&
                                 config.node_rank == env.rank / env.local_world_size),
                  describe(env), ": --nnodes ", nodes, " --node-rank ", config.node_rank,
                  " disagree with the launcher's placement of the ranks; leave them out under a launcher");
    SPARROW_CHECK(env.world_size == world, describe(env), ": the launcher started ", env.world_size,
                  " processes for ", sizes, " (one process per rank)");
    group->rank_ = env.rank;
  }
  group->size_ = world;
  group->tp_size_ = config.tensor_parallel_size;
  group->dcp_size_ = config.decode_context_parallel_size;
  SPARROW_CHECK(group->dcp_size_ >= 1 && group->tp_size_ % group->dcp_size_ == 0, "--decode-context-parallel-size ",
                group->dcp_size_, " must divide --tensor-parallel-size ", group->tp_size_, " (DCP shares the TP ranks)");
  SPARROW_CHECK(nodes >= 1, "--nnodes must be at least 1, got ", nodes);
  SPARROW_CHECK(config.node_rank >= 0 && config.node_rank < nodes, "--node-rank ", config.node_rank,
                " is not one of the ", nodes, " nodes (0 .. ", nodes - 1, ")");
  SPARROW_CHECK(group->size_ % nodes == 0, sizes, " does not split evenly over --nnodes ", nodes,
                " (every node runs the same number of ranks)");
  if (!launched) {  // (under a launcher every process runs the same command: rank 0 serves)
    SPARROW_CHECK(!config.headless || config.node_rank > 0,
                  "--headless is for the nodes after the first (--node-rank 1 and up): node 0 serves");
    SPARROW_CHECK(config.headless || config.node_rank == 0, "node ", config.node_rank, " of ", nodes,
                  " runs ranks only: add --headless (node 0 runs the server)");
  }
  const int local_size = group->size_ / nodes;
  if (!launched) group->rank_ = config.node_rank * local_size;
  const bool remote_ranks = launched || nodes > 1;  // ranks on other machines meet at rank 0's address
  SPARROW_CHECK(nodes == 1 || !config.master_addr.empty() || !env.master_addr.empty(),
                "the ", nodes, " nodes meet at rank 0's address: give --master-addr (node 0's address, the same on "
                "every node)");
  std::string addr = !config.master_addr.empty() ? config.master_addr
                     : !env.master_addr.empty()  ? env.master_addr
                                                 : "127.0.0.1";
  int port = config.master_port > 0 ? config.master_port : env.master_port > 0 ? env.master_port : 0;
  if (port == 0 && remote_ranks) port = kDefaultPort;
  // Rank 0 serves the rendezvous (on every interface when the others come from elsewhere); a run this
  // process starts itself takes a free port unless one was given.
  const bool serve = group->rank_ == 0;
  group->store_ = std::make_shared<TcpStore>(serve && remote_ranks ? "0.0.0.0" : addr, port, serve,
                                             distributed_timeout());
  port = group->store_->port();
  if (!launched) group->spawn_workers(argv, addr, port, local_size);

  // The groups, each under its own prefix in the store: a group's ranks (model, plans), the same
  // tensor-parallel rank across the groups (the shared experts), the groups' leaders (the steps' meeting).
  const int tp_rank = group->tensor_parallel_rank(), dp_rank = group->data_parallel_rank();
  const int tp_size = group->tp_size_, dp_size = group->data_parallel_size();
  auto connect = [&](const std::string& prefix, int rank, int size, bool device, bool idle_wait) {
    if (device) return connect_nccl(rank, size, group->store_, prefix);
    GroupOptions options;
    options.rank = rank;
    options.size = size;
    options.master_addr = addr;
    options.master_port = port;
    options.timeout = distributed_timeout();
    options.prefix = prefix;
    if (idle_wait) options.collective_timeout = kIdleWait;
    return connect_gloo(options, group->store_);
  };
  // (One group keeps the names a tensor-parallel run always had.)
  const std::string in_group = dp_size == 1 ? "" : cat(".group", dp_rank);
  if (tp_size > 1) {
    group->model_ = connect("model" + in_group, tp_rank, tp_size, config.device_collectives, false);
    // On one machine the plans go through shared memory (two localhost TCP round trips fewer a step).
    group->plans_ = with_shm_broadcast(connect("plans" + in_group, tp_rank, tp_size, false, true));
  }
  const int dcp = group->dcp_size_;  // consecutive tensor-parallel ranks, as vLLM's DCP groups
  if (dcp > 1)
    group->context_ = connect(cat("context", in_group, ".ranks", tp_rank / dcp * dcp), tp_rank % dcp, dcp,
                              config.device_collectives, false);
  if (dp_size > 1) {
    group->experts_ = connect(cat("experts.rank", tp_rank), dp_rank, dp_size, config.device_collectives, false);
    // A leader waits here for the others as long as the server is idle (runner/data_parallel.h).
    if (tp_rank == 0) group->leaders_ = connect("leaders", dp_rank, dp_size, false, true);
  }
  group->link_options_.master_addr = addr;
  group->link_options_.master_port = port;
  group->link_options_.timeout = distributed_timeout();
  group->link_options_.collective_timeout = kIdleWait;  // a link waits as long as the server is idle
  return group;
}

std::vector<Communicator*> ProcessGroup::connect_engine_links() {
  SPARROW_CHECK(leader() && data_parallel_size() > 1 && engine_links_.empty(),
                "connect_engine_links: once, on a leader of a data-parallel run");
  GroupOptions options = link_options_;
  options.size = 2;
  std::vector<Communicator*> links;
  for (int d = 1; d < data_parallel_size(); ++d) {
    if (data_parallel_rank() != 0 && d != data_parallel_rank()) continue;
    options.rank = data_parallel_rank() == 0 ? 0 : 1;
    options.prefix = cat("engines.group", d);
    engine_links_.push_back(connect_gloo(options, store_));
    links.push_back(engine_links_.back().get());
  }
  return links;
}

void ProcessGroup::spawn_workers(char** argv, const std::string& addr, int port, int local_size) {
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    bool launcher_var = false;
    for (const char* name : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="})
      launcher_var = launcher_var || var.starts_with(name);
    if (!launcher_var) base.push_back(var);
  }
  // The workers run this very program: its path now, so that they show under its name (ps, pgrep) rather
  // than as "exe".
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  SPARROW_CHECK(length > 0, "could not find this program's path (/proc/self/exe): ", std::strerror(errno));
  self[length] = '\0';
  // This process too is one of the ranks on this machine: its thread pool, made at its first parallel step,
  // takes its share of the cores (core/parallel.cpp) as the workers' do.
  setenv("LOCAL_WORLD_SIZE", cat(local_size).c_str(), 1);
  const pid_t parent = getpid();
  std::fflush(nullptr);
  for (int local = 1; local < local_size; ++local) {
    const int rank = rank_ + local;
    std::vector<std::string> env = base;
    env.push_back(cat("RANK=", rank));
    env.push_back(cat("WORLD_SIZE=", size_));
    env.push_back(cat("LOCAL_RANK=", local));
    env.push_back(cat("LOCAL_WORLD_SIZE=", local_size));
    env.push_back("MASTER_ADDR=" + addr);
    env.push_back(cat("MASTER_PORT=", port));
    std::vector<char*> envp;
    for (std::string& var : env) envp.push_back(var.data());
    envp.push_back(nullptr);
    const pid_t pid = fork();
    SPARROW_CHECK(pid >= 0, "could not start tensor-parallel rank ", rank, ": ", std::strerror(errno));
    if (pid == 0) {
      // A worker never outlives the rank that started it.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      execve(self, argv, envp.data());
      std::fprintf(stderr, "error: could not start tensor-parallel rank %d: %s\n", rank, std::strerror(errno));
      _exit(127);
    }
    workers_.push_back(pid);
  }
  if (!workers_.empty()) watcher_ = std::thread([this] { watch_workers(); });
}

// A worker that ends before the run does (a crash, a kill, an error) ends rank 0 too, with its reason: the
// run cannot go on without it, and rank 0 may be idle (a server between requests) with no collective to
// notice. Workers leave with status 0 only when rank 0 tells them the run is over.
void ProcessGroup::watch_workers() {
  std::vector<bool> done(workers_.size(), false);
  while (!stopping_) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      int status = 0;
      if (done[i] || waitpid(workers_[i], &status, WNOHANG) != workers_[i]) continue;
      done[i] = true;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (stopping_) return;
      std::fprintf(stderr, "error: tensor-parallel rank %zu (pid %d) %s; stopping the run\n", rank_ + i + 1, int(workers_[i]),
                   exit_description(status).c_str());
      std::fflush(stderr);
      for (pid_t pid : workers_) kill(pid, SIGKILL);
      _exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void ProcessGroup::kill_workers() {
  stopping_ = true;
  for (pid_t pid : workers_) kill(pid, SIGKILL);
}

ProcessGroup::~ProcessGroup() {
  stopping_ = true;
  if (watcher_.joinable()) watcher_.join();
  engine_links_.clear();
  leaders_.reset();
  experts_.reset();
  plans_.reset();
  model_.reset();
  // The workers leave once told the run is over (runner/step_plan.h); whatever is still there after a
  // grace period is killed.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t pid : workers_) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace sparrow
