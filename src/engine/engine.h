// The serving engine: EngineCore's step loop on its own thread, fed from any thread.
//
// submit() validates on the caller's thread (a bad request throws sparrow::Error there: the server
// answers 400) and queues; abort() and stats() may be called at any time. The loop takes what was
// queued, runs one step, publishes the statistics, and sleeps when there is nothing to do. Callbacks run
// on the engine thread, without any engine lock held: they may call submit / abort / stats, and should
// return quickly (hand the event to the connection's queue).
//
// Data parallelism (docs/parallel.md): every group's leader runs an Engine. Each step of any group is a step
// of all (runner/data_parallel.h: the loop steps while any group has work, on no tokens of its own when it
// has none); rank 0's Engine also hands requests to the other groups (serve_groups, engine/remote_groups.h),
// each to the group with the fewest unfinished sequences, and starts a wave of steps everywhere with each.
// A step that fails under data parallelism ends the process with its reason (the groups can no longer step
// together; the others then end too), as a dead tensor-parallel worker ends the run.
#pragma once
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/engine_core.h"
#include "engine/remote_groups.h"
#include "runner/data_parallel.h"

namespace sparrow {

class Engine {
 public:
  using Stats = EngineStats;

  // `tokenizer` may be null: no text in the events, no stop strings.
  Engine(std::unique_ptr<Model> model, std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config);
  ~Engine();  // shut_down()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues; throws sparrow::Error for a bad request or an id already in use.
  // `on_output` gets every event of the request, last one finished event per choice.
  void submit(Request request, std::function<void(const RequestOutput&)> on_output);
  // Ends the request wherever it is, with a final "abort" event per unfinished choice; unknown or
  // finished ids are ignored.
  void abort(const std::string& request_id);
  // Rank 0's engine and the remote groups', summed.
  Stats stats() const;
  // Runs `task` on the engine thread between two steps (work that must not meet a step on the device's one
  // stream: a LoRA adapter's upload, docs/lora.md) and returns once it has run; its exception is rethrown
  // here. After shut_down the task runs on the caller's thread.
  void run_between_steps(const std::function<void()>& task);
  // Aborts every request (each gets its "abort" event; a remote group's arrive before this returns) and stops
  // the loop; later submits are refused. Idempotent.
  void shut_down();

  // Data parallel, rank 0: the other groups' leaders, links[i] reaching group i + 1 (a host group of two,
  // this process its rank 0). Before the first submit; the links must outlive the engine.
  void serve_groups(std::vector<Communicator*> links);
  // Data parallel: a request went to some group; step with the others until every group is idle again.
  void start_wave(int64_t wave);
  // Called on the engine thread with the statistics after every step (a group's leader reports them to
  // rank 0); null: none.
  void on_stats(std::function<void(const Stats&)> hook);

  const CachePlan& cache_plan() const { return core_.cache().plan(); }
  int64_t max_model_len() const { return core_.max_model_len(); }
  const EngineConfig& config() const { return core_.config(); }
  const Model& model() const { return *model_; }

 private:
  void loop();
  void add(Request request, EngineCore::OutputCallback on_output);  // core_.add, failures reported as events
  // One step, data parallel: the core's step, or this group's part of the others' (ModelRunner::run_idle).
  void step_with_groups(int64_t wave);
  bool stepping_with_groups() const;  // under mutex_: the loop must meet the other groups again

  std::unique_ptr<Model> model_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  EngineCore core_;  // touched by the engine thread only (and by its const, immutable parts)

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  std::vector<std::pair<Request, EngineCore::OutputCallback>> submitted_;
  std::vector<std::string> aborted_;
  std::vector<std::function<void()>> tasks_;  // run_between_steps
  std::unordered_set<std::string> live_ids_;  // submitted and not yet finished
  Stats stats_;
  bool stopping_ = false;
  std::function<void(const Stats&)> on_stats_;
  // Data parallel (runner/data_parallel.h): the newest wave this group has seen, the last one every group
  // left together, whether the last exchange asked for another, and whether some group left for good.
  DataParallelSync* groups_ = nullptr;
  int64_t wave_ = 0, settled_wave_ = 0;
  bool unsettled_ = false, groups_stopped_ = false;
  // Rank 0: the other groups, and how many unfinished sequences each group holds (index 0: this one).
  std::unique_ptr<RemoteGroups> remote_;
  std::vector<int64_t> group_load_, group_requests_;
  std::unordered_map<std::string, int> group_of_;  // live request -> its group
  size_t next_group_ = 0;                         // where a tie between groups goes
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace sparrow
