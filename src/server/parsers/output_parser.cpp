// The tool-parser factory, and the reasoning and tool parsers chained as the server runs them.
#include "core/error.h"
#include "server/parsers/parser.h"
#include "server/parsers/streaming_tool_parser.h"

namespace sparrow::parsers {

std::unique_ptr<ToolParser> make_tool_parser(std::string_view name, const nlohmann::json& tools,
                                             std::optional<uint64_t> id_seed) {
  if (name == "kimi_k3") return make_kimi_k3_tool_parser(tools, id_seed);
  if (name == "kimi_k2") return make_kimi_k2_tool_parser(tools, id_seed);
  if (name == "minimax_m3") return make_minimax_m3_tool_parser(tools, id_seed);
  if (name == "minimax_m2") return make_minimax_m2_tool_parser(tools, id_seed);
  if (name == "deepseek_v32") return make_deepseek_v32_tool_parser(tools, id_seed);
  std::string valid;
  for (const std::string& known : parser_names()) valid += (valid.empty() ? "" : ", ") + known;
  fail("unknown tool call parser '", name, "' (valid: ", valid, ")");
}

OutputParser::OutputParser(std::unique_ptr<ReasoningParser> reasoning, std::unique_ptr<ToolParser> tools)
    : reasoning_(std::move(reasoning)), tools_(std::move(tools)) {}

OutputDelta OutputParser::feed(std::string_view text) {
  ReasoningDelta delta = reasoning_ ? reasoning_->feed(text) : ReasoningDelta{"", std::string(text)};
  return through_tools(std::move(delta), /*last=*/false);
}

OutputDelta OutputParser::finish() {
  ReasoningDelta delta = reasoning_ ? reasoning_->finish() : ReasoningDelta{};
  return through_tools(std::move(delta), /*last=*/true);
}

OutputDelta OutputParser::through_tools(ReasoningDelta delta, bool last) {
  OutputDelta out;
  out.reasoning = std::move(delta.reasoning);
  if (!tools_) {
    out.content = std::move(delta.content);
    return out;
  }
  ToolDelta tool_delta = tools_->feed(delta.content);
  if (last) {
    ToolDelta rest = tools_->finish();
    tool_delta.content += rest.content;
    // Merge the finishing pieces into those of the last feed, one entry per call index.
    for (ToolCallDelta& piece : rest.tool_calls) {
      if (!tool_delta.tool_calls.empty() && tool_delta.tool_calls.back().index == piece.index)
        tool_delta.tool_calls.back().arguments += piece.arguments;
      else
        tool_delta.tool_calls.push_back(std::move(piece));
    }
  }
  out.content = std::move(tool_delta.content);
  out.tool_calls = std::move(tool_delta.tool_calls);
  return out;
}

void ParsedOutput::append(const OutputDelta& delta) {
  reasoning += delta.reasoning;
  content += delta.content;
  for (const ToolCallDelta& piece : delta.tool_calls) {
    if (piece.index < 0) continue;
    if (static_cast<size_t>(piece.index) >= tool_calls.size()) tool_calls.resize(piece.index + 1);
    ToolCall& call = tool_calls[piece.index];
    if (!piece.id.empty()) call.id = piece.id;
    if (!piece.name.empty()) call.name = piece.name;
    call.arguments += piece.arguments;
  }
}

ParsedOutput parse_output(OutputParser& fresh_parser, std::string_view text) {
  ParsedOutput result;
  result.append(fresh_parser.feed(text));
  result.append(fresh_parser.finish());
  return result;
}

}  // namespace sparrow::parsers
