// The launchers' environments (distributed/launch_env.h): each launcher's variables, which wins when
// several are set, and a one-line error naming the variable for every malformed value.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/error.h"
#include "distributed/launch_env.h"

using namespace sparrow;

namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv read(const Vars& vars) {
  return read_launch_env([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// The error reading `vars` gives; fails the test when there is none.
std::string error_of(const Vars& vars) {
  try {
    read(vars);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

}  // namespace

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  LaunchEnv env = read({});
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.launcher, "");
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.master_port, 0);
  EXPECT_EQ(describe(env), "a single process");
}

TEST(LaunchEnv, Torchrun) {
  LaunchEnv env = read({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                        {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(describe(env), "rank 5 of 8 (local 1 of 4) from torchrun, rendezvous 10.0.0.1:29500");
}

TEST(LaunchEnv, LeaderWorkerSetStyleWithoutLocalVariables) {
  // One pod per node: the pod spec maps its index to RANK and its group size to WORLD_SIZE.
  LaunchEnv env = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "leader.svc"}});
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.master_addr, "leader.svc");
  EXPECT_EQ(env.master_port, 0);
  EXPECT_EQ(describe(env), "rank 1 of 2 (local 0 of 1) from torchrun, rendezvous leader.svc:?");
}

TEST(LaunchEnv, OpenMpi) {
  LaunchEnv env = read({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(env.launcher, "mpirun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.master_port, 0);
  // mpirun users export the rendezvous themselves.
  env = read({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"},
              {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 1234);
}

TEST(LaunchEnv, Slurm) {
  LaunchEnv env = read({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                        {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"MASTER_PORT", "65535"}});
  EXPECT_EQ(env.launcher, "srun");
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_port, 65535);
  EXPECT_EQ(read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"}, {"SLURM_NTASKS_PER_NODE", "3"}}).local_world_size, 3);
  // SLURM_NTASKS_PER_NODE is there only with --ntasks-per-node; srun always sets SLURM_TASKS_PER_NODE.
  EXPECT_EQ(read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "7"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"}}).local_world_size,
            2);
  EXPECT_EQ(read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}).local_world_size, 1);
  // The count describes the allocation: a step of 2 tasks in an allocation of 4 per node, and the second
  // node of "1,2", hold 2 here.
  LaunchEnv step = read({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                         {"SLURM_NTASKS_PER_NODE", "4"}});
  EXPECT_EQ(step.local_world_size, 2);
  LaunchEnv second_node = read({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}, {"SLURM_LOCALID", "1"},
                                {"SLURM_TASKS_PER_NODE", "1,2"}});
  EXPECT_EQ(second_node.local_world_size, 2);
}

TEST(LaunchEnv, TorchrunBeforeMpiBeforeSlurm) {
  const Vars mpi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  const Vars slurm = {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}};
  Vars all = {{"RANK", "0"}, {"WORLD_SIZE", "4"}};
  all.insert(mpi.begin(), mpi.end());
  all.insert(slurm.begin(), slurm.end());
  EXPECT_EQ(read(all).launcher, "torchrun");
  EXPECT_EQ(read(all).world_size, 4);
  Vars mpi_and_slurm = mpi;
  mpi_and_slurm.insert(slurm.begin(), slurm.end());
  EXPECT_EQ(read(mpi_and_slurm).launcher, "mpirun");
  EXPECT_EQ(read(mpi_and_slurm).rank, 1);
  EXPECT_EQ(read(slurm).launcher, "srun");
  EXPECT_EQ(read(slurm).rank, 2);
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  const Vars torchrun = {{"RANK", "1"}, {"WORLD_SIZE", "4"}};
  auto with = [&](const std::string& name, const std::string& value) {
    Vars vars = torchrun;
    vars[name] = value;
    return error_of(vars);
  };
  EXPECT_EQ(with("RANK", "one"), "environment variable RANK='one' is not an integer");
  EXPECT_EQ(with("RANK", ""), "environment variable RANK='' is not an integer");
  EXPECT_EQ(with("RANK", "1 "), "environment variable RANK='1 ' is not an integer");
  EXPECT_EQ(with("RANK", "+1"), "environment variable RANK='+1' is not an integer");
  EXPECT_EQ(with("RANK", "1.0"), "environment variable RANK='1.0' is not an integer");
  EXPECT_EQ(with("RANK", "-1"), "environment variable RANK='-1' is negative");
  EXPECT_EQ(with("RANK", "4"), "environment variable RANK='4' is not below WORLD_SIZE='4'");
  EXPECT_EQ(with("RANK", "99999999999"), "environment variable RANK='99999999999' is out of range");
  EXPECT_EQ(with("WORLD_SIZE", "0"), "environment variable WORLD_SIZE='0' is below 1");
  EXPECT_EQ(with("WORLD_SIZE", "four"), "environment variable WORLD_SIZE='four' is not an integer");
  EXPECT_EQ(with("LOCAL_RANK", "-2"), "environment variable LOCAL_RANK='-2' is negative");
  EXPECT_EQ(with("LOCAL_RANK", "x"), "environment variable LOCAL_RANK='x' is not an integer");
  EXPECT_EQ(with("LOCAL_RANK", "1"), "environment variable LOCAL_RANK='1' is not below LOCAL_WORLD_SIZE='1'");
  EXPECT_EQ(with("LOCAL_WORLD_SIZE", "0"), "environment variable LOCAL_WORLD_SIZE='0' is below 1");
  EXPECT_EQ(with("LOCAL_WORLD_SIZE", "8"), "environment variable LOCAL_WORLD_SIZE='8' exceeds WORLD_SIZE='4'");
  EXPECT_EQ(with("MASTER_PORT", "0"), "environment variable MASTER_PORT='0' is not a port (1..65535)");
  EXPECT_EQ(with("MASTER_PORT", "65536"), "environment variable MASTER_PORT='65536' is not a port (1..65535)");
  EXPECT_EQ(with("MASTER_PORT", "-80"), "environment variable MASTER_PORT='-80' is negative");
  EXPECT_EQ(with("MASTER_PORT", "http"), "environment variable MASTER_PORT='http' is not an integer");
  // Without a launcher too: a malformed port is never ignored.
  EXPECT_EQ(error_of({{"MASTER_PORT", "abc"}}), "environment variable MASTER_PORT='abc' is not an integer");

  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
            "environment variable OMPI_COMM_WORLD_RANK='2' is not below OMPI_COMM_WORLD_SIZE='2'");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "z"}}),
            "environment variable OMPI_COMM_WORLD_LOCAL_SIZE='z' is not an integer");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "-3"}}),
            "environment variable SLURM_NTASKS='-3' is negative");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_NTASKS_PER_NODE", "(x2)"}}),
            "environment variable SLURM_NTASKS_PER_NODE='(x2)' is not an integer");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "4"}}),
            "environment variable SLURM_LOCALID='4' is not below SLURM_NTASKS='4'");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "-1"}}),
            "environment variable SLURM_LOCALID='-1' is negative");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "4"}}),
            "environment variable SLURM_PROCID='x' is not an integer");
}

TEST(LaunchEnv, HalfALauncherIsAnError) {
  EXPECT_EQ(error_of({{"RANK", "0"}}),
            "environment variable WORLD_SIZE is not set, but RANK is (launched by torchrun?)");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}}),
            "environment variable RANK is not set, but WORLD_SIZE is (launched by torchrun?)");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}}),
            "environment variable SLURM_NTASKS is not set, but SLURM_PROCID is (launched by srun?)");
}
