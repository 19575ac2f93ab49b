// CUDA graphs for decode steps: every sequence adds one token, or, in the verify steps of speculative
// decoding (docs/speculative.md), the same number q of tokens (its last accepted token and q - 1 drafts),
// with logits of its last row or of all q. A decode step of a large model is hundreds of small kernels;
// launched one by one from the host they cost more than they compute at small batches. A graph replays
// them with one launch.
//
// A graph fixes the batch's row count, rows a sequence, logit rows a sequence, whether the hidden states
// are kept (an MTP drafter reads them) or brought in (an MTP drafter's own steps: the graph copies them
// into its buffer before each replay), and the launch shape (page-table stride, longest causal bound,
// whether recurrent layers run rows after a rollback snapshot), so one graph serves a bucket of shapes:
// the shape is padded (at most 12.5% beyond what the batch needs, model/device_step.h says why padding is
// harmless) and the graph is keyed by all of these. Each step's inputs are uploaded into the graph's own buffer before replay. A shape is
// captured the second time it is seen (the first runs directly and warms every lazily made thing:
// cuBLASLt plans, RoPE tables), and the least recently used graph goes beyond `max_graphs`.
// When a capture fails the shape runs directly from then on (and the reason is printed once).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <tuple>

#include "core/tensor.h"
#include "runner/step_inputs.h"

namespace sparrow {

class DecodeGraphs {
 public:
  static constexpr int64_t kMaxRows = 512;  // vLLM's default largest captured batch

  explicit DecodeGraphs(int64_t max_graphs = 64);
  ~DecodeGraphs();

  // A step a graph may run: every sequence brings the same number of tokens and asks for logits of its
  // last row or of all of them (no prompt logits).
  static bool eligible(const Batch& batch);
  // The padded shape a graph uses for `least` (the batch's own shape, step_inputs.h).
  static StepShape padded(const StepShape& least, int64_t block_size);

  // Runs `compute` (the forward pass over batch.device_step, returning logits on the device) for an
  // eligible batch; returns logits the caller owns (and, with keep_hidden_states, leaves its own copy of
  // the hidden states in batch.hidden_states). A batch with hidden_states_in has them copied into the
  // graph's buffer, and hidden_states_in then points there.
  Tensor run(const Batch& batch, Device device, const std::function<Tensor()>& compute);

  int64_t captured() const { return int64_t(graphs_.size()); }
  int64_t replays() const { return replays_; }

 private:
  struct Graph;
  // rows, rows a sequence, logit rows a sequence, hidden states kept, hidden states brought in,
  // table_stride, max_visible, rows_after_snapshot
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, bool>;
  std::map<Key, std::unique_ptr<Graph>> graphs_;
  std::set<Key> seen_once_, uncapturable_;
  int64_t max_graphs_;
  int64_t clock_ = 0, replays_ = 0;
};

}  // namespace sparrow
