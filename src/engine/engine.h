// The serving engine: EngineCore's step loop on its own thread, fed from any thread.
//
// submit() validates on the caller's thread (a bad request throws sparrow::Error there: the server
// answers 400) and queues; abort() and stats() may be called at any time. The loop takes what was
// queued, runs one step, publishes the statistics, and sleeps when there is nothing to do. Callbacks run
// on the engine thread, without any engine lock held: they may call submit / abort / stats, and should
// return quickly (hand the event to the connection's queue).
#pragma once
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/engine_core.h"

namespace sparrow {

class Engine {
 public:
  using Stats = EngineStats;

  // `tokenizer` may be null: no text in the events, no stop strings.
  Engine(std::unique_ptr<Model> model, std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config);
  ~Engine();  // aborts every request (each gets its "abort" event) and stops the loop
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues; throws sparrow::Error for a bad request or an id already in use.
  // `on_output` gets every event of the request, last one finished event per choice.
  void submit(Request request, std::function<void(const RequestOutput&)> on_output);
  // Ends the request wherever it is, with a final "abort" event per unfinished choice; unknown or
  // finished ids are ignored.
  void abort(const std::string& request_id);
  Stats stats() const;

  const CachePlan& cache_plan() const { return core_.cache().plan(); }
  int64_t max_model_len() const { return core_.max_model_len(); }
  const EngineConfig& config() const { return core_.config(); }
  const Model& model() const { return *model_; }

 private:
  void loop();
  void add(Request request, EngineCore::OutputCallback on_output);  // core_.add, failures reported as events

  std::unique_ptr<Model> model_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  EngineCore core_;  // touched by the engine thread only (and by its const, immutable parts)

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  std::vector<std::pair<Request, EngineCore::OutputCallback>> submitted_;
  std::vector<std::string> aborted_;
  std::unordered_set<std::string> live_ids_;  // submitted and not yet finished
  Stats stats_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace sparrow
