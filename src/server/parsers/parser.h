// Reasoning and tool-call parsers for `--reasoning-parser` / `--tool-call-parser` (kimi_k3, kimi_k2,
// minimax_m3, minimax_m2, deepseek_v32): they turn the model's raw output text into what an OpenAI chat
// response carries: `reasoning`, `content` and `tool_calls`.
//
// Input is the output text decoded WITH special tokens kept (the markers are special tokens), fed in
// deltas as the engine produces them; a delta must not split a UTF-8 character (the engine's
// incremental detokenizer guarantees that). Every parser streams: feed() returns what can be decided
// now and holds back only text that could still turn out to be markup (a marker split across deltas),
// finish() returns the rest. Markup never reaches content, reasoning or arguments, and joining the
// deltas gives exactly the result of feeding the whole text at once, which is how the non-streaming
// response is computed (parse_output). The format facts and the vLLM behaviour each one follows are in
// /work/shared/docs/serving-and-parsers.md §1-§2 and in the comments of the tool_*.cpp files.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::parsers {

// The parser names, in the order error messages list them.
const std::vector<std::string>& parser_names();

// ---------------------------------------------------------------------------------------------------
// Reasoning: splits reasoning (`<think>...</think>` and the like) from content.

struct ReasoningDelta {
  std::string reasoning, content;
};

class ReasoningParser {
 public:
  virtual ~ReasoningParser() = default;
  virtual ReasoningDelta feed(std::string_view text) = 0;
  virtual ReasoningDelta finish() = 0;
};

struct ReasoningOptions {
  // The request's thinking switch (chat_template_kwargs `thinking` / `enable_thinking`, MiniMax-M3's
  // `thinking_mode`). With thinking on, Kimi, MiniMax-M2 and DeepSeek-V3.2 output begins inside the
  // reasoning block (their templates open it in the prompt, or the model opens it first thing, as
  // vLLM assumes). With thinking off, output begins as content; a reasoning block the model opens
  // anyway at the very start is still split off, and a lone leading end tag is dropped.
  bool thinking = true;
  // The rendered prompt ends with the reasoning start tag (e.g. MiniMax-M3 with
  // thinking_mode "enabled" ends with "<mm:think>"), so the output begins inside reasoning.
  bool prompt_opens_reasoning = false;
};

// The options for one chat request: its chat_template_kwargs (an object, or null) and its rendered
// prompt text.
ReasoningOptions reasoning_options(std::string_view parser_name, const nlohmann::json& chat_template_kwargs,
                                   std::string_view prompt);

// The tag that ends the reasoning when the output of a request with these options begins inside it
// (the same rule make_reasoning_parser starts by), or nullopt when the output begins as content: a
// structured output starts after it (structured/spec.h start_after).
std::optional<std::string> reasoning_end_marker(std::string_view name, const ReasoningOptions& options);

// Throws sparrow::Error for an unknown name, listing the valid ones.
std::unique_ptr<ReasoningParser> make_reasoning_parser(std::string_view name, const ReasoningOptions& options = {});

// ---------------------------------------------------------------------------------------------------
// Tool calls: splits content from tool calls.

// One streamed piece of a tool call. The first piece of call `index` carries its id and name (never
// empty); later pieces leave them empty. `arguments` is the next fragment of the JSON arguments text.
struct ToolCallDelta {
  int index = 0;
  std::string id, name, arguments;
};

struct ToolDelta {
  std::string content;
  std::vector<ToolCallDelta> tool_calls;  // at most one entry per index, in index order
};

struct ToolCall {
  std::string id, name, arguments;  // arguments: JSON text of an object
  bool operator==(const ToolCall&) const = default;
};

class ToolParser {
 public:
  virtual ~ToolParser() = default;
  virtual ToolDelta feed(std::string_view text) = 0;
  virtual ToolDelta finish() = 0;
};

// `tools` is the request's `tools` list (OpenAI shape: [{"type": "function", "function": {"name", "parameters"}}]),
// or null. Its JSON schemas type the arguments of formats whose values are untyped text (MiniMax,
// DeepSeek-V3.2 string="false"), and calls naming a tool that is not in the list are dropped (as vLLM's
// MiniMax parser does). Formats that carry no call id get "call_" + 24 hex digits drawn from `id_seed`
// (random when not given; tests fix it).
// Throws sparrow::Error for an unknown name, listing the valid ones.
std::unique_ptr<ToolParser> make_tool_parser(std::string_view name, const nlohmann::json& tools,
                                             std::optional<uint64_t> id_seed = std::nullopt);

// ---------------------------------------------------------------------------------------------------
// Forced tool calls (tool_choice "required" or a named function): a grammar of the format's own markup
// (tool_grammar.cpp) that the structured-output path compiles (structured/spec.h, Kind::Grammar).

struct ToolGrammarOptions {
  std::string only_function;         // a named tool_choice: only this tool
  bool parallel_tool_calls = false;  // one or more calls (every format here allows several)
  // Kimi K3: the output begins inside the response channel (the prompt opened it: thinking off), so the
  // grammar closes it rather than opening it after the reasoning.
  bool output_opens_response = false;
};

struct ToolGrammar {
  std::string ebnf;                         // GBNF (structured/front_ends.h grammar_from_ebnf), root starts
  std::vector<std::string> special_tokens;  // the markup's special-token texts (StructuredOutputSpec)
};

// The grammar of one or more calls (options) to the offered tools (`tools`: the request's list, in its
// order; JSON schemas in their property order) in the markup of tool parser `parser_name`, whose
// ToolParser reads every output it admits as calls to those tools with arguments valid for the schema's
// types and required properties. sparrow::Error naming the tool when its schema or names cannot be forced,
// or for an unknown parser.
ToolGrammar tool_call_grammar(std::string_view parser_name, const nlohmann::ordered_json& tools,
                              const ToolGrammarOptions& options);

// The special tokens of parser `parser_name`'s format that only ever write tool-call markup (tool_choice
// "none" keeps the model from sampling them); none for Kimi K3, whose tokens also frame its channels.
std::vector<std::string> tool_call_tokens(std::string_view parser_name);

// ---------------------------------------------------------------------------------------------------
// Both together, as the server runs them: the reasoning parser first, its content through the tool
// parser. Either may be absent.

struct OutputDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class OutputParser {
 public:
  OutputParser(std::unique_ptr<ReasoningParser> reasoning, std::unique_ptr<ToolParser> tools);
  OutputDelta feed(std::string_view text);
  OutputDelta finish();

 private:
  OutputDelta through_tools(ReasoningDelta delta, bool last);
  std::unique_ptr<ReasoningParser> reasoning_;
  std::unique_ptr<ToolParser> tools_;
};

// A whole response: what the deltas of one stream add up to.
struct ParsedOutput {
  std::string reasoning, content;
  std::vector<ToolCall> tool_calls;
  void append(const OutputDelta& delta);
};

// The non-streaming result: the whole text fed at once into a fresh parser.
ParsedOutput parse_output(OutputParser& fresh_parser, std::string_view text);

}  // namespace sparrow::parsers
