#include "engine/draft_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "core/error.h"
#include "engine/sequence.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "runner/model_runner.h"

namespace sparrow {

namespace {

// Each target sequence has a draft sequence whose cache holds rows for `seen[0 .. state.length)`. A step
// first sets the length back to where `seen` and the target's tokens still agree (the drafts the target
// rejected drop out; rows are overwritten in place), runs the tokens it has not seen (in one batch over
// all sequences), then decodes k - 1 more tokens one at a time. Drafts are the draft model's argmax.
class DraftModelProposer final : public DraftProposer {
 public:
  DraftModelProposer(Model& draft, bool probabilistic, bool enforce_eager)
      : runner_(draft, RunnerOptions{.enforce_eager = enforce_eager}), probabilistic_(probabilistic) {
    for (const LayerCacheSpec& layer : draft.cache_spec())
      SPARROW_CHECK(layer.states.empty(), "speculative decoding: the draft model (", draft.model_type(),
                    ") has recurrent layers, whose state cannot be set back to the tokens the target accepts; use a "
                    "draft model of attention layers only");
  }

  void propose(std::span<Sequence* const> seqs, std::span<const int64_t> max_tokens) override {
    std::vector<Drafting> active;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i]->truncate_draft(0);
      if (max_tokens[i] <= 0) continue;
      auto [it, fresh] = drafts_.try_emplace(seqs[i]);
      if (fresh) it->second.state = runner_.new_sequence();
      DraftSequence& d = it->second;
      const std::vector<int32_t>& tokens = seqs[i]->tokens;
      // Where the draft's rows stop matching the target's tokens.
      int64_t agree = std::min<int64_t>(d.state.length, int64_t(tokens.size()) - 1);
      for (int64_t p = d.checked; p < agree; ++p)
        if (d.seen[size_t(p)] != tokens[size_t(p)]) {
          agree = p;
          break;
        }
      d.state.length = agree;
      d.seen.assign(tokens.begin(), tokens.end());
      d.checked = int64_t(tokens.size());
      active.push_back({seqs[i], &d, max_tokens[i]});
    }
    if (active.empty()) return;

    // The unseen tokens of every sequence in one batch, then one token each until each has its drafts.
    std::vector<Drafting*> running;
    std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
    for (Drafting& a : active) {
      running.push_back(&a);
      parts.push_back({&a.d->state, std::vector<int32_t>(a.d->seen.begin() + a.d->state.length, a.d->seen.end())});
    }
    while (!running.empty()) {
      Batch batch = make_batch(parts);
      batch.all_logits = false;
      const Tensor logits = runner_.run(batch);
      std::vector<TokenDraw> greedy(running.size());
      for (TokenDraw& draw : greedy) draw.temperature = 0;
      std::vector<int32_t> next = ops::sample_tokens(logits, greedy, {});
      if (probabilistic_) draw_from_distributions(logits, running, next);
      std::vector<Drafting*> still;
      parts.clear();
      for (size_t i = 0; i < running.size(); ++i) {
        Drafting& a = *running[i];
        a.seq->draft.push_back(next[i]);
        if (int64_t(a.seq->draft.size()) == a.wanted) continue;
        a.d->seen.push_back(next[i]);
        still.push_back(&a);
        parts.push_back({&a.d->state, {next[i]}});
      }
      running = std::move(still);
    }
  }

  void forget(const Sequence& seq) override { drafts_.erase(&seq); }

 private:
  struct Drafting;
  // The sequences that sample draw their next draft from their distribution (draw_draft_token).
  void draw_from_distributions(const Tensor& logits, const std::vector<Drafting*>& running, std::vector<int32_t>& next) {
    Tensor host;
    for (size_t i = 0; i < running.size(); ++i) {
      Sequence& seq = *running[i]->seq;
      if (seq.params().temperature < kGreedyTemperature) continue;
      if (!host.defined()) host = logits.to(Device::Cpu);
      next[i] = draw_draft_token(seq, {host.row(int64_t(i)), size_t(host.dim(1))});
    }
  }

  struct DraftSequence {
    SequenceState state;
    std::vector<int32_t> seen;  // the tokens its rows were computed from (its first state.length)
    int64_t checked = 0;        // seen[0 .. checked) equals the target's tokens (they never change)
  };
  struct Drafting {
    Sequence* seq;
    DraftSequence* d;
    int64_t wanted;
  };
  ModelRunner runner_;
  bool probabilistic_;
  std::unordered_map<const Sequence*, DraftSequence> drafts_;
};

}  // namespace

std::unique_ptr<DraftProposer> make_draft_model_proposer(Model& draft, bool probabilistic, bool enforce_eager) {
  return std::make_unique<DraftModelProposer>(draft, probabilistic, enforce_eager);
}

}  // namespace sparrow
