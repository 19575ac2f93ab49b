// The engine's step loop without threads: requests in, one scheduled step of the model at a time,
// events out through each request's callback. Engine (engine.h) runs it on its own thread for the
// server; `sparrow generate` and tests drive it directly.
//
// One step:
//   1. the scheduler picks the sequences and how many tokens of each (scheduler.h);
//   2. their tokens form one Batch, run by the core's ModelRunner against the paged KV cache; logits come back
//      for each sequence's last token (and the rows before its speculative draft tokens), or for every
//      token when a prefill needs prompt logprobs;
//   3. each sequence whose tokens are now all computed draws its next token (all of them at once, where
//      the logits are: on a GPU only the ids cross); with drafts, one token per row, and the drafts the
//      target drew itself are kept (engine/speculative.h);
//   4. the computed tokens the step keeps are committed to the cache (full blocks enter the prefix cache);
//   5. each new token is detokenized, checked against the stop conditions and sent as a RequestOutput
//      event; with speculative decoding, the proposer guesses the next step's drafts.
#pragma once
#include <array>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/kv_cache.h"
#include "engine/encoder_cache.h"
#include "engine/kv_handoff.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/speculative.h"
#include "model/model.h"
#include "runner/memory_profile.h"
#include "runner/model_runner.h"
#include "tokenizer/tokenizer.h"

namespace sparrow {

struct EngineConfig {
  CacheConfig cache;  // its max_num_seqs is set from max_num_seqs below
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
  int64_t max_model_len = 0;  // prompt + generated tokens of one sequence; must be set (> 0)
  // End-of-sequence ids (generation_config.json's, see eos_token_ids in generate.h); when empty, the
  // tokenizer's eos token.
  std::vector<int32_t> eos_token_ids;
  // Run warm_up() when the core is made (sparrow serve on a GPU): a cache too large for a step's scratch
  // then fails at start.
  bool warm_up = false;
  RunnerOptions runner;  // how the core's model runner runs steps (--enforce-eager)
  // Speculative decoding (--speculative-config, engine/speculative.h); for method "draft_model", the draft
  // model loaded from speculative.model, for "mtp" the served model's MTP layer (model/mtp.h: its cache layer
  // joins the engine's cache); it must outlive the core.
  SpeculativeConfig speculative;
  Model* draft_model = nullptr;
  // Prefill/decode disaggregation (--kv-transfer-config; engine/kv_handoff.h).
  KvTransferSettings kv_transfer;

  StepLimits step_limits() const {
    return {max_num_seqs, max_num_batched_tokens, max_model_len, speculative.num_speculative_tokens};
  }
};

// Where the engine loop's time goes, summed over steps of one kind: `seconds` from scheduling to the last
// emitted token, `forward_seconds` the part from the batch being ready to the sampled tokens being on
// the host (the forward pass's launches and kernels, and sampling). The rest is host work: scheduling,
// the cache's bookkeeping, detokenizing and handing events to the server. A serving benchmark reads
// these to say why a point sits below the roofline.
struct StepCounters {
  int64_t steps = 0;
  double seconds = 0, forward_seconds = 0;
};

// How many tokens the steps carried (vLLM's vllm:iteration_tokens_total): steps_by_log2[k] counts the steps
// of more than 2^(k-1) and at most 2^k tokens (k = 0: one token), so the counts at or below any power of
// two are exact.
struct IterationTokens {
  static constexpr int kBuckets = 32;
  std::array<int64_t, kBuckets> steps_by_log2{};
  int64_t tokens = 0;  // summed over all steps
  void observe(int64_t step_tokens);
};

struct EngineStats {
  int64_t running = 0, waiting = 0;  // sequences (a request with n choices counts n)
  int64_t kv_blocks_used = 0, kv_blocks_total = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;  // prompt tokens looked up / reused
  int64_t preemptions = 0;
  int64_t prompt_tokens_total = 0, generation_tokens_total = 0;
  SpecDecodeStats spec_decode;  // speculative decoding's drafts and acceptances
  StepCounters decode_steps;   // steps without prompt tokens (one token a sequence, or verifying its drafts)
  StepCounters prefill_steps;  // steps with prompt chunks (mixed with decode tokens or not)
  IterationTokens iteration_tokens;
  int64_t graph_replays = 0;  // steps replayed from CUDA graphs (runner/decode_graphs.h)
  // Images (engine/encoder_cache.h): embeddings asked for and found cached, and the vision tower's time on the rest.
  int64_t mm_cache_queries = 0, mm_cache_hits = 0;
  double encoder_seconds = 0;
  KvTransferStats kv_transfer;  // prefill/decode disaggregation's offers and fetches
  // Data parallel, rank 0's engine: the requests handed to each group so far (empty otherwise).
  std::vector<int64_t> requests_by_group;
};

// The layers the engine's cache holds: the model's, and with an MTP drafter (config.speculative "mtp") its
// layer after them (model/mtp.h). Throws when the drafter's layer belongs to another model.
std::vector<LayerCacheSpec> engine_cache_spec(const Model& model, const EngineConfig& config);

class EngineCore {
 public:
  using OutputCallback = std::function<void(const RequestOutput&)>;

  // `model` and `tokenizer` (may be null: no text, no stop strings) must outlive the core.
  EngineCore(Model& model, const Tokenizer* tokenizer, EngineConfig config);

  // Throws sparrow::Error naming what is wrong: empty prompt, ids outside the vocabulary, prompt +
  // max_tokens beyond max_model_len, bad sampling parameters, stop strings without a tokenizer, a
  // structured output spec that does not compile (it is compiled here, on the caller's thread, and kept
  // in the grammar cache for add()).
  void validate(const Request& request) const;
  // Validates and queues. `on_output` gets every event of the request, last the one with finished set
  // for each choice; it must not call back into the core.
  void add(Request request, OutputCallback on_output);
  // Ends the request's unfinished choices with finish_reason "abort" and frees everything they hold.
  // Unknown (or finished) ids are ignored.
  void abort(const std::string& request_id);
  void abort_all();

  // One forward pass of a full step before serving, as vLLM's profile run: max_num_batched_tokens prompt
  // tokens (in as many sequences as max_model_len needs, at most max_num_seqs) and the draw of each
  // sequence's next token, so that a step's largest scratch is allocated now and kept by the device pool.
  // A KV cache that leaves too little memory for it fails here, naming the flags to change, instead of
  // failing requests later. Nothing of it stays: its blocks go back unshared (no prefix-cache entries) and
  // no counter moves. With speculative decoding a second step follows: the widest verify step (k + 1 tokens
  // and rows of logits for each of max_num_seqs sequences, within the token budget). Returns the tokens the
  // first ran.
  int64_t warm_up();
  // Runs one step; false when there was nothing to run.
  bool step();
  // (A decode instance's requests waiting for their blocks or their fetch count as work: step() polls them.)
  bool has_work() const { return scheduler_.has_work() || !handoffs_waiting_.empty() || !fetches_.empty(); }
  // Data parallel: this group's part of a step other groups run while it has nothing to run
  // (ModelRunner::run_idle).
  IdleStep step_idle() { return runner_.run_idle(); }

  EngineStats stats() const;
  const KvCache& cache() const { return cache_; }
  int64_t max_model_len() const { return config_.max_model_len; }
  const EngineConfig& config() const { return config_; }
  // Images embedded by the vision tower so far (the encoder cache's misses).
  int64_t encoder_cache_misses() const { return encoder_cache_.misses(); }

 private:
  struct ActiveRequest {
    Request request;
    OutputCallback on_output;
    std::vector<std::unique_ptr<Sequence>> choices;
    int64_t unfinished = 0;
  };

  void record_prompt_logprobs(Sequence& seq, const Tensor& logits, const SeqSlice& slice);
  // Appends the sequence's next token and sends its event; `logits` (its raw row on the host) is only
  // read for log-probabilities and may be empty when none were asked, or when `known` gives them (a decode
  // instance's first token, drawn by the prefill instance). False when the token ended the sequence (it is
  // gone then).
  bool emit(Sequence& seq, int32_t token, std::span<const float> logits, const TokenLogprob* known = nullptr);
  // Sets the event's finish reason when `token` ends the sequence (end of sequence, stop token id).
  bool check_stop_token(const Sequence& seq, int32_t token, RequestOutput& event) const;
  // The token's text; a stop string it completes ends the sequence.
  void add_text(Sequence& seq, int32_t token, bool stop_token, RequestOutput& event) const;
  RequestOutput new_event(const Sequence& seq) const;
  ActiveRequest& active_request(const Sequence& seq);
  // The step's token bitmasks (structured outputs, allowed_token_ids) of the sampled sequences; rows
  // index `sampled`.
  // A sequence with k draft tokens has k + 1 consecutive rows: row i's mask is its grammar's after the
  // first i drafts.
  void fill_token_masks(const std::vector<Sequence*>& row_seqs, std::vector<int32_t>& rows,
                        std::vector<uint32_t>& words) const;
  // Ends a choice whose mask allowed no token (or whose grammar refused the one drawn).
  void finish_unmatched(Sequence& seq);
  // After a step's events: the proposer sees the step (observe), the decoding sequences get their next drafts,
  // and every sequence still running commits what the step computed. `alive` is each chunk's sequence, null
  // for those that finished; `rows_kept` where its rows of the step stand (DraftProposer::observe).
  void end_step(const Batch& batch, const std::vector<Sequence*>& alive, const std::vector<int64_t>& rows_kept,
                const std::vector<Sequence*>& decoding);
  // Speculative decoding: the next step's drafts of the sequences that decode on.
  void propose_drafts(const std::vector<Sequence*>& sampled);
  // The draws of a step: one per row of logits a sampled sequence gets (k + 1 for k drafts).
  struct StepDraws {
    std::vector<int64_t> rows;  // each draw's row of the step's logits (ascending)
    std::vector<TokenDraw> draws;
    std::vector<LogitAdjustment> adjustments;
    std::vector<int32_t> mask_rows;  // the draws with a token bitmask (ascending) and their masks
    std::vector<uint32_t> mask_words;
    int64_t mask_width = 0;
    Tensor host_logits;  // the logits on the host, when logprobs or probabilistic drafts need them
  };
  struct Verdict {
    int64_t accepted = 0;      // drafts kept
    int32_t replacement = -1;  // the token after them when not the target's draw there (a rejected
                               // probabilistic draft's resample)
  };
  // Which of seq's drafts the step keeps: draws first .. first + drafts are its rows, `target` their tokens.
  Verdict verify_drafts(const Sequence& seq, size_t first, std::span<const int32_t> target,
                        const StepDraws& step) const;
  // Counts a verification and sets the sequence's computed length after it (a recurrent state rolled back
  // when a draft was rejected); returns where its rows of the step stand (DraftProposer::observe).
  int64_t settle_verification(Sequence& seq, int64_t drafts, int64_t accepted);
  // Sends the choice's last event (`event` has finished set) and lets go of the choice.
  void finish(Sequence& seq, RequestOutput& event);

  // A step's image rows (Batch::embedded_rows): each chunk's part of its sequence's images, embedded on a miss.
  void attach_images(const std::vector<ScheduledChunk>& chunks, Batch& batch);

  // Prefill/decode disaggregation (engine/kv_handoff.cpp).
  void validate_kv_transfer(const Request& request) const;
  // A prefill instance's finished do_remote_decode choice: its cache is offered (event.kv_handoff says how to
  // fetch it) instead of freed. A decode instance's choice that ends while its fetch runs: the fetch is
  // cancelled and its blocks freed once it has stopped writing them.
  void hand_off_on_finish(Sequence& seq, RequestOutput& event);
  // Decode instance: starts the fetches of waiting handoffs while blocks and sequence slots last.
  void start_fetches();
  // Both: ended offers free their caches; fetched sequences join the running ones and emit their first token.
  void settle_transfers();
  struct PendingFetch {
    Sequence* seq;  // null once its choice was aborted
    uint64_t ticket;
    SeqId cache_id;
    // Through host memory (a GPU cache): the fetched bytes, and the pool's regions they go to, in order.
    std::vector<std::byte> staging;
    std::vector<KvRegion> landing;
  };
  struct Offer {
    SeqId cache_id = -1;              // the offered cache (-1: its bytes were staged and its blocks freed)
    std::vector<std::byte> staging;  // a GPU cache's rows and state, in host memory
  };
  // Whether transfers go through host memory: a GPU cache's always (KvTransferSettings::stage_through_host).
  bool stages_kv_transfers() const;
  std::deque<Sequence*> handoffs_waiting_;  // decode side: in arrival order
  std::vector<PendingFetch> fetches_;
  std::unordered_map<std::string, Offer> offered_;  // prefill side: transfer id -> what it offers
  int64_t next_transfer_ = 0;
  KvTransferStats kv_stats_;

  Model& model_;
  ModelRunner runner_;
  const Tokenizer* tokenizer_;
  EngineConfig config_;
  std::vector<int32_t> end_of_sequence_;
  // Structured outputs' compiled grammars over the tokenizer's vocabulary, made by grammars() when a request
  // first asks for one (needs a tokenizer).
  structured::GrammarCompiler& grammars() const;
  mutable std::once_flag grammars_made_;
  mutable std::unique_ptr<structured::GrammarCompiler> grammars_;
  KvCache cache_;
  Scheduler scheduler_;
  std::unordered_map<std::string, std::unique_ptr<ActiveRequest>> requests_;
  int64_t prompt_tokens_total_ = 0, generation_tokens_total_ = 0;
  StepCounters decode_steps_, prefill_steps_;
  IterationTokens iteration_tokens_;
  std::unique_ptr<DraftProposer> proposer_;  // with --speculative-config
  SpecDecodeStats spec_decode_;
  EncoderCache encoder_cache_;  // the images' embeddings (model_.vision())
};

}  // namespace sparrow
