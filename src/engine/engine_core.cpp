#include "engine/engine_core.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "kernels/ops.h"
#if SPARROW_HAVE_CUDA
#include "kernels/cuda/runtime/device.h"
#endif

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
  for (int64_t i = 0; i < p.n; ++i) {
    active->choices.push_back(std::make_unique<Sequence>(active->request, i, end_tokens, tokenizer_));
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
  return s;
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

// One forward pass of `total` prompt tokens in sequences of at most `per_sequence` (and at most `max_seqs`
// of them), then the draw of each sequence's next token, on `cache`; every sequence is freed again without
// committing its tokens (no prefix-cache entries). Returns the tokens run; rethrows the forward's error
// after freeing.
int64_t run_dummy_step(Model& model, KvCache& cache, int64_t per_sequence, int64_t total, int64_t max_seqs) {
  std::vector<SeqId> ids;
  std::vector<SequenceState> states;
  states.reserve(size_t(std::max<int64_t>(max_seqs, 0)));  // `parts` points into it
  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
  int64_t tokens = 0;
  while (tokens < total && int64_t(ids.size()) < max_seqs && cache.num_free_state_slots() > 0) {
    const int64_t n = std::min(per_sequence, total - tokens);
    const SeqId id = cache.create_sequence();
    ids.push_back(id);
    if (!cache.allocate(id, n)) break;  // a cache this small serves shorter steps only; run what fits
    states.emplace_back();
    states.back().cache = cache.view(id);
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) prompt[size_t(i)] = int32_t((tokens + i) * 7919 % model.vocab_size());
    parts.push_back({&states.back(), std::move(prompt)});
    tokens += n;
  }
  try {
    if (!parts.empty()) {
      Batch batch = make_batch(parts);
      batch.all_logits = false;
      const Tensor logits = model.forward(batch);
      std::vector<TokenDraw> draws(parts.size());
      ops::sample_tokens(logits, draws, {});
    }
  } catch (...) {
    for (SeqId id : ids) cache.free_sequence(id);
    throw;
  }
  for (SeqId id : ids) cache.free_sequence(id);
  return parts.empty() ? 0 : tokens;
}

}  // namespace

int64_t EngineCore::warm_up() {
  const int64_t per_sequence = std::min(config_.max_model_len, config_.max_num_batched_tokens);
  try {
    return run_dummy_step(model_, cache_, per_sequence, config_.max_num_batched_tokens, config_.max_num_seqs);
  } catch (const std::exception& e) {
    fail("a full engine step (", config_.max_num_batched_tokens, " tokens in sequences of at most ", per_sequence,
         ") does not run beside the KV cache: ", e.what(), "; give the cache less memory (--kv-cache-memory, "
         "--gpu-memory-utilization) or lower --max-num-batched-tokens");
  }
}

CacheConfig dummy_step_cache_config(const Model& model, const EngineConfig& config, int64_t per_sequence,
                                    int64_t total) {
  const int64_t sequences = std::min(config.max_num_seqs, (total + per_sequence - 1) / per_sequence);
  CacheConfig cache = engine_cache_config(config.cache, sequences, model.device());
  cache.enable_prefix_caching = false;  // no snapshot slots: the step commits nothing
  cache.memory_bytes = int64_t(1) << 30;  // any budget: the plan's row and slot sizes do not depend on it
  const CachePlan plan = plan_cache(model.cache_spec(), cache);
  const int64_t block = plan.block_size;
  const int64_t rows = (total / per_sequence) * ((per_sequence + block - 1) / block) +
                       ((total % per_sequence) + block - 1) / block;
  cache.memory_bytes = rows * plan.row_bytes + plan.num_state_slots * plan.state_slot_bytes;
  return cache;
}

int64_t gpu_kv_cache_budget(double utilization, int64_t total_bytes, int64_t in_use_bytes, int64_t step_bytes,
                            int64_t graph_step_bytes) {
  SPARROW_CHECK(utilization > 0 && utilization <= 1, "--gpu-memory-utilization must be in (0, 1], got ", utilization);
  const int64_t budget = int64_t(utilization * double(total_bytes)) - in_use_bytes - step_bytes - graph_step_bytes;
  const auto gib = [](int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", double(bytes) / double(int64_t(1) << 30));
    return std::string(text);
  };
  SPARROW_CHECK(budget > 0, "--gpu-memory-utilization ", utilization, " leaves nothing for the KV cache: of the GPU's ",
                gib(total_bytes), " (", gib(int64_t(utilization * double(total_bytes))), " allowed) the weights and the "
                "CUDA context hold ", gib(in_use_bytes), ", a full step's scratch takes ", gib(step_bytes),
                " and a decode step's in the CUDA graphs ", gib(graph_step_bytes),
                ": raise it, lower --max-num-batched-tokens or --max-num-seqs, or give --kv-cache-memory");
  return budget;
}

int64_t gpu_kv_cache_bytes(Model& model, const EngineConfig& config, double utilization) {
#if SPARROW_HAVE_CUDA
  SPARROW_CHECK(model.device() != Device::Cpu, "gpu_kv_cache_bytes: the model is on the CPU");
  // A step's scratch: the pool's peak while it runs in a cache just large enough, less what was live before.
  const auto scratch_of = [&](int64_t per_sequence, int64_t total) {
    KvCache cache(model.cache_spec(), dummy_step_cache_config(model, config, per_sequence, total));
    const int64_t with_cache = int64_t(cuda::device_bytes_in_use());
    cuda::reset_device_peak();
    run_dummy_step(model, cache, per_sequence, total, config.max_num_seqs);
    return int64_t(cuda::device_peak_bytes()) - with_cache;
  };
  int64_t step = 0, graph_step = 0;
  try {
    step = scratch_of(std::min(config.max_model_len, config.max_num_batched_tokens), config.max_num_batched_tokens);
    graph_step = scratch_of(1, std::min(config.max_num_seqs, config.max_num_batched_tokens));
  } catch (const std::exception& e) {
    fail("sizing the KV cache (--gpu-memory-utilization): a full engine step does not run beside the weights: ", e.what(),
         "; lower --max-num-batched-tokens");
  }
  cuda::release_cached_memory();  // the steps' blocks: counted in `step`, not in what the driver reports in use
  size_t free_bytes = 0, total_bytes = 0;
  cuda::device_memory_info(free_bytes, total_bytes);
  return gpu_kv_cache_budget(utilization, int64_t(total_bytes), int64_t(total_bytes - free_bytes), step, graph_step);
#else
  (void)model, (void)config, (void)utilization;
  fail("--gpu-memory-utilization on a GPU in a build without the CUDA backend");
#endif
}

bool EngineCore::step() {
  StepTimer timer;
  const std::vector<ScheduledChunk> chunks = scheduler_.schedule();
  if (chunks.empty()) return false;

  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
  bool all_logits = false;
  for (const ScheduledChunk& chunk : chunks) {
    Sequence& seq = *chunk.seq;
    auto first = seq.tokens.begin() + seq.num_computed();
    parts.push_back({&seq.state, std::vector<int32_t>(first, first + chunk.num_tokens)});
    // A row at position p predicts prompt token p + 1.
    all_logits |= seq.wants_prompt_logprobs && seq.num_computed() < seq.prompt_length - 1;
  }
  Batch batch = make_batch(parts);
  batch.all_logits = all_logits;
  const bool decode = std::all_of(chunks.begin(), chunks.end(), [](const ScheduledChunk& c) {
    return c.num_tokens == 1 && c.seq->num_computed() >= c.seq->prompt_length;
  });
  timer.batch_ready(decode ? decode_steps_ : prefill_steps_);
  Tensor logits;
  try {
    logits = model_.forward(batch);
  } catch (const std::exception& e) {
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
  const bool every_row = int64_t(sampled.size()) == logits.dim(0);  // decode: the rows are the sequences
  std::vector<int32_t> tokens =
      ops::sample_tokens(every_row ? logits : ops::select_rows(logits, sampled_rows), draws, adjustments);
  timer.tokens_sampled();
  const size_t vocab = size_t(logits.dim(1));
  for (size_t i = 0; i < sampled.size(); ++i) {
    std::span<const float> raw;
    if (host_logits.defined() && host_logits.numel() > 0) raw = {host_logits.row(sampled_rows[i]), vocab};
    emit(*sampled[i], tokens[i], raw);
  }
  return true;
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
