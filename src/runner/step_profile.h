// Where a forward step's time goes, part by part (`sparrow bench forward --profile`, docs/bench.md). The
// runner marks the step's inputs and hands the profile to Model::forward as its StepMarks; the decoder
// marks the end of each part of a step: the step's inputs, the embedding, each layer's mixer and
// feed-forward (each with its norm and residual add), the final norm with the last rows' selection, the
// lm_head. end_step() reads the marks (on a GPU it waits for the step: the marks are events on the
// engine's stream, so a part's time is the device's, launch gaps included) and adds each part's time to
// its kind's total: "mixer gqa+msa" sums every such layer. A profiled step runs eagerly: a CUDA graph has
// no marks inside.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "model/model.h"

namespace sparrow {

class StepProfile final : public StepMarks {
 public:
  struct Part {
    std::string name;
    double seconds = 0;  // over all profiled steps
    int64_t count = 0;   // marks over all profiled steps (layers x steps for a layer's part)
  };

  void start(Device device);             // a step begins
  void mark(const std::string& part) override;  // the time since the previous mark (or the start) is `part`'s
  void end_step();                       // reads the step's marks into the totals
  const std::vector<Part>& parts() const { return parts_; }  // in the order first seen
  int64_t steps() const { return steps_; }
  double seconds() const;                // all parts of all steps
  bool active() const { return active_; }

 private:
  Device device_ = Device::Cpu;
  bool active_ = false;
  ops::TimeMark begin_;
  std::vector<std::pair<std::string, ops::TimeMark>> marks_;  // this step's, in order
  std::vector<Part> parts_;
  int64_t steps_ = 0;
};

}  // namespace sparrow
