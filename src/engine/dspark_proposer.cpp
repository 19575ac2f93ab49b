#include "engine/dspark_proposer.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "core/error.h"
#include "engine/sequence.h"
#include "kernels/ops.h"
#include "kernels/sampling_rule.h"
#include "model/dspark.h"
#include "runner/model_runner.h"
#include "runner/step_inputs.h"

namespace sparrow {

namespace {

class DSparkProposer final : public DraftProposer {
 public:
  DSparkProposer(DSparkDrafter& drafter, bool probabilistic, int64_t draft_topk)
      : drafter_(drafter),
        runner_(drafter, RunnerOptions{.enforce_eager = true}),
        probabilistic_(probabilistic),
        topk_(draft_topk > 0 ? draft_topk : drafter.draft_topk) {
    SPARROW_CHECK(topk_ == 0 || drafter.type == "qwen3", "speculative decoding: dspark_draft_topk is for Qwen3 DSpark "
                  "drafters (vLLM refuses it for ", drafter.type, ")");
    SPARROW_CHECK(topk_ <= drafter.draft_vocab, "speculative decoding: dspark_draft_topk ", topk_,
                  " exceeds the drafter's vocabulary of ", drafter.draft_vocab);
  }

  bool reads_hidden_states() const override { return true; }
  // The block's rows: positions L - 1 .. L + k - 2 of a sequence of L tokens, whose computed rows end at L - 2.
  int64_t rows_ahead(int64_t k) const override { return k; }

  void observe(const Batch& batch, std::span<Sequence* const> seqs, std::span<const int64_t> rows_kept) override {
    ready_.clear();
    SPARROW_CHECK(batch.hidden_states.defined(), "dspark: the target's step kept no hidden states");
    std::vector<SequenceState> states(seqs.size());
    std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
    std::vector<int64_t> rows;
    for (size_t j = 0; j < seqs.size(); ++j) {
      Sequence* seq = seqs[j];
      if (!seq) continue;
      // The step's positions whose target states stand: every one below rows_kept.
      const int64_t start = batch.positions[size_t(batch.seqs[j].offset)];
      const int64_t end = std::min(rows_kept[j], int64_t(seq->tokens.size()) - 1);
      if (end <= start) continue;
      states[j].length = start;
      states[j].cache = seq->state.cache;
      parts.push_back({&states[j], std::vector<int32_t>(seq->tokens.begin() + start, seq->tokens.begin() + end)});
      for (int64_t p = start; p < end; ++p) rows.push_back(batch.seqs[j].offset + (p - start));
      // It drafts when every token but its newest has its context row (not mid-prompt).
      if (end == int64_t(seq->tokens.size()) - 1) ready_.insert(seq);
    }
    if (parts.empty()) return;
    Batch context = make_batch(parts);
    context.hidden_states_in = ops::select_rows(batch.hidden_states, rows);
    if (drafter_.device() != Device::Cpu) attach_device_step(context, drafter_.device());
    drafter_.store_context(context);
  }

  void propose(std::span<Sequence* const> seqs, std::span<const int64_t> max_tokens) override {
    std::vector<Sequence*> drafting;
    std::vector<int64_t> counts;
    std::vector<SequenceState> states(seqs.size());
    std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& seq = *seqs[i];
      seq.truncate_draft(0);
      if (max_tokens[i] <= 0 || !ready_.count(&seq)) continue;
      // The block: the newest token at its position, then masks; a block cut short (max_tokens) is shorter.
      const int64_t n = max_tokens[i];
      states[i].length = int64_t(seq.tokens.size()) - 1;
      states[i].cache = seq.state.cache;
      std::vector<int32_t> block(size_t(n), drafter_.mask_token);
      block[0] = seq.tokens.back();
      parts.push_back({&states[i], std::move(block)});
      drafting.push_back(&seq);
      counts.push_back(n);
    }
    ready_.clear();
    if (drafting.empty()) return;
    Batch block = make_batch(parts);
    block.all_logits = true;
    const Tensor base = runner_.run(block);
    // A draft top-k: each query's candidates, chosen once from its base logits before the Markov bias (on the
    // host: the block's few rows).
    std::vector<std::vector<int32_t>> candidates;
    if (topk_ > 0) {
      const Tensor host = base.to(Device::Cpu, ScalarType::F32);
      candidates.resize(size_t(host.dim(0)));
      for (int64_t r = 0; r < host.dim(0); ++r) {
        std::vector<int32_t>& ids = candidates[size_t(r)];
        ids.resize(size_t(host.dim(1)));
        std::iota(ids.begin(), ids.end(), 0);
        const float* row = host.row(r);
        std::partial_sort(ids.begin(), ids.begin() + topk_, ids.end(), [row](int32_t a, int32_t b) {
          return row[a] > row[b] || (row[a] == row[b] && a < b);
        });
        ids.resize(size_t(topk_));
      }
    }

    // Left to right: logits_i = base_i + markov(previous token), the block's first row after the newest token.
    std::vector<int32_t> previous;
    for (Sequence* seq : drafting) previous.push_back(seq->tokens.back());
    const int64_t longest = *std::max_element(counts.begin(), counts.end());
    for (int64_t i = 0; i < longest; ++i) {
      std::vector<size_t> active;
      std::vector<int64_t> rows;
      std::vector<int32_t> prev;
      for (size_t s = 0; s < drafting.size(); ++s) {
        if (counts[s] <= i) continue;
        active.push_back(s);
        rows.push_back(block.seqs[s].offset + i);
        prev.push_back(previous[s]);
      }
      Tensor logits = ops::select_rows(base, rows);
      ops::add_(logits, drafter_.markov_bias(prev));
      if (topk_ > 0) {  // every id but the row's candidates at -inf
        Tensor kept = logits.to(Device::Cpu, ScalarType::F32);
        for (size_t a = 0; a < rows.size(); ++a) {
          float* row = kept.row(int64_t(a));
          std::vector<float> values;
          for (int32_t id : candidates[size_t(rows[a])]) values.push_back(row[id]);
          std::fill_n(row, kept.dim(1), -std::numeric_limits<float>::infinity());
          for (size_t c = 0; c < values.size(); ++c) row[candidates[size_t(rows[a])][c]] = values[c];
        }
        logits = kept;
      }
      std::vector<TokenDraw> greedy(active.size());
      for (TokenDraw& draw : greedy) draw.temperature = 0;
      // Draft ids (a reduced draft vocabulary's) become target ids; a sampling request draws from the
      // distribution over the target's vocabulary that verification compares with.
      std::vector<int32_t> next = ops::sample_tokens(logits, greedy, {});
      for (int32_t& token : next) token = drafter_.target_token(token);
      if (probabilistic_) {
        Tensor host;
        for (size_t a = 0; a < active.size(); ++a) {
          Sequence& seq = *drafting[active[a]];
          if (seq.params().temperature < kGreedyTemperature) continue;
          if (!host.defined()) host = drafter_.target_logits(logits.to(Device::Cpu));
          next[a] = draw_draft_token(seq, {host.row(int64_t(a)), size_t(host.dim(1))});
        }
      }
      for (size_t a = 0; a < active.size(); ++a) {
        drafting[active[a]]->draft.push_back(next[a]);
        previous[active[a]] = next[a];
      }
    }
  }

  void forget(const Sequence& seq) override { ready_.erase(&seq); }

 private:
  DSparkDrafter& drafter_;
  ModelRunner runner_;
  bool probabilistic_;
  int64_t topk_;  // 0: no draft top-k
  std::unordered_set<const Sequence*> ready_;  // observed up to their newest token since the last proposal
};

}  // namespace

std::unique_ptr<DraftProposer> make_dspark_proposer(DSparkDrafter& drafter, bool probabilistic, int64_t draft_topk) {
  return std::make_unique<DSparkProposer>(drafter, probabilistic, draft_topk);
}

}  // namespace sparrow
