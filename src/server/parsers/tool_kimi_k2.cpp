// Kimi K2 tool calls (markers.h; serving-and-parsers.md §1.1-§1.3, vLLM's kimi_k2 parser):
//   content<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
//   {"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>
// The call header is the model's own id, which the client gets back as the call id (the template
// renders tool results as "## Return of {id}", so the ids the model was trained on must round-trip);
// the name is the header without its ":index" and one leading "functions.". A header without ":digits"
// makes no call. The arguments are the model's JSON text, passed on verbatim without surrounding
// whitespace ("{}" when empty), also when it is not valid JSON. Text inside the section but outside calls,
// and everything after the section, is dropped; markers anywhere else never reach content.
#include "server/parsers/markers.h"
#include "server/parsers/streaming_tool_parser.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {

using namespace kimi_k2;

// The name in a call header "functions.NAME:IDX", or "" when the header is not of that form.
std::string name_from_header(std::string_view header) {
  size_t colon = header.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == header.size()) return "";
  for (char c : header.substr(colon + 1))
    if (c < '0' || c > '9') return "";
  std::string_view name = header.substr(0, colon);
  if (name.starts_with("functions.")) name.remove_prefix(std::string_view("functions.").size());
  return std::string(name);
}

class KimiK2ToolParser final : public StreamingToolParser {
 public:
  using StreamingToolParser::StreamingToolParser;

 private:
  enum class State {
    Content,
    Tools,      // inside or after a section: only calls matter
    Header,     // after <|tool_call_begin|>: the id, up to <|tool_call_argument_begin|>
    Arguments,  // of an announced call
    Skipped,    // arguments of a call that was not announced (bad header or unknown tool)
  };

  void scan(bool at_end) override {
    while (true) {
      switch (state_) {
        case State::Content: {
          MarkerHit hit = find_marker(buffer_,
                                      {kSectionBegin, kSectionBeginSingular, kCallBegin, kSectionEnd,
                                       kSectionEndSingular, kArgumentBegin, kCallEnd},
                                      at_end);
          emit_content(std::string_view(buffer_).substr(0, hit.pos));
          consume(hit.pos);
          if (!hit.found()) return;
          if (hit.marker <= 2) {  // a section opens (a call without its section marker opens one too)
            begin_tools();
            state_ = hit.marker == 2 ? State::Header : State::Tools;
          }
          consume(hit.length);  // any other marker out of place is dropped
          break;
        }
        case State::Tools: {
          MarkerHit hit = find_marker(buffer_, {kCallBegin}, at_end);
          consume(hit.pos);
          if (!hit.found()) return;
          consume(kCallBegin.size());
          state_ = State::Header;
          break;
        }
        case State::Header: {
          MarkerHit hit = find_marker(buffer_, {kArgumentBegin, kCallEnd, kCallBegin, kSectionEnd, kSectionEndSingular},
                                      at_end);
          if (!hit.found()) {
            if (at_end) buffer_.clear();  // a header cut off before its arguments: no call
            return;
          }
          if (hit.marker != 0) {  // no arguments marker: not a call; the marker is handled in Tools
            consume(hit.pos);
            state_ = State::Tools;
            break;
          }
          std::string header(trim(std::string_view(buffer_).substr(0, hit.pos)));
          consume(hit.pos + kArgumentBegin.size());
          std::string name = name_from_header(header);
          if (!name.empty() && schemas_.accepts(name)) {
            open_call(header, name);
            arguments_ = RawArgumentsWriter();
            state_ = State::Arguments;
          } else {
            state_ = State::Skipped;
          }
          break;
        }
        case State::Arguments:
        case State::Skipped: {
          // A call ends at its end marker, or at a marker that cannot be inside it.
          MarkerHit hit = find_marker(buffer_, {kCallEnd, kCallBegin, kSectionEnd, kSectionEndSingular}, at_end);
          if (state_ == State::Arguments) emit_arguments(arguments_.part(std::string_view(buffer_).substr(0, hit.pos)));
          consume(hit.pos);
          if (!hit.found() && !at_end) return;
          if (state_ == State::Arguments) emit_arguments(arguments_.end());  // a cut-off call keeps its text
          if (hit.marker == 0) consume(kCallEnd.size());
          state_ = State::Tools;
          if (!hit.found()) return;
          break;
        }
      }
    }
  }

  State state_ = State::Content;
  RawArgumentsWriter arguments_;
};

}  // namespace

std::unique_ptr<ToolParser> make_kimi_k2_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed) {
  return std::make_unique<KimiK2ToolParser>(tools, id_seed);
}

}  // namespace sparrow::parsers
