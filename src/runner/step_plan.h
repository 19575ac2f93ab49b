// How rank 0 drives its tensor-parallel workers (docs/parallel.md). Rank 0 runs everything a single process
// runs (server, scheduler, cache bookkeeping, sampling); the other ranks only run steps. Before each step rank
// 0's runner broadcasts a StepPlan over the plan channel (a host communicator, rank 0 the root): the step's
// tokens, the image embeddings some of its rows take (rank 0 alone runs the vision tower) and, for each sequence, its positions and where its cache lives in rank 0's KvCache (block table,
// state slot, pending snapshot). Each worker keeps a twin of every cache rank 0 runs steps in, of as many
// block rows and slots, and runs the same step on its part of the model against its twin, so that its
// collectives meet rank 0's. A worker decides nothing: no allocation, no prefix matching, no sampling.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/communicator.h"
#include "model/lora.h"
#include "model/model.h"
#include "runner/model_runner.h"

namespace sparrow {

struct StepPlan {
  enum class Kind : uint8_t {
    Cache = 1,      // rank 0 runs steps in a new cache: `cache` of `config` (num_blocks set): make its twin
    DropCache = 2,  // rank 0's cache `cache` is gone
    Step = 3,       // run a step
    Stop = 4,       // the run is over: leave the worker loop
    Idle = 5,       // data parallel: this group has no tokens while others run theirs (Model::step_idle)
    Lora = 6,       // a sequence of the next step runs with a LoRA adapter the workers have not seen: load
                    // `lora` (its part for this rank, model/lora.h) under number `cache`
    DropLora = 7,   // the adapter numbered `cache` is gone on rank 0
  };
  struct LoraSource {
    std::string name, path, base_model;
    int64_t max_rank = 0;
  };
  struct Sequence {
    int32_t cache = 0;  // the cache it lives in
    int64_t start = 0, count = 0;  // positions start .. start + count - 1, rows in the step's order
    int64_t logits = 1;            // SeqSlice::logits
    std::vector<int32_t> blocks;   // rank 0's block table
    int32_t state_slot = -1, snapshot_slot = -1;
    int64_t snapshot_position = -1;
    int32_t lora = -1;  // the LoRA adapter it runs with (the number of its Lora plan); -1: none
  };
  struct StateOp {
    int32_t cache = 0;
    KvCache::StateOp op;
  };

  Kind kind = Kind::Step;
  int32_t cache = 0;   // Cache, DropCache; Lora, DropLora: the adapter's number
  CacheConfig config;  // Cache
  LoraSource lora;     // Lora
  // Step: state writes rank 0's caches made since the last step (KvCache::take_state_ops), the tokens, and
  // the sequences they belong to.
  std::vector<StateOp> state_ops;
  std::vector<int32_t> tokens;
  std::vector<Sequence> seqs;
  bool all_logits = false;
  // Step, Idle: every data-parallel group's token count (Batch::group_tokens); empty without data parallelism.
  std::vector<int64_t> group_tokens;
  // Step: the rows that take given embeddings instead of their token's (Batch::embedded_rows: an image's
  // placeholders; rank 0 runs the vision tower), and those embeddings, row-major [embedded_rows.size(), hidden].
  std::vector<int64_t> embedded_rows;
  std::vector<float> embedded;
};

// Bytes on the channel; decode_plan throws a one-line error for anything truncated or malformed.
std::vector<uint8_t> encode_plan(const StepPlan& plan);
StepPlan decode_plan(const std::vector<uint8_t>& bytes);

// Rank 0's end of the plan channel: one per process, shared by every runner there (caches are numbered once).
class WorkerChannel {
 public:
  // `channel` (rank 0 of a host group; the workers are its other ranks) must outlive this.
  explicit WorkerChannel(Communicator& channel);
  ~WorkerChannel();  // sends Stop
  WorkerChannel(const WorkerChannel&) = delete;
  WorkerChannel& operator=(const WorkerChannel&) = delete;

  // Broadcasts the plan of `batch` (its caches reserved for the step), after the twin of any cache the
  // workers have not seen yet. Every sequence's cache must be a KvCache view.
  void send_step(const Batch& batch);
  // Data parallel: the step this group sits out while others run (batch.group_tokens, no sequences).
  void send_idle(const Batch& batch);
  void send(const StepPlan& plan);

 private:
  int32_t cache_id(KvCache& cache);
  // The number the workers know `adapter` by, after its Lora plan if they have not seen it; before that, a
  // DropLora for each adapter rank 0 no longer holds.
  int32_t lora_id(const std::shared_ptr<const LoraAdapter>& adapter);
  Communicator& channel_;
  std::map<uint64_t, int32_t> caches_;  // KvCache::uid() -> the number the workers know it by
  int32_t next_cache_ = 0;
  std::map<int32_t, std::weak_ptr<const LoraAdapter>> loras_;  // the adapters the workers hold, by number
  int32_t next_lora_ = 0;
  std::shared_ptr<bool> alive_;  // caches' destroy hooks check it: the channel may go first
};

// A worker rank's loop: receives plans from rank 0 over `channel` and runs each step on `model` (this rank's
// part) until Stop. Throws when rank 0 goes away or a plan does not fit (the process then exits with it).
void run_worker(Model& model, Communicator& channel, RunnerOptions options = {});

}  // namespace sparrow
