#include "server/chat_output.h"

#include <algorithm>

namespace sparrow::server {

using parsers::OutputDelta;
using parsers::ToolCallDelta;

void append(OutputDelta& delta, OutputDelta more) {
  delta.reasoning += more.reasoning;
  delta.content += more.content;
  for (ToolCallDelta& piece : more.tool_calls) {
    auto same = std::find_if(delta.tool_calls.begin(), delta.tool_calls.end(),
                             [&](const ToolCallDelta& d) { return d.index == piece.index; });
    if (same != delta.tool_calls.end())
      same->arguments += piece.arguments;
    else
      delta.tool_calls.push_back(std::move(piece));
  }
}

ChatChoiceOutput::ChatChoiceOutput(std::unique_ptr<parsers::OutputParser> parser, ChatOutputRules rules)
    : parser_(std::move(parser)), rules_(std::move(rules)) {}

OutputDelta ChatChoiceOutput::feed(const std::string& text, int64_t tokens, bool last) {
  OutputDelta delta = parser_->feed(text);
  if (last) append(delta, parser_->finish());
  delta.tool_calls = filter(std::move(delta.tool_calls));
  if (!delta.empty()) last_was_reasoning_ = delta.content.empty() && delta.tool_calls.empty();
  if (last_was_reasoning_) reasoning_tokens_ += tokens;
  if (!rules_.include_reasoning) delta.reasoning.clear();
  joined_.append(delta);
  return delta;
}

std::vector<ToolCallDelta> ChatChoiceOutput::filter(std::vector<ToolCallDelta> pieces) {
  std::vector<ToolCallDelta> kept;
  for (ToolCallDelta& piece : pieces) {
    auto known = client_index_.find(piece.index);
    if (known == client_index_.end()) {  // a call's first piece: it carries the name
      bool keep = !rules_.drop_tool_calls && (rules_.only_function.empty() || piece.name == rules_.only_function) &&
                  (rules_.parallel_tool_calls || kept_calls_ == 0);
      known = client_index_.emplace(piece.index, keep ? kept_calls_++ : -1).first;
    }
    if (known->second < 0) continue;
    piece.index = known->second;
    kept.push_back(std::move(piece));
  }
  return kept;
}

std::string ChatChoiceOutput::finish_reason(const std::string& engine_reason) const {
  return made_tool_calls() && rules_.tool_calls_finish ? "tool_calls" : engine_reason;
}

Json delta_json(const OutputDelta& delta) {
  Json out = Json::object();
  if (!delta.reasoning.empty()) out["reasoning"] = delta.reasoning;
  if (!delta.content.empty()) out["content"] = delta.content;
  if (!delta.tool_calls.empty()) {
    Json calls = Json::array();
    for (const ToolCallDelta& piece : delta.tool_calls) {
      Json call = {{"index", piece.index}};
      if (!piece.id.empty()) {
        call["id"] = piece.id;
        call["type"] = "function";
      }
      Json function = Json::object();
      if (!piece.name.empty()) function["name"] = piece.name;
      function["arguments"] = piece.arguments;
      call["function"] = std::move(function);
      calls.push_back(std::move(call));
    }
    out["tool_calls"] = std::move(calls);
  }
  return out;
}

Json message_json(const parsers::ParsedOutput& output, bool with_reasoning) {
  Json message = {{"role", "assistant"}};
  bool said_otherwise = !output.tool_calls.empty() || !output.reasoning.empty();
  message["content"] = output.content.empty() && said_otherwise ? Json(nullptr) : Json(output.content);
  if (with_reasoning) message["reasoning"] = output.reasoning.empty() ? Json(nullptr) : Json(output.reasoning);
  if (!output.tool_calls.empty()) {
    Json calls = Json::array();
    for (const parsers::ToolCall& call : output.tool_calls)
      calls.push_back(
          {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    message["tool_calls"] = std::move(calls);
  }
  return message;
}

}  // namespace sparrow::server
