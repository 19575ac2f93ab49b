#include "engine/engine_core.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <thread>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_sampling.h"
#include "kernels/ops.h"
#include "runner/memory_profile.h"

namespace sparrow {

namespace {

// The cache the engine runs on: one state slot per running sequence, on the model's device.
// With speculative decoding, recurrent layers need a rollback snapshot per running sequence.
CacheConfig engine_cache_config(CacheConfig cache, int64_t max_num_seqs, Device device, bool speculative) {
  cache.max_num_seqs = max_num_seqs;
  cache.device = device;
  cache.rollback_snapshots = speculative;
  return cache;
}

bool contains(const std::vector<int32_t>& ids, int32_t id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

// Salts that give speculative decoding's coins keys of their own, apart from the draws' (Sampler::key).
constexpr uint64_t kSyntheticCoins = 0x5EC0'0001'C01D'5EEDull;
constexpr uint64_t kVerifyCoins = 0x5EC0'0002'C01D'5EEDull;

}  // namespace

std::vector<LayerCacheSpec> engine_cache_spec(const Model& model, const EngineConfig& config) {
  std::vector<LayerCacheSpec> spec = model.cache_spec();
  // The MTP layer and the DSpark drafter keep their rows in the target's cache, after its layers.
  const std::string& method = config.speculative.method;
  if (method != "mtp" && method != "dspark") return spec;
  SPARROW_CHECK(config.draft_model != nullptr, "speculative decoding: method \"", method, "\" without its drafter loaded");
  std::vector<LayerCacheSpec> with_drafter = config.draft_model->cache_spec();
  SPARROW_CHECK(with_drafter.size() > spec.size() && std::equal(spec.begin(), spec.end(), with_drafter.begin()),
                "speculative decoding: the ", method, " drafter belongs to another model than the one served");
  return with_drafter;
}

EngineCore::EngineCore(Model& model, const Tokenizer* tokenizer, EngineConfig config)
    : model_(model),
      runner_(model, config.runner),
      tokenizer_(tokenizer),
      config_(std::move(config)),
      cache_(engine_cache_spec(model, config_),
             engine_cache_config(config_.cache, config_.max_num_seqs, model.device(), config_.speculative.enabled())),
      scheduler_(cache_, SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens}),
      // vLLM sizes its encoder cache at a step's token budget; the image being prefilled always stays.
      encoder_cache_(config_.max_num_batched_tokens) {
  SPARROW_CHECK(config_.max_model_len > 0, "max_model_len must be set, got ", config_.max_model_len);
  SPARROW_CHECK(config_.max_model_len <= cache_.plan().max_tokens(), "the KV cache holds ",
                cache_.plan().max_tokens(), " tokens, fewer than max_model_len (", config_.max_model_len,
                "): give it more memory or lower max_model_len");
  end_of_sequence_ = config_.eos_token_ids;
  if (end_of_sequence_.empty() && tokenizer_ && tokenizer_->eos_id()) end_of_sequence_.push_back(*tokenizer_->eos_id());
  if (config_.speculative.enabled()) {
    if (config_.draft_model)
      SPARROW_CHECK(config_.draft_model->vocab_size() == model_.vocab_size(), "speculative decoding: the draft model's "
                    "vocabulary (", config_.draft_model->vocab_size(), " tokens) differs from the target's (",
                    model_.vocab_size(), "); a draft model must share the target's tokenizer");
    proposer_ = make_draft_proposer(config_.speculative, config_.draft_model, config_.runner.enforce_eager);
    SPARROW_CHECK(!config_.speculative.synthetic || !config_.draft_model || config_.speculative.draft_sample_method == "greedy",
                  "speculative decoding: synthetic acceptance verifies no distribution: draft_sample_method must be greedy");
  }
  if (config_.warm_up) warm_up();
}

void EngineCore::validate(const Request& request) const {
  const SamplingParams& p = request.params;
  SPARROW_CHECK(!request.id.empty(), "the request has no id");
  SPARROW_CHECK(!request.prompt.empty(), "the prompt is empty");
  for (int32_t id : request.prompt)
    SPARROW_CHECK(id >= 0 && id < model_.vocab_size(), "prompt token id ", id, " is outside the vocabulary [0, ",
                  model_.vocab_size(), ")");
  sparrow::validate(p);
  const int64_t prompt = int64_t(request.prompt.size());
  SPARROW_CHECK(prompt + p.max_tokens <= config_.max_model_len, "this model's maximum context length is ",
                config_.max_model_len, " tokens, but ", prompt + p.max_tokens, " were requested (", prompt,
                " in the prompt, ", p.max_tokens, " in the completion)");
  SPARROW_CHECK(p.stop.empty() || tokenizer_ != nullptr, "stop strings need a tokenizer");
  for (auto [id, bias] : p.logit_bias)
    SPARROW_CHECK(id < model_.vocab_size(), "logit_bias token id ", id, " is outside the vocabulary [0, ",
                  model_.vocab_size(), ")");
  if (p.allowed_token_ids)
    for (int32_t id : *p.allowed_token_ids)
      SPARROW_CHECK(id < model_.vocab_size(), "allowed_token_ids: token id ", id, " is outside the vocabulary [0, ",
                    model_.vocab_size(), ")");
  if (p.structured.active()) {
    SPARROW_CHECK(tokenizer_ != nullptr, "structured outputs need a tokenizer");
    grammars().compile(p.structured);
  }
  if (!request.images.empty()) {
    const VisionEncoder* tower = model_.vision();
    SPARROW_CHECK(tower != nullptr, "this model takes no images (", model_.model_type(), " without a vision tower)");
    SPARROW_CHECK(tower->image_token_id() >= 0, "the model's config names no image placeholder token "
                  "(image_token_index)");
    for (size_t i = 0; i < request.images.size(); ++i) {
      const vision::ImageInput& image = request.images[i];
      SPARROW_CHECK(image.pixel_values.defined() && image.pixel_values.on_cpu() &&
                        image.pixel_values.type() == ScalarType::F32 && image.pixel_values.ndim() == 2 &&
                        image.pixel_values.dim(1) == tower->patch_width() &&
                        image.pixel_values.dim(0) == image.grid.t * image.grid.h * image.grid.w,
                    "image ", i, ": its patches do not fit the model's vision tower");
      SPARROW_CHECK(tower->tokens(image.grid) == image.tokens, "image ", i, " takes ", tower->tokens(image.grid),
                    " placeholder tokens in this model, not ", image.tokens);
    }
    vision::check_image_placeholders(request.prompt, request.images, tower->image_token_id());
  }
  if (request.kv_transfer.active()) validate_kv_transfer(request);
}

void EngineCore::attach_images(const std::vector<ScheduledChunk>& chunks, Batch& batch) {
  // The images the step's chunks overlap, then their embeddings (the missing ones in one tower call).
  std::vector<const vision::ImageInput*> images;
  std::vector<size_t> chunk_of;
  for (size_t j = 0; j < chunks.size(); ++j) {
    const SeqSlice& slice = batch.seqs[j];
    for (const vision::ImageInput& image : chunks[j].seq->request.images)
      if (image.offset < slice.start() + slice.count && image.offset + image.tokens > slice.start()) {
        images.push_back(&image);
        chunk_of.push_back(j);
      }
  }
  if (images.empty()) return;
  const std::vector<Tensor> embeddings = encoder_cache_.get(images, *model_.vision());
  ImageRows rows;
  for (size_t i = 0; i < images.size(); ++i) {
    const SeqSlice& slice = batch.seqs[chunk_of[i]];
    rows.add(slice.offset, slice.start(), slice.count, images[i]->offset, embeddings[i]);
  }
  rows.attach_to(batch);
}

void EngineCore::add(Request request, OutputCallback on_output) {
  validate(request);
  for (vision::ImageInput& image : request.images)
    if (image.hash == 0) image.hash = vision::image_content_hash(image.pixel_values, image.grid);
  SPARROW_CHECK(!requests_.count(request.id), "request id '", request.id, "' is already in use");
  auto active = std::make_unique<ActiveRequest>();
  active->request = std::move(request);
  active->on_output = std::move(on_output);
  const SamplingParams& p = active->request.params;
  std::vector<int32_t> end_tokens = p.stop_token_ids;
  if (!p.ignore_eos) end_tokens.insert(end_tokens.end(), end_of_sequence_.begin(), end_of_sequence_.end());
  std::shared_ptr<const structured::CompiledGrammar> grammar;
  if (p.structured.active()) grammar = grammars().compile(p.structured);  // validate() compiled it: a cache hit
  std::shared_ptr<std::vector<uint32_t>> allowed;
  if (p.allowed_token_ids) {
    allowed = std::make_shared<std::vector<uint32_t>>(size_t((model_.vocab_size() + 31) / 32), 0u);
    for (int32_t id : *p.allowed_token_ids) (*allowed)[size_t(id) >> 5] |= 1u << (id & 31);
  }
  for (int64_t i = 0; i < p.n; ++i) {
    active->choices.push_back(std::make_unique<Sequence>(active->request, i, end_tokens, tokenizer_));
    if (grammar) active->choices.back()->matcher = std::make_unique<structured::GrammarMatcher>(grammar, end_tokens);
    active->choices.back()->allowed_tokens = allowed;
    // A decode instance's handoff waits for its blocks and fetch (start_fetches), not for the scheduler.
    if (active->request.kv_transfer.remote_prefill) handoffs_waiting_.push_back(active->choices.back().get());
    else scheduler_.add(active->choices.back().get());
  }
  active->unfinished = p.n;
  const std::string id = active->request.id;
  requests_[id] = std::move(active);
}

void EngineCore::abort(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  // Copied out first: the last finish() erases the request.
  std::vector<Sequence*> unfinished;
  for (auto& seq : it->second->choices)
    if (seq->status != SequenceStatus::Finished) unfinished.push_back(seq.get());
  for (Sequence* seq : unfinished) {
    RequestOutput event = new_event(*seq);
    event.finish_reason = "abort";
    finish(*seq, event);
  }
}

void EngineCore::abort_all() {
  std::vector<std::string> ids;
  for (const auto& [id, active] : requests_) ids.push_back(id);
  for (const std::string& id : ids) abort(id);
}

EngineStats EngineCore::stats() const {
  EngineStats s;
  s.running = scheduler_.num_running();
  s.waiting = scheduler_.num_waiting();
  s.kv_blocks_total = cache_.plan().num_blocks;
  s.kv_blocks_used = s.kv_blocks_total - cache_.num_free_blocks();
  s.prefix_queries = cache_.prefix_queries();
  s.prefix_hits = cache_.prefix_hits();
  s.preemptions = scheduler_.num_preemptions();
  s.prompt_tokens_total = prompt_tokens_total_;
  s.generation_tokens_total = generation_tokens_total_;
  s.decode_steps = decode_steps_;
  s.prefill_steps = prefill_steps_;
  s.iteration_tokens = iteration_tokens_;
  s.spec_decode = spec_decode_;
  s.graph_replays = runner_.graph_replays();
  s.mm_cache_hits = encoder_cache_.hits();
  s.mm_cache_queries = encoder_cache_.hits() + encoder_cache_.misses();
  s.encoder_seconds = encoder_cache_.encode_seconds();
  s.kv_transfer = kv_stats_;
  return s;
}

void IterationTokens::observe(int64_t step_tokens) {
  int k = 0;
  while (k + 1 < kBuckets && (int64_t(1) << k) < step_tokens) ++k;
  ++steps_by_log2[size_t(k)];
  tokens += step_tokens;
}

namespace {

// Adds one step's times to its counters when the step ends, whichever return it takes.
class StepTimer {
 public:
  using Clock = std::chrono::steady_clock;
  StepTimer() : start_(Clock::now()) {}
  ~StepTimer() {
    if (!counters_) return;
    const Clock::time_point end = Clock::now();
    ++counters_->steps;
    counters_->seconds += std::chrono::duration<double>(end - start_).count();
    counters_->forward_seconds +=
        std::chrono::duration<double>((sampled_ != Clock::time_point{} ? sampled_ : end) - batch_ready_).count();
  }
  void batch_ready(StepCounters& counters) {
    counters_ = &counters;
    batch_ready_ = Clock::now();
  }
  void tokens_sampled() { sampled_ = Clock::now(); }

 private:
  StepCounters* counters_ = nullptr;
  Clock::time_point start_, batch_ready_, sampled_;
};

}  // namespace

int64_t EngineCore::warm_up() {
  const int64_t per_sequence = std::min(config_.max_model_len, config_.max_num_batched_tokens);
  try {
    const int64_t tokens =
        run_dummy_step(runner_, cache_, per_sequence, config_.max_num_batched_tokens, config_.max_num_seqs);
    // With speculation, also the widest verify step: k + 1 tokens and rows of logits for every sequence.
    if (const int64_t rows = 1 + config_.speculative.num_speculative_tokens; rows > 1)
      run_dummy_step(runner_, cache_, rows, std::min(config_.max_num_seqs * rows, config_.max_num_batched_tokens),
                     config_.max_num_seqs, rows);
    return tokens;
  } catch (const std::exception& e) {
    fail("a full engine step (", config_.max_num_batched_tokens, " tokens in sequences of at most ", per_sequence,
         ") does not run beside the KV cache: ", e.what(), "; give the cache less memory (--kv-cache-memory, "
         "--gpu-memory-utilization) or lower --max-num-batched-tokens");
  }
}

bool EngineCore::step() {
  StepTimer timer;
  if (config_.kv_transfer.agent) {
    settle_transfers();
    start_fetches();
  }
  scheduler_.set_reserved_seqs(int64_t(fetches_.size()));  // their sequences join the running ones later
  const std::vector<ScheduledChunk> chunks = scheduler_.schedule();
  if (chunks.empty()) {
    // Only handoffs to wait for (their fetches, or blocks an offer still holds): the engine loop calls again at
    // once, so do not spin it.
    if (!fetches_.empty() || !handoffs_waiting_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return false;
  }

  const bool recurrent = cache_.plan().state_slot_bytes > 0;
  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
  std::vector<int64_t> drafted(chunks.size(), 0);  // draft tokens each chunk runs after its pending ones
  bool all_logits = false;
  int64_t step_tokens = 0;
  const auto scheduled_at = std::chrono::steady_clock::now();
  for (size_t j = 0; j < chunks.size(); ++j) {
    Sequence& seq = *chunks[j].seq;
    if (!seq.first_scheduled) seq.first_scheduled = scheduled_at;
    // The scheduler cut the drafts to what the step holds: they follow all of the pending tokens.
    const int64_t known = std::min(chunks[j].num_tokens, seq.num_pending());
    int64_t drafts = chunks[j].num_tokens - known;
    // A recurrent layer's state is snapshotted after the pending tokens, to go back to on a rejection.
    if (drafts > 0 && recurrent && !cache_.mark_rollback(seq.cache_id, seq.num_computed() + known)) drafts = 0;
    seq.truncate_draft(size_t(drafts));
    auto first = seq.tokens.begin() + seq.num_computed();
    std::vector<int32_t> run(first, first + known);
    run.insert(run.end(), seq.draft.begin(), seq.draft.end());
    parts.push_back({&seq.state, std::move(run)});
    drafted[j] = drafts;
    step_tokens += known + drafts;
    // A row at position p predicts prompt token p + 1.
    all_logits |= seq.wants_prompt_logprobs && seq.num_computed() < seq.prompt_length - 1;
  }
  iteration_tokens_.observe(step_tokens);
  Batch batch = make_batch(parts);
  batch.all_logits = all_logits;
  batch.keep_hidden_states = proposer_ && proposer_->reads_hidden_states();
  for (size_t j = 0; j < chunks.size(); ++j) batch.seqs[j].logits = drafted[j] + 1;
  const bool decode = std::all_of(chunks.begin(), chunks.end(), [](const ScheduledChunk& c) {
    return c.seq->num_computed() >= c.seq->prompt_length;
  });
  timer.batch_ready(decode ? decode_steps_ : prefill_steps_);
  Tensor logits;
  try {
    attach_images(chunks, batch);
    logits = runner_.run(batch);
  } catch (const std::exception& e) {
    // Data parallel: the other groups were in this step's collectives too, and no later step can line up
    // with theirs again; the run cannot go on (Engine ends it).
    if (config_.runner.data_parallel)
      fail("a data-parallel step failed, so the groups cannot step together again: ", e.what());
    // Nothing the user sends can cause this (requests are validated): end the step's choices with
    // "error" rather than take the engine down.
    std::fprintf(stderr, "sparrow: engine step failed: %s\n", e.what());
    for (const ScheduledChunk& chunk : chunks) {
      if (chunk.seq->status == SequenceStatus::Finished) continue;
      RequestOutput event = new_event(*chunk.seq);
      event.finish_reason = "error";
      finish(*chunk.seq, event);
    }
    return true;
  }

  // Commit every chunk without drafts (those with drafts commit what verification keeps); the sequences
  // whose tokens are now all computed draw their next token, one draw per row of logits (a sequence with k
  // drafts has k + 1). The draws of the whole step run at once where the logits are (ops::sample_tokens);
  // the logits come to the host only when someone asks for log-probabilities.
  std::vector<Sequence*> sampled;
  std::vector<int64_t> sampled_drafts;  // each sampled sequence's drafts in this step
  std::vector<size_t> sampled_chunk;    // and its chunk
  std::vector<Sequence*> alive;         // each chunk's sequence, null once it finished in this step
  std::vector<int64_t> rows_kept;       // and the position up to which its rows of the step stand
  for (const ScheduledChunk& chunk : chunks) {
    alive.push_back(chunk.seq);
    rows_kept.push_back(chunk.seq->num_computed());
  }
  std::vector<Sequence*> row_seqs;  // each draw's sequence
  StepDraws step;
  bool wants_logprobs = false;      // (or the rows of probabilistic drafts, verified on the host)
  int64_t next_logit_row = 0;
  for (size_t j = 0; j < chunks.size(); ++j) {
    Sequence& seq = *chunks[j].seq;
    const SeqSlice& slice = batch.seqs[j];
    const int64_t first_row = all_logits ? slice.offset + slice.count - slice.logits : next_logit_row;
    next_logit_row += slice.logits;
    wants_logprobs |= all_logits && seq.wants_prompt_logprobs;
    if (seq.num_computed() < int64_t(seq.tokens.size())) continue;  // a prefill chunk that does not reach the end
    sampled.push_back(&seq);
    sampled_chunk.push_back(j);
    sampled_drafts.push_back(drafted[j]);
    for (int64_t i = 0; i <= drafted[j]; ++i) {
      row_seqs.push_back(&seq);
      step.rows.push_back(first_row + i);
    }
    wants_logprobs |= seq.params().logprobs >= 0 || (drafted[j] > 0 && !seq.draft_probs.empty());
  }
  if (wants_logprobs) step.host_logits = logits.to(Device::Cpu);
  if (all_logits)
    for (size_t j = 0; j < chunks.size(); ++j)
      if (chunks[j].seq->wants_prompt_logprobs) record_prompt_logprobs(*chunks[j].seq, step.host_logits, batch.seqs[j]);
  if (sampled.empty()) {
    end_step(batch, alive, rows_kept, {});
    return true;
  }

  for (size_t i = 0, row = 0; i < sampled.size(); ++i) {
    Sequence& seq = *sampled[i];
    // Row k draws output token num_output + k, after the first k drafts (its penalties count them).
    const size_t before = seq.tokens.size();
    seq.tokens.insert(seq.tokens.end(), seq.draft.begin(), seq.draft.end());
    const std::span<const int32_t> all(seq.tokens);
    for (int64_t k = 0; k <= sampled_drafts[i]; ++k, ++row)
      seq.sampler.prepare(int32_t(row), seq.prompt(),
                          all.subspan(size_t(seq.prompt_length), before - size_t(seq.prompt_length) + size_t(k)),
                          step.draws, step.adjustments);
    seq.tokens.resize(before);
  }
  fill_token_masks(row_seqs, step.mask_rows, step.mask_words);
  step.mask_width = (logits.dim(1) + 31) / 32;
  const bool every_row = int64_t(step.rows.size()) == logits.dim(0);  // rows is ascending
  std::vector<int32_t> tokens =
      ops::sample_tokens(every_row ? logits : ops::select_rows(logits, step.rows), step.draws, step.adjustments,
                         {step.mask_rows, step.mask_words, step.mask_width});
  timer.tokens_sampled();

  const size_t vocab = size_t(logits.dim(1));
  std::vector<Sequence*> decoding;  // the sampled sequences that go on
  size_t masked = 0;  // mask_rows is ascending
  for (size_t i = 0, row = 0; i < sampled.size(); ++i) {
    Sequence& seq = *sampled[i];
    const int64_t drafts = sampled_drafts[i];
    const size_t first = row;
    row += size_t(drafts + 1);
    const std::span<const int32_t> target(tokens.data() + first, size_t(drafts + 1));
    Verdict verdict;
    if (drafts > 0) {
      verdict = verify_drafts(seq, first, target, step);
      rows_kept[sampled_chunk[i]] = settle_verification(seq, drafts, verdict.accepted);
    }
    std::vector<int32_t> emitted(seq.draft.begin(), seq.draft.begin() + verdict.accepted);
    emitted.push_back(verdict.replacement >= 0 ? verdict.replacement : target[size_t(verdict.accepted)]);
    seq.truncate_draft(0);
    bool goes_on = true;
    for (size_t e = 0; e < emitted.size() && goes_on; ++e) {
      const int32_t token = emitted[e];
      const int32_t draw = int32_t(first + e);
      while (masked < step.mask_rows.size() && step.mask_rows[masked] < draw) ++masked;
      if (masked < step.mask_rows.size() && step.mask_rows[masked] == draw) {
        // A token outside the mask is drawn only when every allowed token has logit -inf (or none is left).
        const uint32_t* words = step.mask_words.data() + int64_t(masked) * step.mask_width;
        if (!token_allowed(words, token) || (seq.matcher && !seq.matcher->accept_token(token))) {
          finish_unmatched(seq);
          goes_on = false;
          break;
        }
      }
      std::span<const float> raw;
      if (step.host_logits.defined() && step.host_logits.numel() > 0) raw = {step.host_logits.row(step.rows[first + e]), vocab};
      goes_on = emit(seq, token, raw);
    }
    if (goes_on) decoding.push_back(&seq);
    else alive[sampled_chunk[i]] = nullptr;  // finished: its cache is gone
  }
  end_step(batch, alive, rows_kept, decoding);
  return true;
}

EngineCore::Verdict EngineCore::verify_drafts(const Sequence& seq, size_t first, std::span<const int32_t> target,
                                              const StepDraws& step) const {
  const int64_t drafts = int64_t(target.size()) - 1;
  Verdict verdict;
  if (config_.speculative.synthetic) {
    verdict.accepted = synthetic_accepted(drafts, config_.speculative.synthetic_acceptance_rate,
                                          mix64(seq.sampler.key(seq.num_output()) ^ kSyntheticCoins));
  } else if (!seq.draft_probs.empty()) {
    // Probabilistic drafts: each against the target's distribution at its row, as sampled (penalties, mask).
    const size_t vocab = size_t(step.host_logits.dim(1));
    for (; verdict.accepted < drafts; ++verdict.accepted) {
      const size_t draw = first + size_t(verdict.accepted);
      std::vector<float> row(step.host_logits.row(step.rows[draw]), step.host_logits.row(step.rows[draw]) + vocab);
      cpu::adjust_logits(row.data(), int64_t(vocab), int32_t(draw), step.adjustments);
      auto mask = std::lower_bound(step.mask_rows.begin(), step.mask_rows.end(), int32_t(draw));
      if (mask != step.mask_rows.end() && *mask == int32_t(draw))
        cpu::apply_token_bitmask(row.data(), int64_t(vocab),
                                 step.mask_words.data() + (mask - step.mask_rows.begin()) * step.mask_width);
      const std::vector<double> p = cpu::token_probabilities(row.data(), int64_t(vocab), step.draws[draw]);
      verdict.replacement =
          verify_draft_token(p, {seq.draft_probs.data() + size_t(verdict.accepted) * vocab, vocab},
                             seq.draft[size_t(verdict.accepted)], mix64(step.draws[draw].key ^ kVerifyCoins));
      if (verdict.replacement >= 0) break;
    }
  } else {
    verdict.accepted = accepted_draft_tokens(seq.draft, target);
  }
  return verdict;
}

int64_t EngineCore::settle_verification(Sequence& seq, int64_t drafts, int64_t accepted) {
  ++spec_decode_.drafts;
  spec_decode_.draft_tokens += drafts;
  spec_decode_.accepted_tokens += accepted;
  if (spec_decode_.accepted_by_position.size() < size_t(drafts)) spec_decode_.accepted_by_position.resize(size_t(drafts));
  for (int64_t k = 0; k < accepted; ++k) ++spec_decode_.accepted_by_position[size_t(k)];
  // Keep the rows of the accepted drafts; a recurrent state goes back to before the first draft, and the
  // accepted ones run again next step.
  const int64_t first_draft_at = seq.num_computed() - drafts;
  const int64_t kept = first_draft_at + accepted;
  seq.state.length = kept;  // committed with the emitted tokens, in end_step
  if (cache_.plan().state_slot_bytes > 0 && accepted < drafts) {
    cache_.roll_back(seq.cache_id);
    seq.state.length = first_draft_at;
  }
  return kept;
}

void EngineCore::end_step(const Batch& batch, const std::vector<Sequence*>& alive, const std::vector<int64_t>& rows_kept,
                          const std::vector<Sequence*>& decoding) {
  // A proposer that reads the step (MTP, DSpark) writes its cache rows for the step's positions before the blocks
  // holding them are committed: a block enters the prefix cache whole.
  if (proposer_) proposer_->observe(batch, alive, rows_kept);
  propose_drafts(decoding);
  for (Sequence* seq : alive)
    if (seq) cache_.commit_tokens(seq->cache_id, seq->tokens, seq->num_computed());
}

void EngineCore::propose_drafts(const std::vector<Sequence*>& sampled) {
  if (!proposer_) return;
  const int64_t k = config_.speculative.num_speculative_tokens;
  std::vector<Sequence*> seqs;
  std::vector<int64_t> room;
  for (Sequence* seq : sampled) {
    // A step with d drafts yields up to d + 1 tokens: no more than max_tokens allows, and every position
    // inside max_model_len.
    int64_t most = std::min({k, seq->params().max_tokens - seq->num_output() - 1,
                             config_.max_model_len - int64_t(seq->tokens.size())});
    // Rows the proposer writes ahead (MTP, DSpark) need their blocks now; without them, one draft, or none
    // when even one draft writes ahead (DSpark).
    auto room_for = [&](int64_t drafts) {
      return cache_.allocate(seq->cache_id, int64_t(seq->tokens.size()) - 1 + proposer_->rows_ahead(drafts));
    };
    if (most > 1 && !room_for(most)) most = 1;
    if (most == 1 && proposer_->rows_ahead(1) > 0 && !room_for(1)) most = 0;
    if (most <= 0) continue;
    seqs.push_back(seq);
    room.push_back(most);
  }
  if (seqs.empty()) return;
  proposer_->propose(seqs, room);
  // Synthetic acceptance measures verify steps of k drafts: a proposal cut short is filled up.
  if (config_.speculative.synthetic)
    for (size_t i = 0; i < seqs.size(); ++i)
      while (int64_t(seqs[i]->draft.size()) < room[i])
        seqs[i]->draft.push_back(seqs[i]->draft.empty() ? seqs[i]->tokens.back() : seqs[i]->draft.back());
  // Drafts a structured output (or allowed_token_ids) forbids cannot be accepted: keep those before the first.
  for (Sequence* seq : seqs) {
    if (seq->allowed_tokens) {
      auto refused = std::find_if(seq->draft.begin(), seq->draft.end(),
                                  [&](int32_t t) { return !token_allowed(seq->allowed_tokens->data(), t); });
      seq->truncate_draft(size_t(refused - seq->draft.begin()));
    }
    if (seq->matcher) {
      size_t fits = 0;
      while (fits < seq->draft.size() && seq->matcher->accept_token(seq->draft[fits])) ++fits;
      if (fits) seq->matcher->rollback(int64_t(fits));
      seq->truncate_draft(fits);
    }
  }
}

structured::GrammarCompiler& EngineCore::grammars() const {
  // The vocabulary's byte trie is built for the first request with a structured output, on that request's
  // thread (validate), not when every engine starts: most runs never need it (0.84 s for a 160K
  // vocabulary, bench/results/structured.md).
  std::call_once(grammars_made_, [&] {
    grammars_ = std::make_unique<structured::GrammarCompiler>(
        structured::TokenVocabulary::from_tokenizer(*tokenizer_, int32_t(model_.vocab_size())));
  });
  return *grammars_;
}

void EngineCore::fill_token_masks(const std::vector<Sequence*>& row_seqs, std::vector<int32_t>& rows,
                                  std::vector<uint32_t>& words) const {
  // Filled on this thread after the step's forward pass was launched: on a GPU the masks are computed while
  // it runs (vLLM overlaps them the same way). Sequences in parallel: each matcher is its own, and what they
  // share (the compiled grammar's caches) is locked. A sequence's rows in order: between two, its matcher
  // takes the draft token the first verifies, and afterwards gives them all back.
  const int64_t width = (model_.vocab_size() + 31) / 32;
  std::vector<size_t> seq_begin;  // where each masked sequence's rows begin in `rows`
  for (size_t r = 0; r < row_seqs.size(); ++r) {
    if (!row_seqs[r]->matcher && !row_seqs[r]->allowed_tokens) continue;
    if (rows.empty() || row_seqs[size_t(rows.back())] != row_seqs[r]) seq_begin.push_back(rows.size());
    rows.push_back(int32_t(r));
  }
  seq_begin.push_back(rows.size());
  words.assign(rows.size() * size_t(width), 0u);
  parallel_for(int64_t(seq_begin.size()) - 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      Sequence& seq = *row_seqs[size_t(rows[seq_begin[size_t(s)]])];
      int64_t advanced = 0;
      for (size_t k = seq_begin[size_t(s)]; k < seq_begin[size_t(s) + 1]; ++k) {
        uint32_t* row = words.data() + k * size_t(width);
        if (seq.matcher) {
          // The proposer kept only drafts the grammar takes; should one not be, the rows after it are never
          // read (its own row cannot draw it), and stay empty.
          if (k > seq_begin[size_t(s)]) {
            if (!seq.matcher->accept_token(seq.draft[k - seq_begin[size_t(s)] - 1])) break;
            ++advanced;
          }
          seq.matcher->fill_next_token_bitmask(row);
          if (seq.allowed_tokens)
            for (int64_t w = 0; w < width; ++w) row[w] &= (*seq.allowed_tokens)[size_t(w)];
        } else {
          std::copy(seq.allowed_tokens->begin(), seq.allowed_tokens->end(), row);
        }
      }
      if (advanced) seq.matcher->rollback(advanced);
    }
  });
}

void EngineCore::finish_unmatched(Sequence& seq) {
  RequestOutput event = new_event(seq);
  // The grammar complete (an end token it allowed was held back, e.g. by ignore_eos or min_tokens): the
  // output is whole, "stop"; otherwise no allowed token could be drawn: "abort".
  const bool complete = seq.matcher && seq.matcher->is_terminated();
  event.finish_reason = complete ? "stop" : "abort";
  if (!complete)
    std::fprintf(stderr, "sparrow: request %s choice %lld: no token is allowed by its structured output or "
                 "allowed_token_ids here; the choice ends with finish_reason \"abort\"\n",
                 seq.request.id.c_str(), (long long)seq.index);
  if (seq.detokenizer && !seq.detokenizer->stopped()) event.new_text += seq.detokenizer->finish().text;
  finish(seq, event);
}

void EngineCore::record_prompt_logprobs(Sequence& seq, const Tensor& logits, const SeqSlice& slice) {
  const int64_t start = seq.num_computed() - slice.count;  // the model has advanced the length
  for (int64_t i = 0; i < slice.count && start + i + 1 < seq.prompt_length; ++i) {
    const int64_t next = start + i + 1;
    seq.prompt_logprobs[next] = token_logprob({logits.row(slice.offset + i), size_t(logits.dim(1))},
                                              seq.tokens[next], seq.params().prompt_logprobs);
  }
}

RequestOutput EngineCore::new_event(const Sequence& seq) const {
  RequestOutput event;
  event.request_id = seq.request.id;
  event.index = seq.index;
  event.prompt_tokens = seq.prompt_length;
  event.completion_tokens = seq.num_output();
  event.cached_tokens = seq.cached_tokens;
  event.first_scheduled = seq.first_scheduled;
  return event;
}

bool EngineCore::emit(Sequence& seq, int32_t token, std::span<const float> logits, const TokenLogprob* known) {
  const SamplingParams& p = seq.params();
  if (seq.num_output() == 0) prompt_tokens_total_ += seq.prompt_length;
  ++generation_tokens_total_;
  seq.tokens.push_back(token);

  RequestOutput event = new_event(seq);
  event.new_tokens = {token};
  if (p.logprobs >= 0) event.logprobs.push_back(known ? *known : token_logprob(logits, token, p.logprobs));
  if (seq.wants_prompt_logprobs) {
    event.prompt_logprobs = std::move(seq.prompt_logprobs);
    seq.wants_prompt_logprobs = false;
  }
  // Why it ends, in vLLM's order (check_stop, then the detokenizer's stop strings): an end token once
  // min_tokens exist, a stop string, the length limit.
  const bool stop_token = check_stop_token(seq, token, event);
  if (seq.detokenizer) add_text(seq, token, stop_token, event);
  if (event.finish_reason.empty() &&
      (seq.num_output() >= p.max_tokens || int64_t(seq.tokens.size()) >= config_.max_model_len))
    event.finish_reason = "length";
  // A prefill instance's request ends with its first token, whatever max_tokens says: the decode instance
  // draws the rest (engine/kv_handoff.h).
  if (event.finish_reason.empty() && seq.request.kv_transfer.remote_decode) event.finish_reason = "length";

  if (event.finish_reason.empty()) {
    active_request(seq).on_output(event);
    return true;
  }
  // Text held back as a possible stop string start, or bytes of an unfinished character, come out now.
  if (seq.detokenizer && !seq.detokenizer->stopped()) event.new_text += seq.detokenizer->finish().text;
  finish(seq, event);
  return false;
}

bool EngineCore::check_stop_token(const Sequence& seq, int32_t token, RequestOutput& event) const {
  const SamplingParams& p = seq.params();
  if (seq.num_output() < p.min_tokens) return false;
  if (!p.ignore_eos && contains(end_of_sequence_, token)) {
    event.finish_reason = "stop";
    return true;
  }
  if (contains(p.stop_token_ids, token)) {
    event.finish_reason = "stop";
    event.stop_reason = token;
    return true;
  }
  return false;
}

void EngineCore::add_text(Sequence& seq, int32_t token, bool stop_token, RequestOutput& event) const {
  const SamplingParams& p = seq.params();
  // The end token's own text is not shown (vLLM), nor special tokens when skipped.
  if ((stop_token && !p.include_stop_str_in_output) || (p.skip_special_tokens && tokenizer_->is_special(token)))
    return;
  IncrementalDetokenizer::Delta delta = seq.detokenizer->push(token);
  event.new_text = std::move(delta.text);
  if (delta.stopped && !stop_token) {
    event.finish_reason = "stop";
    event.stop_reason = p.stop[delta.stop_index];
    if (p.include_stop_str_in_output) event.new_text += p.stop[delta.stop_index];
  }
}

EngineCore::ActiveRequest& EngineCore::active_request(const Sequence& seq) { return *requests_.at(seq.request.id); }

void EngineCore::finish(Sequence& seq, RequestOutput& event) {
  ActiveRequest& active = active_request(seq);
  if (seq.request.kv_transfer.active()) hand_off_on_finish(seq, event);
  scheduler_.remove(&seq);
  if (proposer_) proposer_->forget(seq);
  event.finished = true;
  active.on_output(event);
  if (--active.unfinished == 0) {
    const std::string id = active.request.id;  // a copy: erasing destroys the request
    requests_.erase(id);
  }
}

}  // namespace sparrow
