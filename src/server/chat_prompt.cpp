#include "server/chat_prompt.h"

#include <algorithm>

#include "core/error.h"
#include "server/api_error.h"
#include "server/parsers/markers.h"
#include "server/parsers/parser.h"
#include "structured/spec.h"

namespace sparrow::server {
namespace {

std::string_view trimmed(std::string_view text) {
  while (!text.empty() && (text.back() == ' ' || text.back() == '\n' || text.back() == '\r' || text.back() == '\t'))
    text.remove_suffix(1);
  return text;
}

}  // namespace

ChatPrompt::ChatPrompt(ChatRequest& request, ServingContext& context, const ChatPromptOptions& options)
    : request_(request), context_(context) {
  // tool_choice "none": the model is not told about the tools (vLLM's --exclude-tools-when-tool-choice-none).
  if (request.tool_choice.mode == ToolChoice::Mode::None) request.template_input.erase("tools");
  check_tool_choice();
  if (!context.chat_template)
    bad_request("the served model has no chat template; pass --chat-template or use /v1/completions");
  const Tokenizer& tokenizer = context.require_tokenizer();

  try {
    text_ = context.chat_template->render(request.template_input);
  } catch (const Error& e) {
    bad_request(e.what(), options.messages_param);
  }
  ids_ = tokenizer.encode(text_);  // the template wrote any BOS itself
  images_ = load_chat_images(request.images, context.options.images.get(), ids_);
  if (request.truncate_prompt_tokens && int64_t(ids_.size()) > *request.truncate_prompt_tokens) {
    const int64_t cut = int64_t(ids_.size()) - *request.truncate_prompt_tokens;
    if (!images_.empty() && images_.front().offset - 1 < cut)
      bad_request("truncate_prompt_tokens would cut into an image", "truncate_prompt_tokens");
    ids_.erase(ids_.begin(), ids_.begin() + cut);
    for (vision::ImageInput& image : images_) image.offset -= cut;
  }

  params_ = request.sampling;
  std::optional<int64_t> max_tokens = request.max_tokens;
  const int64_t room = context.engine.max_model_len() - int64_t(ids_.size());
  if (options.clamp_max_tokens && max_tokens && room > 0) max_tokens = std::min(*max_tokens, room);
  fit_to_context(int64_t(ids_.size()), max_tokens, options.messages_param.c_str(), context, params_);
  context.assign_seed(params_);
  parse_tools_ = !context.options.tool_call_parser.empty() && !request.tools.is_null();
  parse_reasoning_ = !context.options.reasoning_parser.empty();
  constrain_output(tokenizer);
  // The parsers read the markup, which is made of special tokens (vLLM's adjust_request does the same).
  if (parse_tools_ || parse_reasoning_) params_.skip_special_tokens = false;
}

// vLLM serving.py: "auto" needs --enable-auto-tool-choice and a tool parser; "required" and named
// choices need the tool parser too: its format is the one the call is forced in.
void ChatPrompt::check_tool_choice() const {
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

nlohmann::json ChatPrompt::template_kwargs() const {
  return nlohmann::json::parse(request_.template_input["chat_template_kwargs"].dump());
}

// The request's grammar: a forced tool call (tool_choice "required" / named) in the tool parser's
// markup, or the response_format / structured_outputs already in the parameters; either starts after
// the reasoning when the output begins inside it.
void ChatPrompt::constrain_output(const Tokenizer& tokenizer) {
  using Mode = ToolChoice::Mode;
  const Mode mode = request_.tool_choice.mode;
  if (mode == Mode::None && parse_tools_) {
    // The parser drops any call; the format's call-only special tokens are not sampled at all, so markup
    // that is not a whole call (a tool declaration the model imitates) cannot reach content either.
    for (const std::string& text : parsers::tool_call_tokens(context_.options.tool_call_parser))
      if (std::optional<int32_t> id = tokenizer.token_to_id(text); id && tokenizer.is_special(*id))
        params_.logit_bias.push_back({*id, -100.0f});
  }
  if (mode == Mode::Required || mode == Mode::Named) {
    if (params_.structured.active())
      bad_request(
          "tool_choice \"required\" or a named function cannot be combined with response_format or "
          "structured_outputs: the call's arguments are already constrained by the tool's schema",
          "tool_choice");
    parsers::ToolGrammarOptions options;
    if (mode == Mode::Named) options.only_function = request_.tool_choice.function_name;
    options.parallel_tool_calls = request_.parallel_tool_calls;
    // Kimi K3 without thinking: the prompt opened the response channel (markers.h), the grammar closes it.
    options.output_opens_response = trimmed(text_).ends_with(parsers::kimi_k3::kResponseBegin);
    parsers::ToolGrammar grammar;
    try {
      grammar = parsers::tool_call_grammar(context_.options.tool_call_parser, request_.tools, options);
    } catch (const Error& e) {
      bad_request(e.what(), "tools");
    }
    params_.structured = {};
    params_.structured.kind = structured::StructuredOutputSpec::Kind::Grammar;
    params_.structured.text = std::move(grammar.ebnf);
    params_.structured.special_tokens = std::move(grammar.special_tokens);
  }
  if (!params_.structured.active() || context_.options.reasoning_parser.empty()) return;
  const std::string& name = context_.options.reasoning_parser;
  std::optional<std::string> end =
      parsers::reasoning_end_marker(name, parsers::reasoning_options(name, template_kwargs(), text_));
  if (!end) return;
  // The end tag as the model writes it: one token, or (Kimi K3's <|close|>think<|sep|>) a sequence that
  // begins and ends with special tokens. Text the tokenizer splits otherwise could be written in other
  // tokens, so the grammar then starts at once (docs/server.md, "Structured outputs").
  std::vector<int32_t> ids = tokenizer.encode(*end);
  if (ids.size() == 1 || (ids.size() > 1 && tokenizer.is_special(ids.front()) && tokenizer.is_special(ids.back())))
    params_.structured.start_after = std::move(ids);
}

ChatChoiceOutput ChatPrompt::new_output() const {
  std::unique_ptr<parsers::ReasoningParser> reasoning;
  std::unique_ptr<parsers::ToolParser> tools;
  const std::string& reasoning_name = context_.options.reasoning_parser;
  if (parse_reasoning_)
    reasoning = parsers::make_reasoning_parser(reasoning_name,
                                               parsers::reasoning_options(reasoning_name, template_kwargs(), text_));
  if (parse_tools_)
    tools = parsers::make_tool_parser(context_.options.tool_call_parser, nlohmann::json::parse(request_.tools.dump()));
  using Mode = ToolChoice::Mode;
  ChatOutputRules rules;
  if (request_.tool_choice.mode == Mode::Named) rules.only_function = request_.tool_choice.function_name;
  rules.drop_tool_calls = request_.tool_choice.mode == Mode::None;
  rules.parallel_tool_calls = request_.parallel_tool_calls;
  rules.include_reasoning = request_.include_reasoning;
  rules.tool_calls_finish = request_.tool_choice.mode == Mode::Auto || request_.tool_choice.mode == Mode::Required;
  return ChatChoiceOutput(std::make_unique<parsers::OutputParser>(std::move(reasoning), std::move(tools)), rules);
}

}  // namespace sparrow::server
