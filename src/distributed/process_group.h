// The processes of one tensor-parallel (and data-parallel) run, from inside one of them (docs/parallel.md,
// "Running").
//
// Ranks find each other at rank 0's rendezvous (TcpStore at master_addr:master_port) and form their groups
// there. The run is data_parallel_size groups of tensor_parallel_size ranks (group d: ranks d * size ..
// d * size + size - 1, its first rank the group's leader); every group has the model's collectives
// ("model") and the plan channel its leader drives its workers through ("plans", runner/step_plan.h).
// With data parallelism, each rank also joins the ranks of its tensor-parallel rank in the other groups
// (the shared experts' collectives, TensorParallel::dp_comm) and each leader the other leaders (the steps'
// meeting, runner/data_parallel.h). The ranks come from an existing launcher — torchrun-style variables,
// Open MPI's mpirun, Slurm's srun (launch_env.h) — or, on one node without one, from this process itself:
// `sparrow <command> -tp N` is rank 0 and starts ranks 1 .. N-1 as copies of itself (the same executable and
// arguments, torchrun's variables set), then supervises them: a worker that dies ends rank 0 with a message
// naming it, and every worker dies with rank 0 (PR_SET_PDEATHSIG) or leaves when told the run is over.
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "core/communicator.h"
#include "distributed/gloo_communicator.h"
#include "distributed/launch_env.h"

namespace sparrow {

class TcpStore;

// vLLM's flags for where the ranks meet.
struct ParallelConfig {
  int tensor_parallel_size = 1;
  int data_parallel_size = 1;  // groups of tensor_parallel_size ranks, each with its own requests
  bool enable_expert_parallel = false;  // routed experts dealt out whole (TensorParallel::expert_parallel)
  // Decode context parallelism: the tensor-parallel ranks of a group, this many at a time, share out the
  // MLA caches' tokens (TensorParallel::dcp_size); must divide tensor_parallel_size.
  int decode_context_parallel_size = 1;
  std::string master_addr;  // empty: MASTER_ADDR, else 127.0.0.1
  int master_port = 0;      // 0: MASTER_PORT, else a free port (single node) or 29500
  // Several machines without a launcher (vLLM's flags): each node starts its own size / nnodes ranks, node
  // r ranks r * size / nnodes and up; node 0 serves, the others run with --headless (ranks only).
  int nnodes = 1;
  int node_rank = 0;
  bool headless = false;
  // The model's collectives on NCCL (device memory, captured in CUDA graphs) rather than gloo through the
  // host: a CUDA run whose ranks each have a GPU of their own (the caller selected it already).
  bool device_collectives = false;
  int world_size() const { return tensor_parallel_size * data_parallel_size; }
  bool multi_process() const { return world_size() > 1 || nnodes > 1 || node_rank != 0 || headless; }
};

class ProcessGroup {
 public:
  // Joins the run this process is part of (`env`: read_launch_env()), or starts this node's ranks of it when
  // no launcher set the environment (this process is the node's first rank); `argv` (null-terminated) is what
  // the workers it starts run. Errors: a launcher's world size other than tensor_parallel_size, --nnodes /
  // --node-rank / --headless that do not fit together (or with a launcher), a rendezvous nobody answers.
  static std::unique_ptr<ProcessGroup> start(const ParallelConfig& config, const LaunchEnv& env, char** argv);
  ~ProcessGroup();  // rank 0 of a run it started: waits for the workers to leave (then kills what is left)

  int rank() const { return rank_; }  // in the whole run
  int size() const { return size_; }  // every rank of every group
  int tensor_parallel_rank() const { return rank_ % tp_size_; }
  int tensor_parallel_size() const { return tp_size_; }
  int data_parallel_rank() const { return rank_ / tp_size_; }  // this rank's group
  int data_parallel_size() const { return size_ / tp_size_; }
  bool leader() const { return tensor_parallel_rank() == 0; }  // runs its group's scheduling
  // The group's collectives and plan channel (a group of one rank has neither: null).
  Communicator* model() { return model_.get(); }
  Communicator* plans() { return plans_.get(); }
  // Data parallel: the leaders' meeting (leaders only; else null).
  Communicator* leaders() { return leaders_.get(); }
  // Data parallel, serving (engine/remote_groups.h): connects rank 0 with every other group's leader, a
  // host group of two each (rank 0 there is rank 0). Every leader calls it once; on rank 0 it returns the
  // links to groups 1 .. D-1 in order, on another leader its one link.
  std::vector<Communicator*> connect_engine_links();
  TensorParallel tensor_parallel() {
    return {tensor_parallel_rank(), tp_size_, model_.get(), false, data_parallel_rank(), data_parallel_size(),
            experts_.get(), tensor_parallel_rank() % dcp_size_, dcp_size_, context_.get()};
  }
  // Rank 0 giving up on a run it started (an error mid-step: the workers may wait in a collective it will
  // never join): kills them now.
  void kill_workers();

 private:
  ProcessGroup() = default;
  void spawn_workers(char** argv, const std::string& addr, int port, int local_size);
  void watch_workers();

  int rank_ = 0, size_ = 1, tp_size_ = 1, dcp_size_ = 1;
  std::shared_ptr<TcpStore> store_;
  std::unique_ptr<Communicator> model_, plans_, experts_, leaders_, context_;
  std::vector<std::unique_ptr<Communicator>> engine_links_;
  GroupOptions link_options_;  // how the links meet (the rendezvous, the timeouts)
  std::vector<pid_t> workers_;    // the ranks this process started: rank_ + 1, rank_ + 2, ...
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

}  // namespace sparrow
