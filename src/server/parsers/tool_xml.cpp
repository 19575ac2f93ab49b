// The XML-like tool-call formats of MiniMax-M2 and DeepSeek-V3.2 (DSML), which differ only in their tag
// spelling and in how a parameter's type is known (markers.h):
//   SECTION <invoke name="NAME"> <parameter name="KEY" ...>VALUE</parameter> ... </invoke> ... /SECTION
// VALUE is text, kept verbatim. A value whose type is string streams as a JSON string while it arrives;
// any other value is converted once complete (coerce_value), as vLLM's minimax_m2 and deepseek_v32
// parsers do:
//   - MiniMax-M2: the type comes from the tool's JSON schema; a parameter the schema does not declare
//     is a string (vllm/tool_parsers/minimax_m2_tool_parser.py; serving-and-parsers.md §2.1).
//   - DeepSeek-V3.2: string="true" means the raw text is the string; string="false" values are typed by
//     the schema (vllm/tool_parsers/deepseekv32_tool_parser.py). Without a schema entry we parse them as
//     JSON (the model's own statement that the value is not a string), falling back to the text.
// Calls get generated ids; a call naming a tool the request did not offer is dropped; text between and
// after the calls, and the call markup, never reaches content.
#include "server/parsers/markers.h"
#include "server/parsers/streaming_tool_parser.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {

struct XmlSyntax {
  std::string_view section_begin, section_end, invoke_begin, invoke_end, parameter_begin, parameter_end;
  // The JSON types a parameter may take, from its tag's attributes and the tool's schema for it (null
  // when not declared); empty: unknown.
  std::set<std::string> (*parameter_types)(const std::map<std::string, std::string>& attributes,
                                           const nlohmann::json* schema);
};

std::set<std::string> minimax_m2_types(const std::map<std::string, std::string>&, const nlohmann::json* schema) {
  return schema ? schema_types(*schema) : std::set<std::string>{"string"};
}

std::set<std::string> deepseek_v32_types(const std::map<std::string, std::string>& attributes,
                                         const nlohmann::json* schema) {
  auto string_attribute = attributes.find("string");
  if (string_attribute != attributes.end() && string_attribute->second == "true") return {"string"};
  return schema ? schema_types(*schema) : std::set<std::string>{};
}

const XmlSyntax kMinimaxM2 = {minimax_m2::kSectionBegin,   minimax_m2::kSectionEnd,
                              minimax_m2::kInvokeBegin,    minimax_m2::kInvokeEnd,
                              minimax_m2::kParameterBegin, minimax_m2::kParameterEnd,
                              minimax_m2_types};
const XmlSyntax kDeepseekV32 = {deepseek_v32::kSectionBegin,   deepseek_v32::kSectionEnd,
                                deepseek_v32::kInvokeBegin,    deepseek_v32::kInvokeEnd,
                                deepseek_v32::kParameterBegin, deepseek_v32::kParameterEnd,
                                deepseek_v32_types};

class XmlToolParser final : public StreamingToolParser {
 public:
  XmlToolParser(const XmlSyntax& syntax, const nlohmann::json& tools, std::optional<uint64_t> id_seed)
      : StreamingToolParser(tools, id_seed), syntax_(syntax) {}

 private:
  enum class State {
    Content,
    Tools,            // inside or after a section: only invokes matter
    InvokeHeader,     // after "<invoke": attributes up to '>'
    Invoke,           // between parameters of an announced call
    ParameterHeader,  // after "<parameter": attributes up to '>'
    StringValue,      // streaming
    OtherValue,       // collected, converted at its end
    SkippedInvoke,    // a call that was not announced
  };

  void scan(bool at_end) override {
    const XmlSyntax& s = syntax_;
    while (true) {
      switch (state_) {
        case State::Content: {
          MarkerHit hit = find_marker(buffer_, {s.section_begin, s.section_end}, at_end);
          emit_content(std::string_view(buffer_).substr(0, hit.pos));
          consume(hit.pos);
          if (!hit.found()) return;
          if (hit.marker == 0) {
            begin_tools();
            state_ = State::Tools;
          }
          consume(hit.length);  // a stray section end is dropped
          break;
        }
        case State::Tools: {
          MarkerHit hit = find_marker(buffer_, {s.invoke_begin, s.section_begin, s.section_end}, at_end);
          consume(hit.found() ? hit.pos + hit.length : hit.pos);
          if (!hit.found()) return;
          if (hit.marker == 0) state_ = State::InvokeHeader;
          break;
        }
        case State::InvokeHeader:
        case State::ParameterHeader: {
          std::optional<std::map<std::string, std::string>> attributes = take_tag_attributes(at_end);
          if (!attributes) return;
          std::string name = (*attributes)["name"];
          if (state_ == State::InvokeHeader) {
            if (!name.empty() && schemas_.accepts(name)) {
              open_call(generated_id(), name);
              tool_ = name;
              arguments_ = ArgumentsWriter();
              state_ = State::Invoke;
            } else {
              state_ = State::SkippedInvoke;
            }
          } else {
            parameter_ = name;
            value_types_ = s.parameter_types(*attributes, schemas_.parameter(tool_, name));
            if (value_types_ == std::set<std::string>{"string"}) {
              emit_arguments(arguments_.begin_string(name));
              state_ = State::StringValue;
            } else {
              value_.clear();
              state_ = State::OtherValue;
            }
          }
          break;
        }
        case State::Invoke: {
          MarkerHit hit =
              find_marker(buffer_, {s.parameter_begin, s.invoke_end, s.section_end, s.invoke_begin}, at_end);
          consume(hit.pos);  // whitespace between parameters
          if (!hit.found()) {
            if (at_end) emit_arguments(arguments_.cut_off());
            return;
          }
          if (hit.marker == 0) {
            consume(hit.length);
            state_ = State::ParameterHeader;
            break;
          }
          emit_arguments(arguments_.end());
          if (hit.marker == 1) consume(hit.length);  // </invoke>; a section end or a new invoke is left to Tools
          state_ = State::Tools;
          break;
        }
        case State::StringValue:
        case State::OtherValue: {
          // A value ends at its end tag, or at a tag that cannot be inside it.
          MarkerHit hit = find_marker(buffer_, {s.parameter_end, s.invoke_end, s.section_end}, at_end);
          std::string_view text = std::string_view(buffer_).substr(0, hit.pos);
          if (state_ == State::StringValue) emit_arguments(arguments_.string_part(text));
          else value_ += text;
          consume(hit.pos);
          if (!hit.found()) {
            if (at_end) emit_arguments(arguments_.cut_off());  // a cut-off value is not finished
            return;
          }
          if (state_ == State::StringValue) emit_arguments(arguments_.end_string());
          else emit_arguments(arguments_.value(parameter_, coerce_value(value_, value_types_)));
          if (hit.marker == 0) consume(hit.length);
          state_ = State::Invoke;
          break;
        }
        case State::SkippedInvoke: {
          MarkerHit hit = find_marker(buffer_, {s.invoke_end, s.section_end}, at_end);
          consume(hit.pos);
          if (!hit.found()) return;
          if (hit.marker == 0) consume(hit.length);
          state_ = State::Tools;
          break;
        }
      }
    }
  }

  // The attributes of the tag whose name was just consumed, once its '>' has arrived (consumed with
  // them); nullopt while it has not. At the end of the stream an unfinished tag is dropped.
  std::optional<std::map<std::string, std::string>> take_tag_attributes(bool at_end) {
    size_t close = buffer_.find('>');
    if (close == std::string::npos) {
      if (at_end) {
        buffer_.clear();
        if (state_ == State::ParameterHeader) emit_arguments(arguments_.cut_off());
      }
      return std::nullopt;
    }
    auto attributes = parse_attributes(std::string_view(buffer_).substr(0, close));
    consume(close + 1);
    return attributes;
  }

  const XmlSyntax& syntax_;
  State state_ = State::Content;
  std::string tool_, parameter_, value_;
  std::set<std::string> value_types_;
  ArgumentsWriter arguments_;
};

}  // namespace

std::unique_ptr<ToolParser> make_minimax_m2_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed) {
  return std::make_unique<XmlToolParser>(kMinimaxM2, tools, id_seed);
}

std::unique_ptr<ToolParser> make_deepseek_v32_tool_parser(const nlohmann::json& tools,
                                                          std::optional<uint64_t> id_seed) {
  return std::make_unique<XmlToolParser>(kDeepseekV32, tools, id_seed);
}

}  // namespace sparrow::parsers
