// One API request inside the engine: one engine request per prompt, each with n choices. The engine
// calls back on its own thread; the callbacks only push onto this generation's queue and wake its
// consumer (set_wake), which takes the events with next() on a worker thread. Choice indices are
// numbered across prompts as vLLM does: choice = prompt * n + (the engine's choice index).
//
// Destroying a Generation aborts whatever is still running (the client went away or the server is
// shutting down); the engine's late callbacks then land in a queue nobody reads, which they keep
// alive themselves.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/event_queue.h"
#include "server/metrics.h"

namespace sparrow::server {

using Clock = std::chrono::steady_clock;

class Generation {
 public:
  struct Event {
    RequestOutput output;
    int64_t prompt = 0;  // which prompt of the request
    int64_t choice = 0;  // the API choice index
  };

  // Submits every prompt; sparrow::Error from the engine (a bad request) propagates after the prompts
  // already submitted are aborted. `arrival` is when the HTTP request arrived (for the latency metrics);
  // `lora` the adapter every prompt runs with (null: the base model); `images` the first prompt's (a chat's);
  // `kv_transfer` its part in a prefill/decode pair (one prompt only).
  Generation(Engine& engine, ServerMetrics& metrics, const std::string& id,
             const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params, Clock::time_point arrival,
             std::shared_ptr<const LoraAdapter> lora = nullptr, std::vector<vision::ImageInput> images = {},
             KvTransferRequest kv_transfer = {});
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // The next event, or nothing if none is waiting (or everything has finished).
  std::optional<Event> next();
  // `wake` runs on the engine's thread whenever an event arrives (at once if some are waiting).
  void set_wake(std::function<void()> wake) { queue_->set_wake(std::move(wake)); }
  bool finished() const { return finished_choices_ == int64_t(choices_.size()); }
  int64_t num_choices() const { return int64_t(choices_.size()); }
  int64_t num_prompts() const { return int64_t(engine_ids_.size()); }
  // Asks the engine to stop every unfinished choice; their final events (finish_reason "abort") follow.
  void abort();

 private:
  struct ChoiceTiming {
    std::optional<Clock::time_point> first_token, last_token, first_scheduled;
    int64_t prompt_tokens = 0, tokens = 0;
    bool finished = false;
  };
  void record(const Event& event);

  Engine& engine_;
  ServerMetrics& metrics_;
  Clock::time_point arrival_;
  std::vector<std::string> engine_ids_;  // one per prompt
  std::vector<bool> submitted_;
  std::vector<ChoiceTiming> choices_;
  int64_t finished_choices_ = 0;
  std::shared_ptr<EventQueue<Event>> queue_ = std::make_shared<EventQueue<Event>>();
};

}  // namespace sparrow::server
