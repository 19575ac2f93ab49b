// The open connections and what each is doing, for the cap on open connections
// (--http-max-connections). A connection that arrives at the cap takes the place of the one that
// serves nobody the longest: first a connection being closed (lingering after its last answer), then
// an idle keep-alive connection (longest idle first), then a connection still sending its request
// (oldest request first). A connection whose request is being answered is never shed; when every
// connection is answering, the newcomer is refused (the server answers 503 and closes it).
//
// Thread-safe. Kept free of sockets so the policy can be tested alone.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

namespace sparrow::server::http {

class ConnectionTable {
 public:
  using Clock = std::chrono::steady_clock;
  // In the order connections are shed.
  enum class State { Lingering, Idle, Reading, Answering };
  // Closes a shed connection. Run by the caller of admit(), outside the table's lock.
  using Shed = std::function<void()>;

  explicit ConnectionTable(size_t capacity) : capacity_(capacity) {}

  struct Admission {
    bool admitted = false;
    Shed shed;  // the connection that made room, to be closed; empty when there was room
  };
  // A new connection, reading its first request since `now`. At the cap another connection leaves the
  // table to make room (its Shed is returned); when none can, the newcomer is not admitted.
  Admission admit(uint64_t id, Clock::time_point now, Shed shed);
  // Puts a connection back without looking at the cap: one that was picked for shedding but had started
  // answering a request before it could be closed.
  void readmit(uint64_t id, State state, Clock::time_point since, Shed shed);
  // Ignored for a connection that is not in the table (already shed or removed).
  void set_state(uint64_t id, State state, Clock::time_point since);
  void remove(uint64_t id);
  size_t size() const;

 private:
  struct Entry {
    State state;
    Clock::time_point since;  // when the state began: idle since, request started, lingering since
    Shed shed;
  };

  mutable std::mutex mutex_;
  const size_t capacity_;
  std::unordered_map<uint64_t, Entry> entries_;
};

}  // namespace sparrow::server::http
