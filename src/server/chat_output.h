// One chat choice's output while it streams: the engine's text through the reasoning and tool-call
// parsers (server/parsers/parser.h), then through what the request allows (tool_choice, parallel tool
// calls, include_reasoning). The deltas it returns are what the stream sends; joined, they are the
// non-streamed message, by construction.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "server/json_fields.h"
#include "server/parsers/parser.h"

namespace sparrow::server {

struct ChatOutputRules {
  std::string only_function;        // named tool_choice: keep only calls to this function
  bool parallel_tool_calls = true;  // false: keep only the first call
  bool drop_tool_calls = false;     // tool_choice "none": the markup is parsed out and every call dropped
  bool include_reasoning = true;    // false: parse the reasoning out and drop it
  bool tool_calls_finish = true;    // finish_reason "tool_calls" when calls were made (auto / required)
};

class ChatChoiceOutput {
 public:
  ChatChoiceOutput(std::unique_ptr<parsers::OutputParser> parser, ChatOutputRules rules);

  // The delta for the next piece of text, made of `tokens` tokens; `last` flushes the parsers.
  parsers::OutputDelta feed(const std::string& text, int64_t tokens, bool last);

  const parsers::ParsedOutput& joined() const { return joined_; }
  bool made_tool_calls() const { return kept_calls_ > 0; }
  // The engine's finish reason, or "tool_calls" when calls were returned for tool_choice auto / required.
  std::string finish_reason(const std::string& engine_reason) const;
  // Tokens whose text went to the reasoning. Approximate: a piece of text the parsers held back counts
  // like the piece before it.
  int64_t reasoning_tokens() const { return reasoning_tokens_; }

 private:
  std::vector<parsers::ToolCallDelta> filter(std::vector<parsers::ToolCallDelta> pieces);

  std::unique_ptr<parsers::OutputParser> parser_;
  ChatOutputRules rules_;
  parsers::ParsedOutput joined_;
  std::map<int, int> client_index_;  // the parser's call index -> the client's, or -1 when dropped
  int kept_calls_ = 0;
  int64_t reasoning_tokens_ = 0;
  bool last_was_reasoning_ = false;
};

// Appends `more` to `delta` (consecutive pieces of one choice); pieces of the same tool call merge, so a
// chunk holds at most one entry per tool-call index.
void append(parsers::OutputDelta& delta, parsers::OutputDelta more);

// The streamed form of a delta: {"reasoning"?, "content"?, "tool_calls"?: [{"index", "id"?, "type"?,
// "function": {"name"?, "arguments"}}]}: id, type and name only in a call's first piece.
Json delta_json(const parsers::OutputDelta& delta);

// The non-streamed message: {"role": "assistant", "content", "reasoning"? (when `with_reasoning`),
// "tool_calls"? (when there are calls)}. content is null when empty and the choice reasoned or called.
Json message_json(const parsers::ParsedOutput& output, bool with_reasoning);

}  // namespace sparrow::server
