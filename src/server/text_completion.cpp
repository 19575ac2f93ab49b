// POST /v1/completions: prompts are text or token ids (one, or a list); each prompt is one engine
// request with n choices, numbered prompt * n + i as vLLM does. Shapes follow vLLM's
// completion/serving.py: "object": "text_completion", legacy logprobs
// {tokens, token_logprobs, top_logprobs, text_offset}, and in a stream a chunk per event, the last
// one per choice with finish_reason, then the usage chunk ("choices": []) if asked for, then [DONE].
#include "core/error.h"
#include "server/api_error.h"
#include "server/kv_transfer_params.h"
#include "server/openai_requests.h"
#include "server/openai_responses.h"
#include "server/serving.h"

namespace sparrow::server {
namespace {


struct TextChoice {
  std::string text;  // with the echoed prompt in front when echo is set
  CompletionLogprobs logprobs;
  int64_t text_offset = 0;
  std::vector<int32_t> token_ids;
  int64_t completion_tokens = 0;
  std::string finish_reason;
  Json stop_reason = nullptr;
};

class TextCompletion : public CompletionJob {
 public:
  TextCompletion(const Json& body, ServingContext& context, Clock::time_point arrival)
      : context_(context), id_(random_id("cmpl-")), created_(unix_time()) {
    const ServingOptions& options = context.options;
    request_ =
        parse_completion_request(body, options.default_sampling, options.max_logprobs, options.max_prompts_per_request);
    lora_ = context.check_model(request_.model);
    if (!request_.request_id.empty()) id_ = "cmpl-" + request_.request_id;
    if (request_.logprobs) context.require_tokenizer();

    SamplingParams params = request_.sampling;
    const int64_t vocab = context.engine.model().vocab_size();
    for (const Prompt& prompt : request_.prompts) {
      std::vector<int32_t> ids;
      std::string text;
      if (const auto* given = std::get_if<std::string>(&prompt)) {
        const Tokenizer& tokenizer = context.require_tokenizer();
        text = *given;
        ids = request_.add_special_tokens ? tokenizer.encode_with_special_tokens(text) : tokenizer.encode(text);
      } else {
        ids = std::get<std::vector<int32_t>>(prompt);
        for (int32_t id : ids)
          if (id >= vocab)
            bad_request("token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(vocab) + ")",
                        "prompt");
        if (request_.echo && context.tokenizer) text = context.tokenizer->decode(ids);
      }
      if (request_.truncate_prompt_tokens && int64_t(ids.size()) > *request_.truncate_prompt_tokens)
        ids.erase(ids.begin(), ids.end() - *request_.truncate_prompt_tokens);
      fit_to_context(int64_t(ids.size()), request_.max_tokens, "prompt", context, params);
      prompt_tokens_ += int64_t(ids.size());
      for (int64_t i = 0; i < params.n; ++i) {
        TextChoice choice;
        if (request_.echo) choice.text = text;
        choice.text_offset = character_count(choice.text);
        echoed_.push_back(request_.echo ? text : "");
        choices_.push_back(std::move(choice));
      }
      prompts_.push_back(std::move(ids));
    }
    context.assign_seed(params);
    generation_.emplace(context.engine, context.metrics, engine_request_id(request_.request_id, id_), prompts_, params, arrival,
                        lora_, std::vector<vision::ImageInput>{}, request_.kv_transfer);
  }

  Generation& generation() override { return *generation_; }
  bool streaming() const override { return request_.stream; }
  const std::string& id() const override { return id_; }

  std::string stream_start() override {
    std::string out;
    for (size_t i = 0; i < choices_.size(); ++i)
      if (!echoed_[i].empty()) out += sse_event(chunk_json(choice_json(i, echoed_[i], nullptr, nullptr)));
    return out;
  }

  std::string on_event(const Generation::Event& event) override {
    TextChoice& choice = choices_.at(size_t(event.choice));
    const RequestOutput& out = event.output;
    choice.text += out.new_text;
    choice.completion_tokens += int64_t(out.new_tokens.size());
    choice.token_ids.insert(choice.token_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
    CompletionLogprobs delta_logprobs;
    if (request_.logprobs) {
      int64_t offset = choice.text_offset;
      delta_logprobs.append(*context_.tokenizer, out.logprobs, offset);
      choice.logprobs.append(*context_.tokenizer, out.logprobs, choice.text_offset);
    }
    if (!out.prompt_logprobs.empty() && context_.tokenizer)
      prompt_logprobs_[event.prompt] = prompt_logprobs_json(*context_.tokenizer, out.prompt_logprobs);
    if (out.finished) {
      choice.finish_reason = out.finish_reason;
      if (out.stop_reason) choice.stop_reason = std::visit([](const auto& v) { return Json(v); }, *out.stop_reason);
    }
    cached_tokens_ = std::max(cached_tokens_, out.cached_tokens);
    if (out.kv_handoff) kv_transfer_params_ = kv_transfer_params_json(*out.kv_handoff);
    if (out.finish_reason == "error") return engine_failed();
    if (!request_.stream || (out.new_text.empty() && out.new_tokens.empty() && !out.finished)) return "";

    Json logprobs = request_.logprobs ? delta_logprobs.json() : Json(nullptr);
    Json c = choice_json(size_t(event.choice), out.new_text, std::move(logprobs),
                         out.finished ? Json(choice.finish_reason) : Json(nullptr));
    if (out.finished) c["stop_reason"] = choice.stop_reason;
    if (request_.return_token_ids) c["token_ids"] = out.new_tokens;
    Json chunk = chunk_json(std::move(c));
    if (request_.stream_options.continuous_usage_stats)
      chunk["usage"] = usage_json(Usage(int64_t(prompts_[size_t(event.prompt)].size()), choice.completion_tokens));
    return sse_event(chunk);
  }

  std::string stream_end() override {
    return stream_tail(request_.stream_options.include_usage, chunk_json(nullptr), usage_json(usage()));
  }

  Json response() override {
    if (failed_) return error_body(500, kEngineFailed);
    Json choices = Json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const TextChoice& c = choices_[i];
      Json logprobs = request_.logprobs ? c.logprobs.json() : Json(nullptr);
      Json choice = choice_json(i, c.text, std::move(logprobs), c.finish_reason);
      choice["stop_reason"] = c.stop_reason;
      size_t prompt = i / choices_per_prompt();
      if (prompt_logprobs_.count(int64_t(prompt))) choice["prompt_logprobs"] = prompt_logprobs_.at(int64_t(prompt));
      if (request_.return_token_ids) {
        choice["prompt_token_ids"] = prompts_[prompt];
        choice["token_ids"] = c.token_ids;
      }
      choices.push_back(std::move(choice));
    }
    Json body = {{"id", id_},
                 {"object", "text_completion"},
                 {"created", created_},
                 {"model", context_.response_model(lora_)},
                 {"choices", std::move(choices)},
                 {"usage", usage_json(usage())}};
    if (!kv_transfer_params_.is_null()) body["kv_transfer_params"] = kv_transfer_params_;
    return body;
  }

 private:
  size_t choices_per_prompt() const { return choices_.size() / prompts_.size(); }

  static Json choice_json(size_t index, const std::string& text, Json logprobs, Json finish_reason) {
    Json c = {{"index", index}, {"text", text}};
    c["logprobs"] = std::move(logprobs);
    c["finish_reason"] = std::move(finish_reason);
    c["stop_reason"] = nullptr;
    return c;
  }

  Json chunk_json(Json choice) const {
    Json chunk = {{"id", id_}, {"object", "text_completion"}, {"created", created_}, {"model", context_.response_model(lora_)}};
    chunk["choices"] = choice.is_null() ? Json::array() : Json::array({std::move(choice)});
    return chunk;
  }

  Usage usage() const {
    Usage u(prompt_tokens_, 0);
    for (const TextChoice& c : choices_) u.completion_tokens += c.completion_tokens;
    if (context_.options.enable_prompt_tokens_details) u.cached_tokens = cached_tokens_;
    return u;
  }

  std::string engine_failed() {
    failed_ = true;
    return engine_failure_event(request_.stream);
  }

  ServingContext& context_;
  bool failed_ = false;
  std::string id_;
  int64_t created_;
  CompletionRequest request_;
  std::shared_ptr<const LoraAdapter> lora_;  // the adapter the request named (null: the base model)
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::string> echoed_;  // per choice: the prompt text echoed in front of it
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0;
  std::map<int64_t, Json> prompt_logprobs_;  // per prompt
  std::vector<TextChoice> choices_;
  Json kv_transfer_params_;  // a prefill instance's handoff (server/kv_transfer_params.h); null otherwise
  std::optional<Generation> generation_;  // last: destroyed first, aborting what still runs
};

}  // namespace

std::unique_ptr<CompletionJob> start_text_completion(const Json& body, ServingContext& context,
                                                     Clock::time_point arrival) {
  return std::make_unique<TextCompletion>(body, context, arrival);
}

}  // namespace sparrow::server
