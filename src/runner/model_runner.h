// The model runner: runs one step of a model on its device. It checks the batch, makes room in the
// sequences' caches, uploads the step's inputs (step_inputs.h), replays a decode graph
// (decode_graphs.h) or runs the forward pass eagerly, times it part by part when a profile is set
// (step_profile.h), and advances each sequence past its new tokens. Model::forward underneath is the
// math alone.
//
// It is the unit a rank owns: the engine drives one runner, and a tensor-parallel worker will be a
// runner in another process, fed the same batches (issue 23). Offline users (generate, score,
// perplexity, the tests) use one directly; new_sequence() gives them a sequence with a cache of its own.
#pragma once
#include <cstdint>
#include <memory>

#include "core/tensor.h"
#include "model/model.h"
#include "runner/decode_graphs.h"

namespace sparrow {

class KvCache;
class StepProfile;

class WorkerChannel;
class DataParallelSync;

struct RunnerOptions {
  // vLLM's --enforce-eager: no CUDA graphs (decode steps launch their kernels one by one).
  bool enforce_eager = false;
  // Tensor parallel, on rank 0: each step's plan goes to the workers before it runs (runner/step_plan.h),
  // and offline sequences live in a paged cache the workers can mirror. Must outlive the runner.
  WorkerChannel* workers = nullptr;
  // Data parallel, on a group's leader: every step (and every step this group sits out: run_idle) meets the
  // other groups' leaders first (runner/data_parallel.h). Must outlive the runner.
  DataParallelSync* data_parallel = nullptr;
};

// What run_idle found: every group idle (or one waiting on a newer wave), a step run without tokens of this
// group, or a group that left for good.
enum class IdleStep { Settled, Unsettled, Ran, Stopped };

class ModelRunner {
 public:
  // `model` must outlive the runner.
  explicit ModelRunner(Model& model, RunnerOptions options = {});
  ~ModelRunner();
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // Runs the batch and advances each state's length. Returns fp32 logits on the model's device:
  // [batch.logit_rows(), vocab] (Model::forward). Throws sparrow::Error for an empty batch or a token id outside the vocabulary.
  Tensor run(const Batch& batch);
  // Data parallel: this group has no tokens this step. Meets the other groups' leaders and, when any has
  // tokens, runs the step's shared parts on no rows (Model::step_idle) with this group's workers.
  IdleStep run_idle();
  // Data parallel, a command's end on the group that ran it: the other groups leave their idle loops.
  void stop_groups();

  // A fresh sequence for offline use: on the CPU with its own growable cache, on a GPU (or with workers) in a
  // paged cache on the model's device that the runner keeps for such sequences (its blocks go back when the
  // state goes).
  SequenceState new_sequence();

  Model& model() const { return model_; }
  Device device() const { return model_.device(); }
  const RunnerOptions& options() const { return options_; }
  void set_enforce_eager(bool eager) { options_.enforce_eager = eager; }
  // When set, each step is timed part by part into it, eagerly (a CUDA graph has no marks inside).
  void set_step_profile(StepProfile* profile) { profile_ = profile; }
  // Decode steps run by replaying a CUDA graph so far.
  int64_t graph_replays() const { return graphs_.replays(); }

 private:
  Model& model_;
  RunnerOptions options_;
  StepProfile* profile_ = nullptr;
  DecodeGraphs graphs_;
  std::shared_ptr<KvCache> offline_cache_;  // GPU models: the pages of new_sequence()'s sequences
};

}  // namespace sparrow
