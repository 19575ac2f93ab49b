// Speculative decoding (vLLM's --speculative-config): a proposer guesses the next k tokens of a sequence,
// one step of the target model scores them all, and the tokens the target would have drawn anyway are
// kept, so a step can yield up to k + 1 tokens for about the cost of one.
//
// Verification (EngineCore::step): a sequence with drafts d_1 .. d_k runs its pending token(s) and the
// drafts in one step; the rows before each draft and the last row get logits (SeqSlice::logits). Row i
// draws the target's token t_i exactly as a step without speculation would: the same adjustments
// (penalties over the output so far, the drafts before it included), the same mask (a structured output's
// grammar advanced over the drafts before it), and the key of that output position (Sampler::prepare).
// The drafts are accepted while t_i == d_i; the first t_i that differs (or t_{k+1} after k acceptances) is
// the step's last token. For proposers whose drafts are deterministic (ngram, greedy draft models) this is
// vLLM's rule (rejection_sampler: a draft of one-hot q is accepted with probability p(d), and a rejected
// one is replaced by a draw from p with d removed) carried out by coupling: t_i ~ p, accepted iff t_i = d,
// and when not, t_i is distributed as p without d. So the output has exactly the target's distribution,
// and more: it is the very text decoding without speculation gives, token for token, for greedy requests
// and for seeded ones (the same keys draw the same tokens), whatever the drafts. Unseeded sampled requests
// are equal in distribution only.
//
// Caches: rows written for rejected drafts are simply dropped (the sequence's length is set back and they
// are overwritten later; they never enter the prefix cache). A recurrent layer (KDA) cannot drop tokens
// from its state, so a verify step snapshots it after the pending tokens (KvCache::mark_rollback); after a
// rejection the state goes back to the snapshot and the accepted tokens run again at the head of the next
// step, beside its new drafts (vLLM keeps one state per draft position instead; this costs a state copy
// per step and the accepted tokens' recompute, but no extra memory per draft).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow {

class Model;
struct Batch;
struct Sequence;

struct SpeculativeConfig {
  // "ngram" (prompt lookup: no weights), "draft_model" (a smaller checkpoint with the same vocabulary),
  // "mtp" (the target checkpoint's multi-token-prediction layer; vLLM's "deepseek_mtp" too) or "dspark" (a
  // DSpark drafter checkpoint: model/dspark.h); empty: no speculation. vLLM's "dflash", "eagle" and
  // "eagle3" are refused by name (not built yet).
  std::string method;
  int64_t num_speculative_tokens = 0;  // k: draft tokens a sequence proposes per step
  std::string model;                   // draft_model, dspark: the draft checkpoint's folder
  // How a draft model picks its tokens: "greedy" (its argmax) or "probabilistic" (drawn from its
  // distribution q at the request's temperature, verified with the p > u·q rule: verify_draft_token).
  std::string draft_sample_method = "greedy";
  // vLLM's rejection_sample_method "synthetic", for benchmarks of the verify path at real dimensions with dummy
  // weights: every decoding sequence verifies k drafts a step, and each is accepted with probability
  // synthetic_acceptance_rate after the ones before it (given as synthetic_acceptance_length, the mean
  // tokens a step yields, the rate is solved from it). Outputs are then not the model's.
  bool synthetic = false;
  double synthetic_acceptance_rate = 0;
  // ngram: the suffix of the sequence matched earlier in it, from prompt_lookup_max tokens down to
  // prompt_lookup_min (vLLM's defaults: 5 and 5; one given, the other equals it).
  int64_t prompt_lookup_min = 0, prompt_lookup_max = 0;
  // dspark, Qwen3 drafters: the Markov head corrects only each query's dspark_draft_topk best base logits, the
  // others are -inf (vLLM's SpeculativeConfig.dspark_draft_topk; 0: the drafter config's, else every id).
  int64_t dspark_draft_topk = 0;
  // Keys vLLM accepts that change nothing here (printed once as a notice): see docs/speculative.md.
  std::vector<std::string> ignored_keys;

  bool enabled() const { return !method.empty(); }
};

// vLLM's --speculative-config JSON (an object). Throws sparrow::Error naming the key for an unknown key, a
// wrong type, a value out of range, or a method sparrow does not run.
SpeculativeConfig parse_speculative_config(std::string_view json);

// Proposes draft tokens for sequences about to decode. One proposer per engine.
class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // For each sequence (all of its tokens computed or about to be, none of them drafts), at most
  // max_tokens[i] draft tokens to follow seqs[i]->tokens, into seqs[i]->draft (empty: no guess).
  virtual void propose(std::span<Sequence* const> seqs, std::span<const int64_t> max_tokens) = 0;
  // The sequence is done (finished or aborted): let go of anything kept for it.
  virtual void forget(const Sequence& seq) { (void)seq; }

  // Proposers that read the target (MTP, DSpark). With reads_hidden_states every step keeps them
  // (Batch::keep_hidden_states), and observe() gets each step after its verification, before its tokens are
  // committed (so that cache rows a proposer writes for them enter the prefix cache with the block): the
  // step's batch and each of its sequences (null for those that finished in it), in the batch's order, with
  // the position up to which each one's rows of the step stand (its length, or past a recurrent model's
  // rollback the accepted drafts' rows too: they are right, only the recurrent state went back).
  virtual bool reads_hidden_states() const { return false; }
  virtual void observe(const Batch& batch, std::span<Sequence* const> seqs, std::span<const int64_t> rows_kept) {
    (void)batch;
    (void)seqs;
    (void)rows_kept;
  }
  // Cache rows past a sequence's computed tokens that proposing k drafts writes (MTP: k - 1, DSpark: k); the engine
  // allocates them first.
  virtual int64_t rows_ahead(int64_t k) const {
    (void)k;
    return 0;
  }
};

// Prompt lookup (vLLM's "ngram"): the longest suffix of `tokens` of length in [min_n, max_n] that also
// occurs earlier, its most recent earlier occurrence, and up to k of the tokens that followed it there.
std::vector<int32_t> ngram_proposal(std::span<const int32_t> tokens, int64_t min_n, int64_t max_n, int64_t k);

// The proposer of a config; `draft_model` for "draft_model" (loaded by the caller from config.model, on the
// target's device), "mtp" (an MtpDrafter: model/mtp.h, load_mtp_drafter) and "dspark" (a DSparkDrafter:
// model/dspark.h, load_dspark_drafter), null otherwise. Both must outlive the proposer. The drafter's steps
// replay CUDA graphs unless `enforce_eager` (the target's setting) or the drafter is not capturable (DSpark).
std::unique_ptr<DraftProposer> make_draft_proposer(const SpeculativeConfig& config, Model* draft_model,
                                                   bool enforce_eager = false);

// How many of the drafts the target's own tokens confirm: the longest prefix with drafts[i] == target[i]
// (target holds one token per draft and one more).
int64_t accepted_draft_tokens(std::span<const int32_t> drafts, std::span<const int32_t> target);

// A draft token drawn from a distribution q (probabilistic drafts), against the target's distribution p at
// its position (both over the vocabulary): accepted when p(d) >= u·q(d), u uniform in (0, 1] from `key`;
// otherwise the token is drawn from max(p - q, 0) normalised, also from `key`. Leviathan, Kalman, Matias 2023
// ("Fast Inference from Transformers via Speculative Decoding"), Algorithm 1; vLLM's rejection_sampler.
// The output token is distributed exactly as p. Returns -1 when the draft is accepted, else the token.
int32_t verify_draft_token(std::span<const double> p, std::span<const float> q, int32_t draft, uint64_t key);

// A probabilistic draft for a sequence that samples (draft_model, dspark): a draw from q = softmax(logits /
// T) at the request's temperature T, by the Gumbel-max rule with a key of its own for the draft's output
// position (apart from the target's: Sampler::key), q appended to seq.draft_probs for verify_draft_token.
int32_t draw_draft_token(Sequence& seq, std::span<const float> logits);

// Synthetic acceptance: the per-draft rate r whose mean acceptance length 1 + r + r^2 + ... + r^k is
// `length` (in [1, k + 1]).
double synthetic_rate_for_length(double length, int64_t k);
// How many of k drafts a synthetic verify step accepts: each with probability `rate` while the ones before
// it were, from `key`.
int64_t synthetic_accepted(int64_t k, double rate, uint64_t key);

// vLLM's spec_decode counters (vllm:spec_decode_num_drafts_total, ...): verify steps of a sequence with at
// least one draft token, draft tokens verified, drafts accepted, and accepted drafts by position (index i:
// the (i+1)-th draft token of a step was accepted).
struct SpecDecodeStats {
  int64_t drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  std::vector<int64_t> accepted_by_position;
  // The mean tokens a verify step yields per sequence: 1 + accepted / drafts (vLLM's acceptance length).
  double acceptance_length() const { return drafts ? 1.0 + double(accepted_tokens) / double(drafts) : 0.0; }
};

}  // namespace sparrow
