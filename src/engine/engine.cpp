#include "engine/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <future>

#include "core/error.h"

namespace sparrow {

Engine::Engine(std::unique_ptr<Model> model, std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config)
    : model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      core_(*model_, tokenizer_.get(), std::move(config)),
      stats_(core_.stats()),
      groups_(core_.config().runner.data_parallel),
      thread_([this] { loop(); }) {}

Engine::~Engine() { shut_down(); }

void Engine::shut_down() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  remote_.reset();  // the other groups end what they hold; their last events arrive first
}

void Engine::run_between_steps(const std::function<void()>& task) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  auto run = [&] {  // the caller waits below, so the references stay valid until it has run
    try {
      task();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  };
  bool queued = false;
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      tasks_.push_back(run);
      queued = true;
    }
  }
  if (queued)
    wake_.notify_one();
  else
    run();
  finished.get();
}

void Engine::serve_groups(std::vector<Communicator*> links) {
  SPARROW_CHECK(groups_ && int(links.size()) + 1 == groups_->groups() && groups_->group() == 0,
                "serve_groups: rank 0 of a data-parallel run reaches every other group");
  std::lock_guard lock(mutex_);
  SPARROW_CHECK(!remote_ && live_ids_.empty(), "serve_groups: before the first request");
  group_load_.assign(links.size() + 1, 0);
  group_requests_.assign(links.size() + 1, 0);
  remote_ = std::make_unique<RemoteGroups>(std::move(links));
}

void Engine::start_wave(int64_t wave) {
  {
    std::lock_guard lock(mutex_);
    wave_ = std::max(wave_, wave);
  }
  wake_.notify_one();
}

void Engine::on_stats(std::function<void(const Stats&)> hook) {
  std::lock_guard lock(mutex_);
  on_stats_ = std::move(hook);
}

void Engine::submit(Request request, std::function<void(const RequestOutput&)> on_output) {
  core_.validate(request);  // reads only what never changes after construction
  const std::string id = request.id;
  // The last finished event of the request frees its id; a callback that throws is reported, not
  // allowed to take the engine thread (or a remote group's link) down.
  auto unfinished = std::make_shared<int64_t>(request.params.n);
  auto forward = [this, id, unfinished, on_output = std::move(on_output)](const RequestOutput& event) {
    try {
      on_output(event);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sparrow: output callback of request %s failed: %s\n", id.c_str(), e.what());
    }
    if (!event.finished) return;
    std::lock_guard lock(mutex_);
    if (auto group = group_of_.find(id); group != group_of_.end()) --group_load_[size_t(group->second)];
    if (--*unfinished == 0) {
      live_ids_.erase(id);
      group_of_.erase(id);
    }
  };
  int group = 0;
  int64_t wave = 0;
  {
    std::lock_guard lock(mutex_);
    SPARROW_CHECK(!stopping_, "the engine is shutting down");
    SPARROW_CHECK(live_ids_.insert(id).second, "request id '", id, "' is already in use");
    if (remote_) {
      // The group with the fewest unfinished sequences; ties go round.
      const size_t groups = group_load_.size();
      for (size_t i = 0; i < groups; ++i) {
        const size_t g = (next_group_ + i) % groups;
        if (group_load_[g] < group_load_[size_t(group)] || i == 0) group = int(g);
      }
      next_group_ = (size_t(group) + 1) % groups;
      group_load_[size_t(group)] += request.params.n;
      ++group_requests_[size_t(group)];
      group_of_[id] = group;
      wave = ++wave_;  // this engine's wave is the run's: it starts every one
    }
    if (group == 0) {
      stats_.waiting += request.params.n;
      submitted_.emplace_back(std::move(request), std::move(forward));
    }
  }
  if (group != 0) remote_->submit(group, request, std::move(forward));
  if (remote_) remote_->start_wave(wave);  // after the request, on the same links: it arrives first
  wake_.notify_one();
}

void Engine::abort(const std::string& request_id) {
  int group = 0;
  {
    std::lock_guard lock(mutex_);
    if (!live_ids_.count(request_id)) return;
    if (auto it = group_of_.find(request_id); it != group_of_.end()) group = it->second;
    if (group == 0) aborted_.push_back(request_id);
  }
  if (group != 0) remote_->abort(group, request_id);
  wake_.notify_one();
}

Engine::Stats Engine::stats() const {
  Stats stats;
  {
    std::lock_guard lock(mutex_);
    stats = stats_;
    stats.requests_by_group = group_requests_;
  }
  if (remote_) add_stats(stats, remote_->stats());
  return stats;
}

void Engine::add(Request request, EngineCore::OutputCallback on_output) {
  try {
    core_.add(request, on_output);
  } catch (const std::exception& e) {  // submit() validated it, so this is not the user's doing
    std::fprintf(stderr, "sparrow: request %s could not start: %s\n", request.id.c_str(), e.what());
    RequestOutput event;
    event.request_id = request.id;
    event.prompt_tokens = int64_t(request.prompt.size());
    event.finished = true;
    event.finish_reason = "error";
    for (event.index = 0; event.index < request.params.n; ++event.index) on_output(event);
  }
}

bool Engine::stepping_with_groups() const {
  return groups_ && !groups_stopped_ && (unsettled_ || wave_ > settled_wave_);
}

void Engine::step_with_groups(int64_t wave) {
  groups_->set_wave(wave);
  const int64_t met = groups_->exchanges();
  if (core_.has_work()) core_.step();
  if (groups_->exchanges() != met) {  // the step met the others (a step that scheduled nothing did not)
    std::lock_guard lock(mutex_);
    unsettled_ = true;
    groups_stopped_ = groups_->stopped();
    return;
  }
  const IdleStep idle = core_.step_idle();
  std::lock_guard lock(mutex_);
  unsettled_ = idle == IdleStep::Ran || idle == IdleStep::Unsettled;
  if (idle == IdleStep::Settled) settled_wave_ = std::max(settled_wave_, wave);
  if (idle == IdleStep::Stopped) groups_stopped_ = true;
}

void Engine::loop() {
  while (true) {
    std::vector<std::pair<Request, EngineCore::OutputCallback>> submitted;
    std::vector<std::string> aborted;
    std::vector<std::function<void()>> tasks;
    int64_t wave = 0;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] {
        return stopping_ || !submitted_.empty() || !aborted_.empty() || !tasks_.empty() || core_.has_work() ||
               stepping_with_groups();
      });
      if (stopping_) break;
      submitted.swap(submitted_);
      aborted.swap(aborted_);
      tasks.swap(tasks_);
      wave = wave_;  // read with the submissions: a request that came before its wave is in them
    }
    // Submissions first, so that an abort right after its submit finds the request.
    for (auto& [request, on_output] : submitted) add(std::move(request), std::move(on_output));
    for (const std::string& id : aborted) core_.abort(id);
    for (const auto& task : tasks) task();  // each catches its own exception (run_between_steps)
    try {
      if (groups_ && !groups_stopped_) {
        // Only with work or a wave not yet left together: a wake-up for a task (a runtime LoRA load) or an
        // abort alone must not meet the other groups, which may all have left the wave (their side of the
        // exchange would never come).
        bool meet = false;
        {
          std::lock_guard lock(mutex_);
          meet = stepping_with_groups();
        }
        if (meet || core_.has_work()) step_with_groups(wave);
      } else {
        core_.step();
      }
    } catch (const std::exception& e) {
      // Data parallel: the groups' steps cannot line up again, and the others would wait for this one's;
      // as a dead worker does, this ends the run (the other groups see it gone and end too).
      if (groups_) {
        std::fprintf(stderr, "error: data-parallel group %d: %s; stopping the run\n", groups_->group(), e.what());
        std::fflush(stderr);
        std::_Exit(1);
      }
      // A broken invariant, not a bad request: end everything cleanly rather than hang the clients.
      std::fprintf(stderr, "sparrow: engine step failed, aborting all requests: %s\n", e.what());
      core_.abort_all();
    }
    Stats stats = core_.stats();
    std::function<void(const Stats&)> hook;
    {
      std::lock_guard lock(mutex_);
      for (const auto& [request, on_output] : submitted_) stats.waiting += request.params.n;
      stats_ = stats;
      hook = on_stats_;
    }
    if (hook) hook(stats);
  }
  // Tasks queued before the stop still run: their callers are waiting.
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard lock(mutex_);
    tasks.swap(tasks_);
  }
  for (const auto& task : tasks) task();
  // Data parallel: the other groups may be waiting for this one's next step; they leave with it.
  bool meet = false;
  {
    std::lock_guard lock(mutex_);
    meet = stepping_with_groups();
    groups_stopped_ = true;
  }
  if (meet) {
    try {
      groups_->exchange(0, /*stop=*/true);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sparrow: the data-parallel groups could not be told to stop: %s\n", e.what());
    }
  }
  // Shutting down: everything still held, queued or running, ends with "abort".
  std::vector<std::pair<Request, EngineCore::OutputCallback>> submitted;
  {
    std::lock_guard lock(mutex_);
    submitted.swap(submitted_);
  }
  for (auto& [request, on_output] : submitted) add(std::move(request), std::move(on_output));
  core_.abort_all();
}

}  // namespace sparrow
