// How data-parallel groups keep in step (docs/parallel.md, "Data parallelism"). Each group (its first rank,
// the group's leader, and that rank's tensor-parallel workers) runs its own steps, but a MoE layer's
// experts are shared by every group: its collectives (ops::all_gather_rows / reduce_scatter_rows) need
// every group in the same layer of a step at once. So the leaders meet before every step: each says how
// many tokens its step carries (0: none), and the step runs everywhere when any group has tokens, a group
// without them on no rows (ModelRunner::run_idle, Model::step_idle). The counts travel in the step: the
// MoE layers pad the gathers to the largest. This is vLLM's DP coordination (each engine core steps with
// a dummy batch while any DP rank has work: vllm/v1/engine/core.py DPEngineCoreProc).
//
// When every group is idle the leaders stop meeting. A server's engines start meeting again in "waves"
// (vLLM's name): whoever hands a group a request raises the wave number of every group (Engine::start_wave),
// and a leader takes part while it has work or a wave newer than the last one every group left together;
// all leave together only when an exchange shows no tokens and the same wave everywhere, so a group that has
// not yet seen the newest wave keeps the others in step until it has.
#pragma once
#include <cstdint>
#include <vector>

#include "core/communicator.h"

namespace sparrow {

struct GroupStatus {
  int64_t tokens = 0;  // this step's tokens (0: the group has nothing to run)
  int64_t wave = 0;    // the newest wave the group has seen
  int64_t stop = 0;    // 1: the group leaves for good (its command ended); the others stop stepping with it
};

class DataParallelSync {
 public:
  // `leaders`: a host group of the groups' leaders, group d being its rank d. Must outlive this.
  explicit DataParallelSync(Communicator& leaders);

  int group() const { return leaders_.rank(); }
  int groups() const { return leaders_.size(); }

  // Every group's status, this group's `tokens` among them (with the wave set_wave gave): a collective
  // of the leaders. Throws when a peer is gone.
  std::vector<GroupStatus> exchange(int64_t tokens, bool stop = false);
  void set_wave(int64_t wave) { wave_ = wave; }
  int64_t wave() const { return wave_; }
  // Exchanges so far: whether a step met the others (EngineCore::step may end before its forward pass).
  int64_t exchanges() const { return exchanges_; }
  // Some group left for good (an exchange said so): the groups do not meet again, and exchange throws.
  bool stopped() const { return stopped_; }

 private:
  Communicator& leaders_;
  int64_t wave_ = 0;
  int64_t exchanges_ = 0;
  bool stopped_ = false;
};

// Whether `statuses` ends the groups' steps together: no tokens anywhere and every group on the same wave
// (or a group leaving).
bool groups_settled(const std::vector<GroupStatus>& statuses);
bool any_stopped(const std::vector<GroupStatus>& statuses);
std::vector<int64_t> group_tokens(const std::vector<GroupStatus>& statuses);

}  // namespace sparrow
