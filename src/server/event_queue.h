// The bridge between the engine thread and the server: the engine's output callback pushes events (it
// must never block long) and wakes the consumer, which pops what has arrived on its own thread. Nothing
// waits: the wake-up is what makes a completion's next chunks (server.cpp, Server::Completion).
#pragma once
#include <deque>
#include <functional>
#include <mutex>
#include <optional>

namespace sparrow::server {

template <typename Event>
class EventQueue {
 public:
  void push(Event event) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back(std::move(event));
      wake = wake_;
    }
    if (wake) wake();
  }

  // The oldest event, or nothing when none is waiting.
  std::optional<Event> pop() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (events_.empty()) return std::nullopt;
    Event event = std::move(events_.front());
    events_.pop_front();
    return event;
  }

  // `wake` runs after every push, on the pushing thread, and at once if events are already waiting;
  // it must be quick (it runs on the engine's thread).
  void set_wake(std::function<void()> wake) {
    bool waiting = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_ = wake;
      waiting = !events_.empty();
    }
    if (waiting && wake) wake();
  }

 private:
  std::mutex mutex_;
  std::deque<Event> events_;
  std::function<void()> wake_;
};

}  // namespace sparrow::server
