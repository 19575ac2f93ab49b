#include "runner/step_profile.h"

#include <algorithm>

#include "core/error.h"

namespace sparrow {

void StepProfile::start(Device device) {
  SPARROW_CHECK(!active_, "StepProfile: a step started inside another");
  device_ = device;
  active_ = true;
  marks_.clear();
  begin_ = ops::TimeMark::now(device);
}

void StepProfile::mark(const std::string& part) {
  SPARROW_CHECK(active_, "StepProfile: a mark outside a step");
  marks_.emplace_back(part, ops::TimeMark::now(device_));
}

void StepProfile::end_step() {
  SPARROW_CHECK(active_, "StepProfile: end_step without a step");
  active_ = false;
  const ops::TimeMark* previous = &begin_;
  for (const auto& [name, at] : marks_) {
    // An init-capture: clang before 16 cannot capture a structured binding (the sanitizer build uses clang).
    auto it = std::find_if(parts_.begin(), parts_.end(), [&name = name](const Part& p) { return p.name == name; });
    if (it == parts_.end()) it = parts_.insert(parts_.end(), Part{name});
    it->seconds += seconds_between(*previous, at);
    ++it->count;
    previous = &at;
  }
  marks_.clear();
  ++steps_;
}

double StepProfile::seconds() const {
  double total = 0;
  for (const Part& p : parts_) total += p.seconds;
  return total;
}

}  // namespace sparrow
