#include "engine/engine_core.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "runner/memory_profile.h"

namespace sparrow {

namespace {

// The cache the engine runs on: one state slot per running sequence, on the model's device.
CacheConfig engine_cache_config(CacheConfig cache, int64_t max_num_seqs, Device device) {
  cache.max_num_seqs = max_num_seqs;
  cache.device = device;
  return cache;
}

bool contains(const std::vector<int32_t>& ids, int32_t id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

}  // namespace

EngineCore::EngineCore(Model& model, const Tokenizer* tokenizer, EngineConfig config)
    : model_(model),
      runner_(model, config.runner),
      tokenizer_(tokenizer),
      config_(std::move(config)),
      cache_(model.cache_spec(), engine_cache_config(config_.cache, config_.max_num_seqs, model.device())),
      scheduler_(cache_, SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens}) {
  SPARROW_CHECK(config_.max_model_len > 0, "max_model_len must be set, got ", config_.max_model_len);
  SPARROW_CHECK(config_.max_model_len <= cache_.plan().max_tokens(), "the KV cache holds ",
                cache_.plan().max_tokens(), " tokens, fewer than max_model_len (", config_.max_model_len,
                "): give it more memory or lower max_model_len");
  end_of_sequence_ = config_.eos_token_ids;
  if (end_of_sequence_.empty() && tokenizer_ && tokenizer_->eos_id()) end_of_sequence_.push_back(*tokenizer_->eos_id());
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
}

void EngineCore::add(Request request, OutputCallback on_output) {
  validate(request);
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
    scheduler_.add(active->choices.back().get());
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
    return run_dummy_step(runner_, cache_, per_sequence, config_.max_num_batched_tokens, config_.max_num_seqs);
  } catch (const std::exception& e) {
    fail("a full engine step (", config_.max_num_batched_tokens, " tokens in sequences of at most ", per_sequence,
         ") does not run beside the KV cache: ", e.what(), "; give the cache less memory (--kv-cache-memory, "
         "--gpu-memory-utilization) or lower --max-num-batched-tokens");
  }
}

bool EngineCore::step() {
  StepTimer timer;
  const std::vector<ScheduledChunk> chunks = scheduler_.schedule();
  if (chunks.empty()) return false;

  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
  bool all_logits = false;
  int64_t step_tokens = 0;
  const auto scheduled_at = std::chrono::steady_clock::now();
  for (const ScheduledChunk& chunk : chunks) {
    Sequence& seq = *chunk.seq;
    if (!seq.first_scheduled) seq.first_scheduled = scheduled_at;
    step_tokens += chunk.num_tokens;
    auto first = seq.tokens.begin() + seq.num_computed();
    parts.push_back({&seq.state, std::vector<int32_t>(first, first + chunk.num_tokens)});
    // A row at position p predicts prompt token p + 1.
    all_logits |= seq.wants_prompt_logprobs && seq.num_computed() < seq.prompt_length - 1;
  }
  iteration_tokens_.observe(step_tokens);
  Batch batch = make_batch(parts);
  batch.all_logits = all_logits;
  const bool decode = std::all_of(chunks.begin(), chunks.end(), [](const ScheduledChunk& c) {
    return c.num_tokens == 1 && c.seq->num_computed() >= c.seq->prompt_length;
  });
  timer.batch_ready(decode ? decode_steps_ : prefill_steps_);
  Tensor logits;
  try {
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

  // Commit every chunk; the sequences whose tokens are now all computed draw their next token. The
  // draws of the whole step run at once where the logits are (ops::sample_tokens); the logits come to
  // the host only when someone asks for log-probabilities.
  std::vector<Sequence*> sampled;
  std::vector<int64_t> sampled_rows;
  bool wants_logprobs = false;
  for (size_t j = 0; j < chunks.size(); ++j) {
    Sequence& seq = *chunks[j].seq;
    const SeqSlice& slice = batch.seqs[j];
    cache_.commit_tokens(seq.cache_id, seq.tokens, seq.num_computed());
    wants_logprobs |= all_logits && seq.wants_prompt_logprobs;
    if (seq.num_pending() > 0) continue;  // a prefill chunk that does not reach the end yet
    sampled.push_back(&seq);
    sampled_rows.push_back(all_logits ? slice.offset + slice.count - 1 : int64_t(j));
    wants_logprobs |= seq.params().logprobs >= 0;
  }
  const Tensor host_logits = wants_logprobs ? logits.to(Device::Cpu) : Tensor();
  if (all_logits)
    for (size_t j = 0; j < chunks.size(); ++j)
      if (chunks[j].seq->wants_prompt_logprobs) record_prompt_logprobs(*chunks[j].seq, host_logits, batch.seqs[j]);
  if (sampled.empty()) return true;

  std::vector<TokenDraw> draws;
  std::vector<LogitAdjustment> adjustments;
  for (size_t i = 0; i < sampled.size(); ++i)
    sampled[i]->sampler.prepare(int32_t(i), sampled[i]->prompt(), sampled[i]->output(), draws, adjustments);
  std::vector<int32_t> mask_rows;
  std::vector<uint32_t> mask_words;
  fill_token_masks(sampled, mask_rows, mask_words);
  const int64_t mask_width = (logits.dim(1) + 31) / 32;
  const bool every_row = int64_t(sampled.size()) == logits.dim(0);  // decode: the rows are the sequences
  std::vector<int32_t> tokens =
      ops::sample_tokens(every_row ? logits : ops::select_rows(logits, sampled_rows), draws, adjustments,
                         {mask_rows, mask_words, mask_width});
  timer.tokens_sampled();
  const size_t vocab = size_t(logits.dim(1));
  size_t masked = 0;  // mask_rows is ascending
  for (size_t i = 0; i < sampled.size(); ++i) {
    Sequence& seq = *sampled[i];
    if (masked < mask_rows.size() && mask_rows[masked] == int32_t(i)) {
      // A token outside the mask is drawn only when every allowed token has logit -inf (or none is left).
      const uint32_t* words = mask_words.data() + int64_t(masked++) * mask_width;
      if (!token_allowed(words, tokens[i]) || (seq.matcher && !seq.matcher->accept_token(tokens[i]))) {
        finish_unmatched(seq);
        continue;
      }
    }
    std::span<const float> raw;
    if (host_logits.defined() && host_logits.numel() > 0) raw = {host_logits.row(sampled_rows[i]), vocab};
    emit(seq, tokens[i], raw);
  }
  return true;
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

void EngineCore::fill_token_masks(const std::vector<Sequence*>& sampled, std::vector<int32_t>& rows,
                                  std::vector<uint32_t>& words) const {
  // Filled on this thread after the step's forward pass was launched: on a GPU the masks are computed while
  // it runs (vLLM overlaps them the same way). Rows in parallel: each matcher is its own, and what they
  // share (the compiled grammar's caches) is locked.
  const int64_t width = (model_.vocab_size() + 31) / 32;
  for (size_t i = 0; i < sampled.size(); ++i)
    if (sampled[i]->matcher || sampled[i]->allowed_tokens) rows.push_back(int32_t(i));
  words.assign(rows.size() * size_t(width), 0u);
  parallel_for(int64_t(rows.size()), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Sequence& seq = *sampled[size_t(rows[size_t(k)])];
      uint32_t* row = words.data() + k * width;
      if (seq.matcher) {
        seq.matcher->fill_next_token_bitmask(row);
        if (seq.allowed_tokens)
          for (int64_t w = 0; w < width; ++w) row[w] &= (*seq.allowed_tokens)[size_t(w)];
      } else {
        std::copy(seq.allowed_tokens->begin(), seq.allowed_tokens->end(), row);
      }
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

void EngineCore::emit(Sequence& seq, int32_t token, std::span<const float> logits) {
  const SamplingParams& p = seq.params();
  if (seq.num_output() == 0) prompt_tokens_total_ += seq.prompt_length;
  ++generation_tokens_total_;
  seq.tokens.push_back(token);

  RequestOutput event = new_event(seq);
  event.new_tokens = {token};
  if (p.logprobs >= 0) event.logprobs.push_back(token_logprob(logits, token, p.logprobs));
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

  if (event.finish_reason.empty()) {
    active_request(seq).on_output(event);
    return;
  }
  // Text held back as a possible stop string start, or bytes of an unfinished character, come out now.
  if (seq.detokenizer && !seq.detokenizer->stopped()) event.new_text += seq.detokenizer->finish().text;
  finish(seq, event);
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
  scheduler_.remove(&seq);
  event.finished = true;
  active.on_output(event);
  if (--active.unfinished == 0) {
    const std::string id = active.request.id;  // a copy: erasing destroys the request
    requests_.erase(id);
  }
}

}  // namespace sparrow
