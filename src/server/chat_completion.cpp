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
//
// tool_choice "required" and named: vLLM forces a call with guided decoding; here the call is forced in
// the model's own tool-call markup (the --tool-call-parser's format): a grammar of one call (or, with
// parallel_tool_calls, one or more) to the offered tools (named: that tool), arguments valid for the
// tool's JSON schema (parsers/tool_grammar.cpp), compiled by the structured-output path. With reasoning
// the grammar starts after the reasoning's end tag (also for response_format / structured_outputs), as
// vLLM's reasoning-aware structured outputs do.
// tool_choice "none": the tools are not rendered (vLLM's --exclude-tools-when-tool-choice-none), the
// format's call-only special tokens get logit_bias -100, and the tool parser still runs, dropping every
// call, so tool markup never reaches content.
#include "core/error.h"
#include "server/api_error.h"
#include "server/chat_output.h"
#include "server/openai_requests.h"
#include "server/openai_responses.h"
#include "server/parsers/markers.h"
#include "server/parsers/parser.h"
#include "server/serving.h"
#include "structured/spec.h"

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
    // tool_choice "none": the model is not told about the tools (vLLM's --exclude-tools-when-tool-choice-none).
    if (request_.tool_choice.mode == ToolChoice::Mode::None) request_.template_input.erase("tools");
    context.check_model(request_.model);
    if (!request_.request_id.empty()) id_ = "chatcmpl-" + request_.request_id;
    check_tool_choice();
    if (!context.chat_template)
      bad_request("the served model has no chat template; pass --chat-template or use /v1/completions");
    const Tokenizer& tokenizer = context.require_tokenizer();

    std::string prompt_text;
    try {
      prompt_text = context.chat_template->render(request_.template_input);
    } catch (const Error& e) {
      bad_request(e.what(), "messages");
    }
    std::vector<int32_t> prompt = tokenizer.encode(prompt_text);  // the template wrote any BOS itself
    if (request_.truncate_prompt_tokens && int64_t(prompt.size()) > *request_.truncate_prompt_tokens)
      prompt.erase(prompt.begin(), prompt.end() - *request_.truncate_prompt_tokens);
    prompt_tokens_ = int64_t(prompt.size());
    prompt_ids_ = prompt;

    SamplingParams params = request_.sampling;
    fit_to_context(prompt_tokens_, request_.max_tokens, "messages", context, params);
    context.assign_seed(params);
    parse_tools_ = !context.options.tool_call_parser.empty() && !request_.tools.is_null();
    parse_reasoning_ = !context.options.reasoning_parser.empty();
    constrain_output(params, prompt_text, tokenizer);
    // The parsers read the markup, which is made of special tokens (vLLM's adjust_request does the same).
    if (parse_tools_ || parse_reasoning_) params.skip_special_tokens = false;

    for (int64_t i = 0; i < params.n; ++i) choices_.push_back(make_choice(prompt_text));
    generation_.emplace(context.engine, context.metrics, engine_request_id(request_.request_id, id_), std::vector<std::vector<int32_t>>{prompt},
                        params, arrival);
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
      if (request_.return_token_ids && i == 0) chunk["prompt_token_ids"] = prompt_ids_;
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
                 {"model", context_.model_name()},
                 {"choices", std::move(choices)},
                 {"usage", usage_json(usage())}};
    if (!prompt_logprobs_.is_null()) body["prompt_logprobs"] = prompt_logprobs_;
    if (request_.return_token_ids) body["prompt_token_ids"] = prompt_ids_;
    return body;
  }

 private:
  // vLLM serving.py: "auto" needs --enable-auto-tool-choice and a tool parser; "required" and named
  // choices need the tool parser too: its format is the one the call is forced in.
  void check_tool_choice() const {
    using Mode = ToolChoice::Mode;
    Mode mode = request_.tool_choice.mode;
    bool have_parser = !context_.options.tool_call_parser.empty();
    if (mode == Mode::Auto && !(context_.options.enable_auto_tool_choice && have_parser))
      bad_request("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                  "tool_choice");
    if ((mode == Mode::Required || mode == Mode::Named) && !have_parser)
      bad_request(
          "tool_choice \"required\" or a named function requires --tool-call-parser to be set "
          "(the call is forced in the model's own tool-call format)",
          "tool_choice");
  }

  // The request's grammar: a forced tool call (tool_choice "required" / named) in the tool parser's
  // markup, or the response_format / structured_outputs already in `params`; either starts after the
  // reasoning when the output begins inside it.
  void constrain_output(SamplingParams& params, const std::string& prompt_text, const Tokenizer& tokenizer) {
    using Mode = ToolChoice::Mode;
    const Mode mode = request_.tool_choice.mode;
    if (mode == Mode::None && parse_tools_) {
      // The parser drops any call; the format's call-only special tokens are not sampled at all, so markup
      // that is not a whole call (a tool declaration the model imitates) cannot reach content either.
      for (const std::string& text : parsers::tool_call_tokens(context_.options.tool_call_parser))
        if (std::optional<int32_t> id = tokenizer.token_to_id(text); id && tokenizer.is_special(*id))
          params.logit_bias.push_back({*id, -100.0f});
    }
    if (mode == Mode::Required || mode == Mode::Named) {
      if (params.structured.active())
        bad_request("tool_choice \"required\" or a named function cannot be combined with response_format or "
                    "structured_outputs: the call's arguments are already constrained by the tool's schema",
                    "tool_choice");
      parsers::ToolGrammarOptions options;
      if (mode == Mode::Named) options.only_function = request_.tool_choice.function_name;
      options.parallel_tool_calls = request_.parallel_tool_calls;
      // Kimi K3 without thinking: the prompt opened the response channel (markers.h), the grammar closes it.
      options.output_opens_response = trimmed(prompt_text).ends_with(parsers::kimi_k3::kResponseBegin);
      parsers::ToolGrammar grammar;
      try {
        grammar = parsers::tool_call_grammar(context_.options.tool_call_parser, request_.tools, options);
      } catch (const Error& e) {
        bad_request(e.what(), "tools");
      }
      params.structured = {};
      params.structured.kind = structured::StructuredOutputSpec::Kind::Grammar;
      params.structured.text = std::move(grammar.ebnf);
      params.structured.special_tokens = std::move(grammar.special_tokens);
    }
    if (!params.structured.active() || context_.options.reasoning_parser.empty()) return;
    const std::string& name = context_.options.reasoning_parser;
    auto kwargs = nlohmann::json::parse(request_.template_input["chat_template_kwargs"].dump());
    std::optional<std::string> end = parsers::reasoning_end_marker(name, parsers::reasoning_options(name, kwargs, prompt_text));
    if (!end) return;
    // The end tag as the model writes it: one token, or (Kimi K3's <|close|>think<|sep|>) a sequence that
    // begins and ends with special tokens. Text the tokenizer splits otherwise could be written in other
    // tokens, so the grammar then starts at once (docs/server.md, "Structured outputs").
    std::vector<int32_t> ids = tokenizer.encode(*end);
    if (ids.size() == 1 || (ids.size() > 1 && tokenizer.is_special(ids.front()) && tokenizer.is_special(ids.back())))
      params.structured.start_after = std::move(ids);
  }

  static std::string_view trimmed(std::string_view text) {
    while (!text.empty() && (text.back() == ' ' || text.back() == '\n' || text.back() == '\r' || text.back() == '\t'))
      text.remove_suffix(1);
    return text;
  }

  ChatChoice make_choice(const std::string& prompt_text) {
    std::unique_ptr<parsers::ReasoningParser> reasoning;
    std::unique_ptr<parsers::ToolParser> tools;
    const std::string& reasoning_name = context_.options.reasoning_parser;
    if (!reasoning_name.empty()) {
      auto kwargs = nlohmann::json::parse(request_.template_input["chat_template_kwargs"].dump());
      reasoning = parsers::make_reasoning_parser(reasoning_name,
                                                 parsers::reasoning_options(reasoning_name, kwargs, prompt_text));
    }
    if (parse_tools_)
      tools =
          parsers::make_tool_parser(context_.options.tool_call_parser, nlohmann::json::parse(request_.tools.dump()));
    using Mode = ToolChoice::Mode;
    ChatOutputRules rules;
    if (request_.tool_choice.mode == Mode::Named) rules.only_function = request_.tool_choice.function_name;
    rules.drop_tool_calls = request_.tool_choice.mode == Mode::None;
    rules.parallel_tool_calls = request_.parallel_tool_calls;
    rules.include_reasoning = request_.include_reasoning;
    rules.tool_calls_finish = request_.tool_choice.mode == Mode::Auto || request_.tool_choice.mode == Mode::Required;
    return ChatChoice(
        ChatChoiceOutput(std::make_unique<parsers::OutputParser>(std::move(reasoning), std::move(tools)), rules));
  }

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
        {"id", id_}, {"object", "chat.completion.chunk"}, {"created", created_}, {"model", context_.model_name()}};
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
  bool parse_tools_ = false, parse_reasoning_ = false;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0;
  std::vector<int32_t> prompt_ids_;
  Json prompt_logprobs_;
  std::vector<ChatChoice> choices_;
  std::optional<Generation> generation_;  // last: destroyed first, aborting what still runs
};

}  // namespace

std::unique_ptr<CompletionJob> start_chat_completion(const Json& body, ServingContext& context,
                                                     Clock::time_point arrival) {
  return std::make_unique<ChatCompletion>(body, context, arrival);
}

}  // namespace sparrow::server
