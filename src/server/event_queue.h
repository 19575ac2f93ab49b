// The bridge between the engine thread and an HTTP handler thread: the engine's output callback
// pushes events (it must never block long), the handler pops them, waiting with a timeout so it can
// notice a client that went away or a server that is shutting down.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

namespace sparrow::server {

template <typename Event>
class EventQueue {
 public:
  void push(Event event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back(std::move(event));
    }
    ready_.notify_one();
  }

  // The oldest event, or nothing if none arrived within `timeout`.
  std::optional<Event> pop(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    Event event = std::move(events_.front());
    events_.pop_front();
    return event;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Event> events_;
};

}  // namespace sparrow::server
