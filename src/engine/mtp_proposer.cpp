#include "engine/mtp_proposer.h"

#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "engine/sequence.h"
#include "kernels/ops.h"
#include "model/mtp.h"
#include "runner/model_runner.h"

namespace sparrow {

namespace {

class MtpProposer final : public DraftProposer {
 public:
  MtpProposer(MtpDrafter& drafter, bool enforce_eager) : runner_(drafter, RunnerOptions{.enforce_eager = enforce_eager}) {}

  bool reads_hidden_states() const override { return true; }
  int64_t rows_ahead(int64_t k) const override { return k - 1; }

  void observe(const Batch& batch, std::span<Sequence* const> seqs, std::span<const int64_t> rows_kept) override {
    next_.clear();
    SPARROW_CHECK(batch.hidden_states.defined(), "mtp: the target's step kept no hidden states");
    std::vector<SequenceState> states(seqs.size());
    std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
    std::vector<int64_t> rows;
    std::vector<Sequence*> taken;
    for (size_t j = 0; j < seqs.size(); ++j) {
      Sequence* seq = seqs[j];
      if (!seq) continue;
      const SeqSlice& slice = batch.seqs[j];
      // The step's positions the target kept whose next token is known: (t_{p+1}, h_p).
      const int64_t start = batch.positions[size_t(slice.offset)];
      const int64_t end = std::min(rows_kept[j], int64_t(seq->tokens.size()) - 1);
      if (end <= start) continue;
      states[j].length = start;
      states[j].cache = seq->state.cache;
      parts.push_back({&states[j], std::vector<int32_t>(seq->tokens.begin() + start + 1, seq->tokens.begin() + end + 1)});
      for (int64_t p = start; p < end; ++p) rows.push_back(slice.offset + (p - start));
      taken.push_back(seq);
    }
    if (parts.empty()) return;
    Batch mtp = make_batch(parts);
    mtp.all_logits = false;
    mtp.keep_hidden_states = true;  // the layer's output states feed the next round
    mtp.hidden_states_in = ops::select_rows(batch.hidden_states, rows);
    const Tensor logits = runner_.run(mtp);
    const std::vector<int32_t> drafts = greedy(logits);
    std::vector<int64_t> last_rows;
    for (const SeqSlice& s : mtp.seqs) last_rows.push_back(s.offset + s.count - 1);
    states_ = ops::select_rows(mtp.hidden_states, last_rows);
    for (size_t i = 0; i < taken.size(); ++i) {
      // A sequence drafts when its last pair used its newest token (not mid-prefill).
      const SeqSlice& s = mtp.seqs[i];
      if (s.state->length == int64_t(taken[i]->tokens.size()) - 1) next_[taken[i]] = {drafts[i], int64_t(i)};
    }
  }

  void propose(std::span<Sequence* const> seqs, std::span<const int64_t> max_tokens) override {
    // Round 0 is observe()'s; each further round runs the layer on the last draft and its own output state.
    std::vector<size_t> running;
    std::vector<int64_t> state_rows;
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i]->truncate_draft(0);
      auto it = next_.find(seqs[i]);
      if (it == next_.end() || max_tokens[i] <= 0) continue;
      seqs[i]->draft.push_back(it->second.first_draft);
      if (max_tokens[i] > 1) {
        running.push_back(i);
        state_rows.push_back(it->second.state_row);
      }
    }
    Tensor states = states_;
    while (!running.empty()) {
      std::vector<SequenceState> positions(running.size());
      std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
      for (size_t r = 0; r < running.size(); ++r) {
        Sequence& seq = *seqs[running[r]];
        // Draft d at position tokens.size() - 1 + (its index): the layer writes its row there, where the
        // target's next step will write its own (the engine allocated the blocks: rows_ahead).
        positions[r].length = int64_t(seq.tokens.size()) - 2 + int64_t(seq.draft.size());
        positions[r].cache = seq.state.cache;
        parts.push_back({&positions[r], {seq.draft.back()}});
      }
      Batch mtp = make_batch(parts);
      mtp.all_logits = false;
      mtp.keep_hidden_states = true;
      mtp.hidden_states_in = ops::select_rows(states, state_rows);
      const std::vector<int32_t> drafts = greedy(runner_.run(mtp));
      std::vector<size_t> still;
      std::vector<int64_t> still_rows;
      for (size_t r = 0; r < running.size(); ++r) {
        Sequence& seq = *seqs[running[r]];
        seq.draft.push_back(drafts[r]);
        if (int64_t(seq.draft.size()) < max_tokens[running[r]]) {
          still.push_back(running[r]);
          still_rows.push_back(int64_t(r));
        }
      }
      states = mtp.hidden_states;
      running = std::move(still);
      state_rows = std::move(still_rows);
    }
    next_.clear();
  }

  void forget(const Sequence& seq) override { next_.erase(&seq); }

 private:
  static std::vector<int32_t> greedy(const Tensor& logits) {
    std::vector<TokenDraw> draws(size_t(logits.dim(0)));
    for (TokenDraw& d : draws) d.temperature = 0;
    return ops::sample_tokens(logits, draws, {});
  }

  struct Next {
    int32_t first_draft;
    int64_t state_row;  // its row of states_
  };
  ModelRunner runner_;
  std::unordered_map<const Sequence*, Next> next_;
  Tensor states_;  // the layer's output state at each observed sequence's last position
};

}  // namespace

std::unique_ptr<DraftProposer> make_mtp_proposer(MtpDrafter& drafter, bool enforce_eager) {
  return std::make_unique<MtpProposer>(drafter, enforce_eager);
}

}  // namespace sparrow
