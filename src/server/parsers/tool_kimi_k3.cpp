// Kimi K3 tool calls in the XTML tools channel (markers.h; vLLM's kimi_k3 tool parser,
// vllm/frontend/processing/tool_parsers/kimi_k3_tool_parser.py):
//   <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
//   <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
//   <|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>
// An argument of type "string" is its raw text (it streams); any other type is JSON text, parsed once
// complete (the raw text when it is not JSON). Attribute values escape '&' and '"' as &amp; and &quot;.
// A call may instead carry its arguments as one JSON object, <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>
// (what the template renders for string arguments), passed on verbatim. Calls get Kimi's id form
// functions.NAME:INDEX (vLLM's id for Kimi models). Content is the response channel: its wrapper markup
// is removed here as in the reasoning parser, so this parser also works without one.
#include "server/parsers/markers.h"
#include "server/parsers/streaming_tool_parser.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {

using namespace kimi_k3;

std::string unescape_attribute(std::string value) {
  for (auto [escaped, plain] : {std::pair{"&quot;", "\""}, std::pair{"&amp;", "&"}}) {
    std::string out;
    size_t start = 0, at;
    while ((at = value.find(escaped, start)) != std::string::npos) {
      out += value.substr(start, at - start) + plain;
      start = at + std::string_view(escaped).size();
    }
    value = out + value.substr(start);
  }
  return value;
}

// One <|open|>NAME ATTRIBUTES<|sep|> or <|close|>NAME<|sep|> tag.
struct Tag {
  bool closing = false;
  std::string name;
  std::map<std::string, std::string> attributes;
  size_t length = 0;  // in the text
};

class KimiK3ToolParser final : public StreamingToolParser {
 public:
  using StreamingToolParser::StreamingToolParser;

 private:
  enum class State {
    Content,
    Tools,        // inside or after the tools channel: only calls matter
    Call,         // between the arguments of an announced call
    StringValue,  // streaming
    OtherValue,   // collected, parsed at its end
    JsonBlock,    // the arguments as one JSON object, streaming
    SkippedCall,  // a call that was not announced
  };

  void scan(bool at_end) override {
    while (true) {
      switch (state_) {
        case State::Content: {
          MarkerHit hit =
              find_marker(buffer_, {kToolsBegin, kResponseBegin, kResponseEnd, kMessageEnd, kEndOfMessage}, at_end);
          emit_content(std::string_view(buffer_).substr(0, hit.pos));
          consume(hit.pos);
          if (!hit.found()) return;
          if (hit.marker == 0) {
            begin_tools();
            state_ = State::Tools;
          }
          consume(hit.length);
          break;
        }
        case State::Tools:
        case State::Call: {
          std::optional<Tag> tag = next_tag(at_end);
          if (!tag) {
            if (at_end && state_ == State::Call) emit_arguments(json_block_ ? raw_.end() : arguments_.cut_off());
            return;
          }
          bool opens_call = !tag->closing && tag->name == "call";
          if (state_ == State::Tools) {
            consume(tag->length);
            if (opens_call) open_call_from(*tag);
            break;
          }
          if (opens_call || (tag->closing && (tag->name == "call" || tag->name == "tools"))) {
            emit_arguments(json_block_ ? raw_.end() : arguments_.end());
            if (!opens_call) consume(tag->length);  // a new call without the old one's end: next round
            state_ = State::Tools;
            break;
          }
          consume(tag->length);
          if (!tag->closing && tag->name == "argument") {
            key_ = tag->attributes["key"];
            auto type = tag->attributes.find("type");
            if (type == tag->attributes.end() || type->second == "string") {
              emit_arguments(arguments_.begin_string(key_));
              state_ = State::StringValue;
            } else {
              value_.clear();
              state_ = State::OtherValue;
            }
          } else if (!tag->closing && tag->name == "json") {
            json_block_ = true;
            state_ = State::JsonBlock;
          }
          break;  // other tags (the closing argument / json tags) carry nothing
        }
        case State::StringValue:
        case State::OtherValue:
        case State::JsonBlock: {
          // Values are raw text: they end at the next tag.
          MarkerHit hit = find_marker(buffer_, {kClose, kOpen}, at_end);
          std::string_view text = std::string_view(buffer_).substr(0, hit.pos);
          if (state_ == State::StringValue) emit_arguments(arguments_.string_part(text));
          else if (state_ == State::OtherValue) value_ += text;
          else emit_arguments(raw_.part(text));
          consume(hit.pos);
          if (!hit.found()) {
            if (at_end) emit_arguments(json_block_ ? raw_.end() : arguments_.cut_off());
            return;
          }
          if (state_ == State::StringValue) emit_arguments(arguments_.end_string());
          if (state_ == State::OtherValue) emit_arguments(arguments_.value(key_, coerce_value(value_, {})));
          state_ = State::Call;
          break;
        }
        case State::SkippedCall: {
          MarkerHit hit = find_marker(buffer_, {kCallEnd, kToolsEnd}, at_end);
          consume(hit.found() ? hit.pos + hit.length : hit.pos);
          if (!hit.found()) return;
          state_ = State::Tools;
          break;
        }
      }
    }
  }

  void open_call_from(const Tag& tag) {
    auto tool = tag.attributes.find("tool");
    std::string name = tool == tag.attributes.end() ? "" : tool->second;
    if (name.empty() || !schemas_.accepts(name)) {
      state_ = State::SkippedCall;
      return;
    }
    open_call("functions." + name + ":" + std::to_string(calls_opened()), name);
    arguments_ = ArgumentsWriter();
    raw_ = RawArgumentsWriter();
    json_block_ = false;
    state_ = State::Call;
  }

  // The next complete tag; the text before it is dropped (consumed). nullopt while it is incomplete.
  std::optional<Tag> next_tag(bool at_end) {
    MarkerHit hit = find_marker(buffer_, {kOpen, kClose}, at_end);
    consume(hit.pos);
    if (!hit.found()) return std::nullopt;
    size_t sep = buffer_.find(kSep, hit.length);
    if (sep == std::string::npos) {
      if (at_end) buffer_.clear();
      return std::nullopt;
    }
    std::string_view body = std::string_view(buffer_).substr(hit.length, sep - hit.length);
    size_t name_end = 0;
    while (name_end < body.size() && !is_space(body[name_end])) ++name_end;
    Tag tag;
    tag.closing = hit.marker == 1;
    tag.name = std::string(body.substr(0, name_end));
    for (auto& [key, value] : parse_attributes(body.substr(name_end)))
      tag.attributes[key] = unescape_attribute(value);
    tag.length = sep + kSep.size();
    return tag;
  }

  State state_ = State::Content;
  std::string key_, value_;
  ArgumentsWriter arguments_;
  RawArgumentsWriter raw_;
  bool json_block_ = false;
};

}  // namespace

std::unique_ptr<ToolParser> make_kimi_k3_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed) {
  return std::make_unique<KimiK3ToolParser>(tools, id_seed);
}

}  // namespace sparrow::parsers
