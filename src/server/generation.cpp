#include "server/generation.h"

#include <algorithm>

#include "server/api_error.h"

namespace sparrow::server {

Generation::Generation(Engine& engine, ServerMetrics& metrics, const std::string& id,
                       const std::vector<std::vector<int32_t>>& prompts, const SamplingParams& params,
                       Clock::time_point arrival, std::shared_ptr<const LoraAdapter> lora,
                       std::vector<vision::ImageInput> images, KvTransferRequest kv_transfer)
    : engine_(engine),
      metrics_(metrics),
      arrival_(arrival),
      submitted_(prompts.size(), false),
      choices_(prompts.size() * size_t(params.n)) {
  if (kv_transfer.active() && prompts.size() != 1)
    bad_request("kv_transfer_params: a disaggregated request has one prompt, not " + std::to_string(prompts.size()),
                "kv_transfer_params");
  for (size_t c = 0; c < choices_.size(); ++c)
    choices_[c].prompt_tokens = int64_t(prompts[c / size_t(params.n)].size());
  for (size_t p = 0; p < prompts.size(); ++p) metrics_.observe_request(params.n, params.max_tokens);
  for (size_t p = 0; p < prompts.size(); ++p)
    engine_ids_.push_back(prompts.size() == 1 ? id : id + "-" + std::to_string(p));
  try {
    for (size_t p = 0; p < prompts.size(); ++p) {
      Request request{engine_ids_[p], prompts[p], params, lora};
      if (p == 0) request.images = std::move(images);  // a chat's one prompt
      request.kv_transfer = kv_transfer;
      auto queue = queue_;  // the callback keeps the queue alive, not this object
      int64_t prompt = int64_t(p), n = params.n;
      engine_.submit(std::move(request), [queue, prompt, n](const RequestOutput& output) {
        queue->push(Event{output, prompt, prompt * n + output.index});
      });
      submitted_[p] = true;
    }
  } catch (...) {
    abort();  // the destructor does not run for a half-built object
    throw;
  }
}

Generation::~Generation() {
  if (finished()) return;
  abort();
  // Nobody will read the final events (the client went away): count the unfinished choices here.
  auto now = Clock::now();
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  for (const ChoiceTiming& choice : choices_)
    if (!choice.finished)
      metrics_.observe_finished(seconds(now - arrival_),
                                seconds((choice.first_token ? *choice.first_token : now) - arrival_),
                                choice.prompt_tokens, choice.tokens, "abort");
}

void Generation::abort() {
  for (size_t p = 0; p < engine_ids_.size(); ++p)
    if (submitted_[p]) engine_.abort(engine_ids_[p]);
}

std::optional<Generation::Event> Generation::next() {
  if (finished()) return std::nullopt;
  std::optional<Event> event = queue_->pop();
  if (event) record(*event);
  return event;
}

void Generation::record(const Event& event) {
  ChoiceTiming& choice = choices_.at(size_t(event.choice));
  const RequestOutput& out = event.output;
  auto now = Clock::now();
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  if (out.first_scheduled && !choice.first_scheduled) choice.first_scheduled = out.first_scheduled;
  if (!out.new_tokens.empty()) {
    if (!choice.first_token) {
      choice.first_token = now;
      metrics_.observe_time_to_first_token(seconds(now - arrival_));
    } else {
      metrics_.observe_inter_token_latency(seconds(now - *choice.last_token));
    }
    choice.last_token = now;
    choice.tokens += int64_t(out.new_tokens.size());
  }
  if (out.finished && !choice.finished) {
    choice.finished = true;
    ++finished_choices_;
    double first = choice.first_token ? seconds(*choice.first_token - arrival_) : seconds(now - arrival_);
    metrics_.observe_finished(seconds(now - arrival_), first, choice.prompt_tokens, choice.tokens, out.finish_reason);
    if (choice.first_scheduled && choice.first_token)
      metrics_.observe_phases(seconds(*choice.first_scheduled - arrival_), seconds(*choice.first_token - *choice.first_scheduled),
                              seconds(now - *choice.first_token), seconds(now - *choice.first_scheduled));
    if (finished()) {
      int64_t most = 0;
      for (const ChoiceTiming& c : choices_) most = std::max(most, c.tokens);
      metrics_.observe_max_generation_tokens(most);
    }
  }
}

}  // namespace sparrow::server
