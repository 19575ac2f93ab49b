// POST /v1/chat/completions: render the messages with the model's chat template, generate, and split
// the output into reasoning, content and tool calls with the configured parsers
// (server/parsers/parser.h). Response and chunk shapes follow vLLM's chat_completion/serving.py:
//   stream:  a role chunk per choice ({"role": "assistant", "content": ""}), with `echo` a chunk per
//            choice with the echoed final assistant message ({"content": ...}), then chunks whose delta
//            holds only what changed (content / reasoning / tool_calls), the last one per choice with
//            finish_reason and stop_reason, then (stream_options.include_usage) a chunk with
//            "choices": [] and the usage, then [DONE].
//   echo: the last message, when it is the assistant's (continue_final_message), is put in front of
//   each choice's content (openai_requests.cpp parse_chat_request).
//   finish_reason is "tool_calls" when tool calls were returned for tool_choice auto or required
//   ("stop" for a named tool_choice, as vLLM).
// The prompt, the sampling parameters (a forced tool call, a structured output after the reasoning)
// and the parsers come from ChatPrompt (chat_prompt.h), which /v1/responses shares.
#include "core/error.h"
#include "server/api_error.h"
#include "server/kv_transfer_params.h"
#include "server/chat_output.h"
#include "server/chat_prompt.h"
#include "server/openai_requests.h"
#include "server/openai_responses.h"
#include "server/serving.h"

namespace sparrow::server {
namespace {


struct ChatChoice {
  explicit ChatChoice(ChatChoiceOutput output) : output(std::move(output)) {}
  ChatChoiceOutput output;
  std::vector<TokenLogprob> logprobs;         // all of them (non-streaming)
  std::vector<TokenLogprob> unsent_logprobs;  // streaming: not yet attached to a chunk
  std::vector<int32_t> token_ids, unsent_token_ids;
  int64_t completion_tokens = 0;
  std::string finish_reason;
  Json stop_reason = nullptr;
};

Json stop_reason_json(const RequestOutput& out) {
  if (!out.stop_reason) return nullptr;
  return std::visit([](const auto& v) { return Json(v); }, *out.stop_reason);
}

class ChatCompletion : public CompletionJob {
 public:
  ChatCompletion(const Json& body, ServingContext& context, Clock::time_point arrival)
      : context_(context), id_(random_id("chatcmpl-")), created_(unix_time()) {
    request_ = parse_chat_request(body, context.options.default_sampling, context.options.max_logprobs);
    lora_ = context.check_model(request_.model);
    if (!request_.request_id.empty()) id_ = "chatcmpl-" + request_.request_id;
    prompt_.emplace(request_, context);
    prompt_tokens_ = int64_t(prompt_->ids().size());
    parse_tools_ = prompt_->parses_tools();
    parse_reasoning_ = prompt_->parses_reasoning();
    const SamplingParams& params = prompt_->params();
    for (int64_t i = 0; i < params.n; ++i) choices_.push_back(ChatChoice(prompt_->new_output()));
    generation_.emplace(context.engine, context.metrics, engine_request_id(request_.request_id, id_),
                        std::vector<std::vector<int32_t>>{prompt_->ids()}, params, arrival, lora_, prompt_->images(),
                        request_.kv_transfer);
  }

  Generation& generation() override { return *generation_; }
  bool streaming() const override { return request_.stream; }
  const std::string& id() const override { return id_; }

  std::string stream_start() override {
    std::string out;
    for (size_t i = 0; i < choices_.size(); ++i) {
      Json choice = {{"index", i},
                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                     {"logprobs", nullptr},
                     {"finish_reason", nullptr}};
      Json chunk = chunk_json(std::move(choice));
      if (request_.return_token_ids && i == 0) chunk["prompt_token_ids"] = prompt_->ids();
      if (request_.stream_options.continuous_usage_stats) chunk["usage"] = usage_json(Usage(prompt_tokens_, 0));
      out += sse_event(chunk);
    }
    // echo: then a chunk per choice with the echoed text, as vLLM streams it.
    for (size_t i = 0; i < choices_.size() && !request_.echo_text.empty(); ++i) {
      Json chunk = chunk_json({{"index", i},
                               {"delta", {{"content", request_.echo_text}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}});
      if (request_.stream_options.continuous_usage_stats) chunk["usage"] = usage_json(Usage(prompt_tokens_, 0));
      out += sse_event(chunk);
    }
    return out;
  }

  std::string on_event(const Generation::Event& event) override {
    ChatChoice& choice = choices_.at(size_t(event.choice));
    const RequestOutput& out = event.output;
    parsers::OutputDelta delta = choice.output.feed(out.new_text, int64_t(out.new_tokens.size()), out.finished);
    record(choice, out);
    if (out.finish_reason == "error") return engine_failed();
    if (!request_.stream) return "";
    // A step's tokens get a chunk even when their text is empty (an incomplete UTF-8 sequence held back),
    // as vLLM streams them, so clients can time every token; a tool or reasoning parser holding text
    // back has nothing to say yet.
    const bool held_by_parser = parse_tools_ || parse_reasoning_;
    if (delta.empty() && !out.finished && (held_by_parser || out.new_tokens.empty())) return "";

    Json delta_body = delta_json(delta);
    if (delta_body.empty() && !out.finished) delta_body["content"] = "";
    Json choice_json = {{"index", event.choice}, {"delta", std::move(delta_body)}};
    choice_json["logprobs"] = nullptr;
    if (request_.logprobs) {
      choice_json["logprobs"] = {{"content", chat_logprob_entries(*context_.tokenizer, choice.unsent_logprobs)}};
      choice.unsent_logprobs.clear();
    }
    choice_json["finish_reason"] = out.finished ? Json(choice.finish_reason) : Json(nullptr);
    if (out.finished) choice_json["stop_reason"] = choice.stop_reason;
    if (request_.return_token_ids) {
      choice_json["token_ids"] = choice.unsent_token_ids;
      choice.unsent_token_ids.clear();
    }
    Json chunk = chunk_json(std::move(choice_json));
    if (request_.stream_options.continuous_usage_stats)
      chunk["usage"] = usage_json(Usage(prompt_tokens_, choice.completion_tokens));
    return sse_event(chunk);
  }

  std::string stream_end() override {
    return stream_tail(request_.stream_options.include_usage, chunk_json(nullptr), usage_json(usage()));
  }

  Json response() override {
    if (failed_) return error_body(500, kEngineFailed);
    Json choices = Json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const ChatChoice& c = choices_[i];
      Json message = message_json(c.output.joined(), parse_reasoning_);
      if (!request_.echo_text.empty())
        message["content"] = request_.echo_text + (message["content"].is_string() ? message["content"].get<std::string>() : "");
      Json choice = {{"index", i}, {"message", std::move(message)}};
      choice["logprobs"] =
          request_.logprobs ? Json{{"content", chat_logprob_entries(*context_.tokenizer, c.logprobs)}} : Json(nullptr);
      choice["finish_reason"] = c.finish_reason;
      choice["stop_reason"] = c.stop_reason;
      if (request_.return_token_ids) choice["token_ids"] = c.token_ids;
      choices.push_back(std::move(choice));
    }
    Json body = {{"id", id_},
                 {"object", "chat.completion"},
                 {"created", created_},
                 {"model", context_.response_model(lora_)},
                 {"choices", std::move(choices)},
                 {"usage", usage_json(usage())}};
    if (!prompt_logprobs_.is_null()) body["prompt_logprobs"] = prompt_logprobs_;
    if (request_.return_token_ids) body["prompt_token_ids"] = prompt_->ids();
    if (!kv_transfer_params_.is_null()) body["kv_transfer_params"] = kv_transfer_params_;
    return body;
  }

 private:
  // Token counts, logprobs and ids of one event; the finish reason of the last.
  void record(ChatChoice& choice, const RequestOutput& out) {
    choice.completion_tokens += int64_t(out.new_tokens.size());
    choice.token_ids.insert(choice.token_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
    choice.unsent_token_ids.insert(choice.unsent_token_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
    choice.logprobs.insert(choice.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
    choice.unsent_logprobs.insert(choice.unsent_logprobs.end(), out.logprobs.begin(), out.logprobs.end());
    if (!out.prompt_logprobs.empty() && context_.tokenizer)
      prompt_logprobs_ = prompt_logprobs_json(*context_.tokenizer, out.prompt_logprobs);
    cached_tokens_ = std::max(cached_tokens_, out.cached_tokens);
    if (out.kv_handoff) kv_transfer_params_ = kv_transfer_params_json(*out.kv_handoff);
    if (out.finished) {
      choice.finish_reason = choice.output.finish_reason(out.finish_reason);
      choice.stop_reason = stop_reason_json(out);
    }
  }

  Usage usage() const {
    Usage u(prompt_tokens_, 0);
    for (const ChatChoice& c : choices_) u.completion_tokens += c.completion_tokens;
    if (context_.options.enable_prompt_tokens_details) u.cached_tokens = cached_tokens_;
    if (parse_reasoning_) {
      u.reasoning_tokens = 0;
      for (const ChatChoice& c : choices_) *u.reasoning_tokens += c.output.reasoning_tokens();
    }
    return u;
  }

  Json chunk_json(Json choice) const {
    Json chunk = {
        {"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", context_.response_model(lora_)}};
    chunk["choices"] = choice.is_null() ? Json::array() : Json::array({std::move(choice)});
    return chunk;
  }

  std::string engine_failed() {
    failed_ = true;
    return engine_failure_event(request_.stream);
  }

  ServingContext& context_;
  bool failed_ = false;
  std::string id_;
  int64_t created_;
  ChatRequest request_;
  std::shared_ptr<const LoraAdapter> lora_;  // the adapter the request named (null: the base model)
  bool parse_tools_ = false, parse_reasoning_ = false;
  std::optional<ChatPrompt> prompt_;  // holds a reference to request_
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0;
  Json prompt_logprobs_;
  std::vector<ChatChoice> choices_;
  Json kv_transfer_params_;  // a prefill instance's handoff (server/kv_transfer_params.h); null otherwise
  std::optional<Generation> generation_;  // last: destroyed first, aborting what still runs
};

}  // namespace

std::unique_ptr<CompletionJob> start_chat_completion(const Json& body, ServingContext& context,
                                                     Clock::time_point arrival) {
  return std::make_unique<ChatCompletion>(body, context, arrival);
}

}  // namespace sparrow::server
