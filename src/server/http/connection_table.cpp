#include "server/http/connection_table.h"

namespace sparrow::server::http {

ConnectionTable::Admission ConnectionTable::admit(uint64_t id, Clock::time_point now, Shed shed) {
  std::lock_guard<std::mutex> lock(mutex_);
  Admission admission;
  if (entries_.size() >= capacity_) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.state == State::Answering) continue;
      if (victim == entries_.end() || it->second.state < victim->second.state ||
          (it->second.state == victim->second.state && it->second.since < victim->second.since))
        victim = it;
    }
    if (victim == entries_.end()) return admission;
    admission.shed = std::move(victim->second.shed);
    entries_.erase(victim);
  }
  entries_[id] = Entry{State::Reading, now, std::move(shed)};
  admission.admitted = true;
  return admission;
}

void ConnectionTable::readmit(uint64_t id, State state, Clock::time_point since, Shed shed) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_[id] = Entry{state, since, std::move(shed)};
}

void ConnectionTable::set_state(uint64_t id, State state, Clock::time_point since) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  it->second.state = state;
  it->second.since = since;
}

void ConnectionTable::remove(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.erase(id);
}

size_t ConnectionTable::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace sparrow::server::http
