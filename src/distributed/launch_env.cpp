#include "distributed/launch_env.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <string_view>

#include "core/error.h"

namespace sparrow {
namespace {

using Getenv = std::function<const char*(const char*)>;

// The variables one launcher sets; local_size is null where the launcher says it differently (srun).
struct Launcher {
  const char* name;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

constexpr Launcher kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
};

[[noreturn]] void bad_value(const char* name, std::string_view value, const std::string& problem) {
  fail("environment variable ", name, "='", value, "' ", problem);
}

// An integer of at least `least`: the first `length` characters of the value, all of them by default (no
// sign but '-', no spaces, no suffix).
int parse_int(const char* name, std::string_view value, int least, size_t length = std::string_view::npos) {
  const std::string_view number = value.substr(0, length);
  long long parsed = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), parsed);
  if (number.empty() || end != number.data() + number.size() || ec == std::errc::invalid_argument)
    bad_value(name, value, "is not an integer");
  if (ec == std::errc::result_out_of_range || parsed > INT_MAX) bad_value(name, value, "is out of range");
  if (parsed < 0) bad_value(name, value, "is negative");
  if (parsed < least) bad_value(name, value, cat("is below ", least));
  return int(parsed);
}

int read_int(const Getenv& getenv, const char* name, int least, int absent) {
  const char* value = getenv(name);
  return value ? parse_int(name, value, least) : absent;
}

// Slurm's tasks per node: "4", or run-length encoded over the nodes ("4(x2)", "2(x3),1"); the first node's
// count, which is every node's in the usual homogeneous job.
int slurm_tasks_per_node(const Getenv& getenv) {
  for (const char* name : {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})
    if (const char* value = getenv(name)) return parse_int(name, value, 1, std::string_view(value).find_first_of("(,"));
  return 1;
}

// `value` (named `name`) must be below `bound` (named `bound_name`).
void require_below(const char* name, int value, const char* bound_name, int bound) {
  if (value >= bound) fail("environment variable ", name, "='", value, "' is not below ", bound_name, "='", bound, "'");
}

}  // namespace

LaunchEnv read_launch_env(const Getenv& getenv) {
  LaunchEnv env;
  for (const Launcher& launcher : kLaunchers) {
    if (!getenv(launcher.rank) && !getenv(launcher.size)) continue;
    // Half a launcher's pair means a wrapper dropped a variable: guessing the other would make a rank
    // wait for peers that never come, or start alone.
    const char* missing = getenv(launcher.rank) ? launcher.size : launcher.rank;
    SPARROW_CHECK(getenv(missing), "environment variable ", missing, " is not set, but ",
                  missing == launcher.size ? launcher.rank : launcher.size, " is (launched by ", launcher.name, "?)");
    env.launcher = launcher.name;
    env.rank = read_int(getenv, launcher.rank, 0, 0);
    env.world_size = read_int(getenv, launcher.size, 1, 1);
    require_below(launcher.rank, env.rank, launcher.size, env.world_size);
    env.local_rank = read_int(getenv, launcher.local_rank, 0, 0);
    if (launcher.local_size) {
      env.local_world_size = read_int(getenv, launcher.local_size, 1, 1);
      require_below(launcher.local_rank, env.local_rank, launcher.local_size, env.local_world_size);
      SPARROW_CHECK(env.local_world_size <= env.world_size, "environment variable ", launcher.local_size, "='",
                    env.local_world_size, "' exceeds ", launcher.size, "='", env.world_size, "'");
    } else {
      // Slurm's count describes the allocation, which a step may use only part of, and a heterogeneous one
      // has other counts on other nodes: an estimate, kept consistent with what this rank knows for sure.
      require_below(launcher.local_rank, env.local_rank, launcher.size, env.world_size);
      env.local_world_size = std::clamp(slurm_tasks_per_node(getenv), env.local_rank + 1, env.world_size);
    }
    break;
  }
  if (const char* addr = getenv("MASTER_ADDR")) env.master_addr = addr;
  if (getenv("MASTER_PORT")) {
    env.master_port = read_int(getenv, "MASTER_PORT", 0, 0);
    if (env.master_port < 1 || env.master_port > 65535)
      bad_value("MASTER_PORT", getenv("MASTER_PORT"), "is not a port (1..65535)");
  }
  return env;
}

std::string describe(const LaunchEnv& env) {
  std::string text = env.launcher.empty() ? std::string("a single process")
                                          : cat("rank ", env.rank, " of ", env.world_size, " (local ", env.local_rank,
                                                " of ", env.local_world_size, ") from ", env.launcher);
  if (!env.master_addr.empty() || env.master_port != 0)
    text += cat(", rendezvous ", env.master_addr.empty() ? "?" : env.master_addr, ":",
                env.master_port == 0 ? std::string("?") : std::to_string(env.master_port));
  return text;
}

}  // namespace sparrow
