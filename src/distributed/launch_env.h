// Who this process is in a multi-process launch, as the launcher tells it through the environment:
// its rank, the number of ranks, its place on its node, and where rank 0's rendezvous listens.
#pragma once
#include <cstdlib>
#include <functional>
#include <string>

namespace sparrow {

struct LaunchEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  // Rank 0's rendezvous, when the environment names it; empty / 0 otherwise (the caller fills them from
  // its flags).
  std::string master_addr;
  int master_port = 0;
  std::string launcher;  // "torchrun", "mpirun", "srun", or "" (a single process)
};

// Reads the first launcher's variables present, in this order:
//   torchrun (and Kubernetes LeaderWorkerSet pods that set the same names):
//     RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (the local pair defaults to 0 / 1)
//   Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//     OMPI_COMM_WORLD_LOCAL_SIZE
//   Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and for the local size the first number of
//     SLURM_NTASKS_PER_NODE ("4" or "4(x2)"), else of SLURM_TASKS_PER_NODE, which srun always sets (an
//     estimate where the nodes run different counts: at least SLURM_LOCALID + 1, at most SLURM_NTASKS)
// and, with any launcher, MASTER_ADDR and MASTER_PORT (torchrun sets them; mpirun and srun users export
// them). With none of them: a single process. A launcher's rank or size variable alone is an error, as is
// a malformed value (not an integer, negative, a rank not below its size, a port outside 1..65535): one
// line naming the variable and its value. `getenv` is the environment (tests pass their own).
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv = ::getenv);

// One line for logs: "rank 1 of 4 (local 1 of 2) from torchrun, rendezvous 10.0.0.1:29500".
std::string describe(const LaunchEnv& env);

}  // namespace sparrow
