#include "engine/engine.h"

#include <cstdio>

#include "core/error.h"

namespace sparrow {

Engine::Engine(std::unique_ptr<Model> model, std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config)
    : model_(std::move(model)),
      tokenizer_(std::move(tokenizer)),
      core_(*model_, tokenizer_.get(), std::move(config)),
      stats_(core_.stats()),
      thread_([this] { loop(); }) {}

Engine::~Engine() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Engine::submit(Request request, std::function<void(const RequestOutput&)> on_output) {
  core_.validate(request);  // reads only what never changes after construction
  const std::string id = request.id;
  // The last finished event of the request frees its id; a callback that throws is reported, not
  // allowed to take the engine thread down.
  auto unfinished = std::make_shared<int64_t>(request.params.n);
  auto forward = [this, id, unfinished, on_output = std::move(on_output)](const RequestOutput& event) {
    try {
      on_output(event);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sparrow: output callback of request %s failed: %s\n", id.c_str(), e.what());
    }
    if (event.finished && --*unfinished == 0) {
      std::lock_guard lock(mutex_);
      live_ids_.erase(id);
    }
  };
  {
    std::lock_guard lock(mutex_);
    SPARROW_CHECK(!stopping_, "the engine is shutting down");
    SPARROW_CHECK(live_ids_.insert(id).second, "request id '", id, "' is already in use");
    stats_.waiting += request.params.n;
    submitted_.emplace_back(std::move(request), std::move(forward));
  }
  wake_.notify_one();
}

void Engine::abort(const std::string& request_id) {
  {
    std::lock_guard lock(mutex_);
    if (!live_ids_.count(request_id)) return;
    aborted_.push_back(request_id);
  }
  wake_.notify_one();
}

Engine::Stats Engine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
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

void Engine::loop() {
  while (true) {
    std::vector<std::pair<Request, EngineCore::OutputCallback>> submitted;
    std::vector<std::string> aborted;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !submitted_.empty() || !aborted_.empty() || core_.has_work(); });
      if (stopping_) break;
      submitted.swap(submitted_);
      aborted.swap(aborted_);
    }
    // Submissions first, so that an abort right after its submit finds the request.
    for (auto& [request, on_output] : submitted) add(std::move(request), std::move(on_output));
    for (const std::string& id : aborted) core_.abort(id);
    try {
      core_.step();
    } catch (const std::exception& e) {
      // A broken invariant, not a bad request: end everything cleanly rather than hang the clients.
      std::fprintf(stderr, "sparrow: engine step failed, aborting all requests: %s\n", e.what());
      core_.abort_all();
    }
    Stats stats = core_.stats();
    std::lock_guard lock(mutex_);
    for (const auto& [request, on_output] : submitted_) stats.waiting += request.params.n;
    stats_ = stats;
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
