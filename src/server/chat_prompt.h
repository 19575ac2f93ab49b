// What a chat request becomes on its way to the engine, shared by /v1/chat/completions and /v1/responses
// (which turns its input items into a ChatRequest first): the tool_choice checks, the prompt rendered by
// the chat template and tokenized, the sampling parameters with the request's constraints, and each
// choice's output through the reasoning and tool-call parsers (chat_output.h).
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
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "server/chat_output.h"
#include "server/openai_requests.h"
#include "server/serving.h"

namespace sparrow::server {

struct ChatPromptOptions {
  // The request field that template errors name ("messages"; /v1/responses: "input").
  std::string messages_param = "messages";
  // A max_tokens beyond what the context leaves is cut down to it instead of refused (vLLM's
  // /v1/responses does so with max_output_tokens).
  bool clamp_max_tokens = false;
};

class ChatPrompt {
 public:
  // Checks tool_choice against the server's parsers, renders and tokenizes `request` (tool_choice "none"
  // erases its tools from the template input first), fits it to the context and prepares the sampling
  // parameters. 4xx problems are ApiErrors. `request` must outlive this object.
  ChatPrompt(ChatRequest& request, ServingContext& context, const ChatPromptOptions& options = {});

  const std::string& text() const { return text_; }
  const std::vector<int32_t>& ids() const { return ids_; }
  // The request's images, placed on ids(): each image_url part's placeholders expanded (chat_images.h).
  const std::vector<vision::ImageInput>& images() const { return images_; }
  // The request's sampling parameters with max_tokens, the seed, and the grammar or logit_bias that
  // tool_choice and structured outputs ask for.
  const SamplingParams& params() const { return params_; }
  bool parses_tools() const { return parse_tools_; }
  bool parses_reasoning() const { return parse_reasoning_; }

  // A fresh output for one choice: the configured parsers, and the request's tool_choice,
  // parallel_tool_calls and include_reasoning rules.
  ChatChoiceOutput new_output() const;

 private:
  void check_tool_choice() const;
  void constrain_output(const Tokenizer& tokenizer);
  nlohmann::json template_kwargs() const;

  const ChatRequest& request_;
  const ServingContext& context_;
  std::string text_;
  std::vector<int32_t> ids_;
  std::vector<vision::ImageInput> images_;
  SamplingParams params_;
  bool parse_tools_ = false, parse_reasoning_ = false;
};

}  // namespace sparrow::server
