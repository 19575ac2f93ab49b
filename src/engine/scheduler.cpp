#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "model/lora.h"

namespace sparrow {

Scheduler::Scheduler(KvCache& cache, SchedulerConfig config) : cache_(cache), config_(config) {
  SPARROW_CHECK(config.max_num_seqs >= 1, "max_num_seqs must be at least 1, got ", config.max_num_seqs);
  SPARROW_CHECK(config.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1, got ",
                config.max_num_batched_tokens);
}

void Scheduler::add(Sequence* seq) {
  seq->status = SequenceStatus::Waiting;
  waiting_.push_back(seq);
}

void Scheduler::remove(Sequence* seq) {
  std::erase(waiting_, seq);
  std::erase(running_, seq);
  release_cache(seq);
  seq->status = SequenceStatus::Finished;
}

SeqId Scheduler::open_cache_sequence(const Sequence& seq) {
  std::vector<HashedSpan> images;  // keyed by their content, so other images' placeholders never match
  for (const vision::ImageInput& image : seq.request.images) images.push_back({image.offset, image.tokens, image.hash});
  return cache_.create_sequence(seq.state.lora ? seq.state.lora->prefix_root : kRootBlockHash, std::move(images));
}

bool Scheduler::add_running(Sequence* seq) {
  if (num_running() >= config_.max_num_seqs) return false;
  seq->status = SequenceStatus::Running;
  seq->admitted_before = true;
  running_.push_back(seq);
  return true;
}

void Scheduler::release_cache(Sequence* seq) {
  if (seq->cache_id >= 0) cache_.free_sequence(seq->cache_id);
  seq->cache_id = -1;
  seq->state.length = 0;
  seq->state.cache = nullptr;
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> scheduled;
  int64_t budget = config_.max_num_batched_tokens;
  const int64_t preemptions_before = num_preemptions_;

  // Running sequences: decodes first, then unfinished prefills, each group oldest first.
  std::vector<Sequence*> order = running_;
  std::stable_partition(order.begin(), order.end(), [](const Sequence* s) { return s->num_pending() == 1; });
  for (Sequence* seq : order) {
    if (budget == 0) break;
    if (seq->status != SequenceStatus::Running) continue;  // preempted earlier in this step
    const int64_t wanted = seq->num_pending() + int64_t(seq->draft.size());
    const int64_t n = std::min(wanted, budget);
    seq->truncate_draft(size_t(std::clamp<int64_t>(n - seq->num_pending(), 0, int64_t(seq->draft.size()))));
    if (!reserve(seq, seq->num_computed() + n, scheduled)) continue;
    scheduled.push_back({seq, n});
    budget -= n;
  }

  // Waiting sequences, in order, while they fit (vLLM admits none in a step that preempted).
  if (num_preemptions_ == preemptions_before)
    while (budget > 0 && admit_next(budget, scheduled)) budget -= scheduled.back().num_tokens;
  return scheduled;
}

bool Scheduler::reserve(Sequence* seq, int64_t total_tokens, const std::vector<ScheduledChunk>& scheduled) {
  auto is_scheduled = [&](const Sequence* s) {
    return std::any_of(scheduled.begin(), scheduled.end(), [&](const ScheduledChunk& c) { return c.seq == s; });
  };
  while (!cache_.allocate(seq->cache_id, total_tokens)) {
    // The youngest running sequence this step has not scheduled; `seq` itself at the latest.
    auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](const Sequence* s) { return !is_scheduled(s); });
    Sequence* preempted = *victim;
    preempt(preempted);
    if (preempted == seq) return false;
  }
  return true;
}

void Scheduler::preempt(Sequence* seq) {
  std::erase(running_, seq);
  release_cache(seq);
  seq->truncate_draft(0);
  seq->status = SequenceStatus::Waiting;
  waiting_.push_front(seq);
  ++num_preemptions_;
}

bool Scheduler::admit_next(int64_t budget, std::vector<ScheduledChunk>& scheduled) {
  if (waiting_.empty() || num_running() + reserved_seqs_ >= config_.max_num_seqs || cache_.num_free_state_slots() == 0 ||
      cache_.num_free_blocks() == 0)
    return false;
  Sequence* seq = waiting_.front();
  seq->cache_id = open_cache_sequence(*seq);
  // Prompt logprobs need the logits at every prompt position, so such a prefill reuses nothing (as vLLM).
  const int64_t reused = seq->wants_prompt_logprobs ? 0 : cache_.match_prefix(seq->cache_id, seq->tokens);
  const int64_t n = std::min(int64_t(seq->tokens.size()) - reused, budget);
  if (!cache_.allocate(seq->cache_id, reused + n)) {
    release_cache(seq);
    return false;
  }
  waiting_.pop_front();
  seq->status = SequenceStatus::Running;
  seq->state.length = reused;
  seq->state.cache = cache_.view(seq->cache_id);
  if (!seq->admitted_before) seq->cached_tokens = reused;
  seq->admitted_before = true;
  running_.push_back(seq);
  scheduled.push_back({seq, n});
  return true;
}

}  // namespace sparrow
