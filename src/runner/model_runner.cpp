#include "runner/model_runner.h"

#include <algorithm>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "runner/data_parallel.h"
#include "runner/dense_sequence_cache.h"
#include "runner/step_plan.h"
#include "runner/step_inputs.h"
#include "runner/step_profile.h"

namespace sparrow {

namespace {

// A standalone sequence in the runner's offline device cache: its cache is the KvCache view, and the
// sequence returns its blocks when dropped.
class OfflineSequence final : public SequenceCache {
 public:
  OfflineSequence(std::shared_ptr<KvCache> cache, SeqId id) : cache_(std::move(cache)), id_(id), view_(cache_->view(id)) {}
  ~OfflineSequence() override { cache_->free_sequence(id_); }

  void write(int layer, PageKind kind, int64_t pos, int64_t count, const float* rows) override {
    view_->write(layer, kind, pos, count, rows);
  }
  void read(int layer, PageKind kind, int64_t begin, int64_t end, float* rows) const override {
    view_->read(layer, kind, begin, end, rows);
  }
  float* state(int layer, StateKind kind) override { return view_->state(layer, kind); }
  int64_t snapshot_position(int64_t begin, int64_t end) override { return view_->snapshot_position(begin, end); }
  float* snapshot(int layer, StateKind kind) override { return view_->snapshot(layer, kind); }
  std::byte* state_slot() override { return view_->state_slot(); }
  std::byte* snapshot_slot() override { return view_->snapshot_slot(); }
  int32_t state_slot_index() const override { return view_->state_slot_index(); }
  int32_t snapshot_slot_index() const override { return view_->snapshot_slot_index(); }
  const PagedStorage* paged() const override { return view_->paged(); }
  const std::vector<int32_t>& block_table() const override { return view_->block_table(); }
  void reserve(int64_t tokens) override { view_->reserve(tokens); }

 private:
  std::shared_ptr<KvCache> cache_;
  SeqId id_;
  SequenceCache* view_;
};

}  // namespace

ModelRunner::ModelRunner(Model& model, RunnerOptions options) : model_(model), options_(options) {}
ModelRunner::~ModelRunner() = default;

Tensor ModelRunner::run(const Batch& batch) {
  SPARROW_CHECK(!batch.tokens.empty(), "empty batch");
  const int64_t vocab = model_.vocab_size();
  for (int32_t id : batch.tokens)  // checked here for both devices: the GPU embedding reads ids unchecked
    SPARROW_CHECK(id >= 0 && id < vocab, "token id ", id, " out of range [0, ", vocab, ")");
  for (const SeqSlice& s : batch.seqs) {
    SPARROW_CHECK(s.logits >= 1 && s.logits <= s.count, "a sequence of ", s.count, " rows in the batch asks for ",
                  s.logits, " rows of logits");
    s.cache().reserve(s.start() + s.count);
  }
  if (options_.data_parallel) {
    const std::vector<GroupStatus> statuses = options_.data_parallel->exchange(batch.size());
    SPARROW_CHECK(!any_stopped(statuses), "a data-parallel group left the run while this one had a step to run");
    batch.group_tokens = group_tokens(statuses);
  }
  if (options_.workers) options_.workers->send_step(batch);

  const Device device = model_.device();
  Tensor logits;
  if (profile_) profile_->start(device);
  if (device == Device::Cpu) {
    logits = model_.forward(batch, profile_);
  } else if (!options_.enforce_eager && !profile_ && model_.capturable() && DecodeGraphs::eligible(batch)) {
    logits = graphs_.run(batch, device, [&] { return model_.forward(batch, nullptr); });
  } else {
    attach_device_step(batch, device);  // the step's inputs, uploaded once for every layer
    if (profile_) profile_->mark("inputs");
    logits = model_.forward(batch, profile_);
  }
  if (profile_) profile_->end_step();
  for (const SeqSlice& s : batch.seqs) s.state->length += s.count;
  return logits;
}

IdleStep ModelRunner::run_idle() {
  SPARROW_CHECK(options_.data_parallel, "run_idle: not a data-parallel run");
  const std::vector<GroupStatus> statuses = options_.data_parallel->exchange(0);
  if (any_stopped(statuses)) return IdleStep::Stopped;
  Batch idle;
  idle.group_tokens = group_tokens(statuses);
  if (std::all_of(idle.group_tokens.begin(), idle.group_tokens.end(), [](int64_t n) { return n == 0; }))
    return groups_settled(statuses) ? IdleStep::Settled : IdleStep::Unsettled;
  if (options_.workers) options_.workers->send_idle(idle);
  model_.step_idle(idle);
  return IdleStep::Ran;
}

void ModelRunner::stop_groups() {
  SPARROW_CHECK(options_.data_parallel, "stop_groups: not a data-parallel run");
  options_.data_parallel->exchange(0, /*stop=*/true);
}

SequenceState ModelRunner::new_sequence() {
  if (model_.device() == Device::Cpu && !options_.workers) return standalone_sequence(model_.cache_spec());
  if (!offline_cache_) {
    CacheConfig config;
    config.device = model_.device();
    config.enable_prefix_caching = false;
    config.memory_fraction = 0.3;  // of the free GPU memory once the weights are in (of the RAM: reserved, not
                                   // touched until used)
    offline_cache_ = std::make_shared<KvCache>(model_.cache_spec(), config);
  }
  SequenceState s;
  s.owned_cache = std::make_unique<OfflineSequence>(offline_cache_, offline_cache_->create_sequence());
  s.cache = s.owned_cache.get();
  return s;
}

}  // namespace sparrow
