// The scheduler: which sequences run in the next step, and how many of their tokens.
//
// Policy (continuous batching with chunked prefill, as vLLM's v1 scheduler):
//   - a step runs at most max_num_batched_tokens tokens and holds at most max_num_seqs sequences;
//   - running sequences go first: decodes (one token each, and its speculative draft tokens, which are
//     cut short when the budget runs out), then unfinished prefills, oldest first, each taking as much of
//     the remaining budget as it needs (a prefill may get a chunk);
//   - then waiting sequences are admitted in arrival order while budget, sequence slots and blocks
//     last (a new sequence first reuses the longest cached prefix of its tokens); admission stops at
//     the first one that does not fit, so arrival order is kept; nothing is admitted in a step that
//     had to preempt;
//   - when a running sequence needs a block and none is free, the youngest running sequence not yet
//     scheduled in this step is preempted: its cache is freed and it goes back to the front of the
//     waiting queue, to be recomputed (prompt and generated tokens) when it is admitted again. A
//     sequence may have to preempt itself; the oldest running sequence always makes progress, since
//     any single sequence fits in the cache (max_model_len <= the cache's tokens).
#pragma once
#include <cstdint>
#include <deque>
#include <vector>

#include "cache/kv_cache.h"
#include "engine/sequence.h"

namespace sparrow {

struct SchedulerConfig {
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
};

// One sequence's share of a step: its tokens [num_computed, num_computed + num_tokens), the draft tokens
// (Sequence::draft) after its pending ones included.
struct ScheduledChunk {
  Sequence* seq;
  int64_t num_tokens;
};

class Scheduler {
 public:
  Scheduler(KvCache& cache, SchedulerConfig config);

  // Queues a new sequence (it must outlive its time in the scheduler).
  void add(Sequence* seq);
  // Takes a sequence out (finished or aborted) and frees its cache.
  void remove(Sequence* seq);
  // Prefill/decode disaggregation (engine/kv_handoff.h). A sequence whose cache the engine filled itself (its
  // rows fetched from a prefill instance) joins the running ones as it is; false (nothing changed) when
  // max_num_seqs are running.
  bool add_running(Sequence* seq);
  // The cache sequence an admission opens for `seq`: its prefix chain starts at its LoRA adapter's root, and its
  // images' placeholders are keyed by their content (admit_next; a decode instance's fetch, engine/kv_handoff.cpp).
  SeqId open_cache_sequence(const Sequence& seq);
  // Sequences the engine holds outside the scheduler that will join the running ones (fetches under way): they
  // count against max_num_seqs when waiting sequences are admitted.
  void set_reserved_seqs(int64_t n) { reserved_seqs_ = n; }

  // The next step; empty when there is nothing to run. Running sequences it returns have room in the
  // cache for their chunk.
  std::vector<ScheduledChunk> schedule();

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return int64_t(running_.size()); }
  int64_t num_waiting() const { return int64_t(waiting_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }

 private:
  // Makes room in the cache for `seq` to hold `total_tokens`, preempting as needed; false when `seq`
  // itself had to be preempted.
  bool reserve(Sequence* seq, int64_t total_tokens, const std::vector<ScheduledChunk>& scheduled);
  void preempt(Sequence* seq);
  // Admits the first waiting sequence with at most `budget` tokens; false when it does not fit.
  bool admit_next(int64_t budget, std::vector<ScheduledChunk>& scheduled);
  void release_cache(Sequence* seq);

  KvCache& cache_;
  SchedulerConfig config_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // in admission order: the youngest last
  int64_t num_preemptions_ = 0;
  int64_t reserved_seqs_ = 0;
};

}  // namespace sparrow
