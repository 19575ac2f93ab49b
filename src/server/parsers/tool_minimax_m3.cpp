// MiniMax-M3 tool calls (markers.h; vLLM's M3 parser, vllm/tool_parsers/_llm_nom/m3_text.py). Every tag
// follows the namespace token NS = "]<]minimax[>[", and a parameter is a tag named after its key:
//   NS<tool_call>\nNS<invoke name="get_weather">NS<city>Boston NS</city>NS<days>3NS</days>NS</invoke>\nNS</tool_call>
// A value is text, typed by the tool's schema like MiniMax-M2's (coerce_value; an undeclared parameter is
// a string); string values stream. A value that begins with a tag is nested: an object whose keys are the
// child tags (a repeated tag collects its values in a list), or, when the schema allows an array and the
// first child is <item>, an array of the children. Nested values are converted once complete, each level
// typed by the schema's "properties" / "items" (text without a schema stays a string), as vLLM does.
#include "core/json_input.h"
#include "server/parsers/markers.h"
#include "server/parsers/streaming_tool_parser.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {

using namespace minimax_m3;
using nlohmann::json;

// A nested parameter value as a tree of tags.
struct Element {
  std::string tag, text;
  std::vector<Element> children;
};

// Parses the body of a nested value: NS<a>text NS</a>NS<b>NS<c>1NS</c>NS</b> ... A closing tag closes the
// innermost open element of that name (and any left open inside it). A tag that would nest the call's
// arguments deeper than kMaxJsonDepth (core/json_input.h; the arguments object and this value take two
// levels) is kept as text, so the conversion below, which recurses once per level, stays shallow
// whatever the model writes, and the arguments can come back in a request.
Element parse_nested(std::string_view body) {
  Element root;
  std::vector<Element*> open = {&root};
  size_t at = body.find(kNamespace);
  for (size_t next; at != std::string_view::npos; at = next) {
    size_t start = at + kNamespace.size();
    next = body.find(kNamespace, start);
    std::string_view chunk = body.substr(start, next == std::string_view::npos ? std::string_view::npos : next - start);
    size_t close = chunk.find('>');
    if (!chunk.starts_with("<") || close == std::string_view::npos) {
      open.back()->text += chunk;
      continue;
    }
    std::string_view text_after = chunk.substr(close + 1);
    if (chunk.starts_with("</")) {
      std::string_view tag = chunk.substr(2, close - 2);
      for (size_t depth = open.size() - 1; depth > 0; --depth)
        if (open[depth]->tag == tag) {
          open.resize(depth);
          break;
        }
    } else if (int(open.size()) >= kMaxJsonDepth - 1) {
      open.back()->text += chunk;
      continue;
    } else {
      open.back()->children.push_back({std::string(chunk.substr(1, close - 1)), "", {}});
      open.push_back(&open.back()->children.back());
    }
    open.back()->text += text_after;
  }
  return root;
}

const json* subschema(const json* schema, const char* field, const std::string& key = "") {
  if (!schema || !schema->is_object() || !schema->contains(field)) return nullptr;
  const json& value = (*schema)[field];
  if (key.empty()) return value.is_object() ? &value : nullptr;
  return value.is_object() && value.contains(key) ? &value[key] : nullptr;
}

json to_json(const Element& element, const json* schema) {
  std::set<std::string> types = schema ? schema_types(*schema) : std::set<std::string>{};
  if (element.children.empty()) return types.empty() ? json(element.text) : coerce_value(element.text, types);
  if (types.count("array") && element.children.front().tag == "item") {
    json items = json::array();
    for (const Element& child : element.children) items.push_back(to_json(child, subschema(schema, "items")));
    return items;
  }
  json object = json::object();
  for (const Element& child : element.children) {
    json value = to_json(child, subschema(schema, "properties", child.tag));
    if (!object.contains(child.tag)) {
      object[child.tag] = std::move(value);
    } else {
      json& existing = object[child.tag];
      if (!existing.is_array()) existing = json::array({existing});
      existing.push_back(std::move(value));
    }
  }
  return object;
}

class MinimaxM3ToolParser final : public StreamingToolParser {
 public:
  using StreamingToolParser::StreamingToolParser;

 private:
  enum class State {
    Content,
    Tools,           // inside or after the section: only invokes matter
    Invoke,          // between the parameters of an announced call
    ValueStart,      // after NS<key>: scalar or nested?
    StringValue,     // streaming
    OtherValue,      // collected, converted at its end
    NestedValue,     // collected up to NS</key>
    SkippedInvoke,   // a call that was not announced
  };

  void scan(bool at_end) override {
    while (true) {
      switch (state_) {
        case State::Content: {
          MarkerHit hit = find_marker(buffer_, {kSectionBegin, kSectionEnd}, at_end);
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
        case State::Invoke:
        case State::SkippedInvoke: {
          std::optional<std::string> tag = next_tag(at_end);
          if (!tag) {
            if (at_end && state_ == State::Invoke) emit_arguments(arguments_.cut_off());
            return;
          }
          bool opens_invoke = tag->starts_with("<invoke");
          if (state_ == State::Tools) {
            consume_tag(*tag);
            if (opens_invoke) open_invoke(*tag);
            break;
          }
          if (opens_invoke || *tag == "</invoke>" || *tag == "</tool_call>") {
            if (state_ == State::Invoke) emit_arguments(arguments_.end());
            if (!opens_invoke) consume_tag(*tag);  // a new invoke without the old one's end: next round
            state_ = State::Tools;
            break;
          }
          consume_tag(*tag);
          if (state_ == State::Invoke && !tag->starts_with("</")) {
            key_ = tag->substr(1, tag->size() - 2);
            state_ = State::ValueStart;
          }
          break;
        }
        case State::ValueStart: {
          // NS followed by '<' but not "</" opens a child tag: the value is nested.
          std::string child_opening = std::string(kNamespace) + "<";
          if (could_become(buffer_, child_opening + "/") && !at_end) return;
          if (buffer_.starts_with(child_opening) && !buffer_.starts_with(child_opening + "/")) {
            value_.clear();
            state_ = State::NestedValue;
            break;
          }
          const json* schema = schemas_.parameter(tool_, key_);
          value_types_ = schema ? schema_types(*schema) : std::set<std::string>{"string"};
          if (value_types_ == std::set<std::string>{"string"}) {
            emit_arguments(arguments_.begin_string(key_));
            state_ = State::StringValue;
          } else {
            value_.clear();
            state_ = State::OtherValue;
          }
          break;
        }
        case State::StringValue:
        case State::OtherValue: {
          // A scalar value ends at the next tag (its own end tag, handled in Invoke).
          MarkerHit hit = find_marker(buffer_, {kNamespace}, at_end);
          std::string_view text = std::string_view(buffer_).substr(0, hit.pos);
          if (state_ == State::StringValue) emit_arguments(arguments_.string_part(text));
          else value_ += text;
          consume(hit.pos);
          if (!hit.found()) {
            if (at_end) emit_arguments(arguments_.cut_off());
            return;
          }
          if (state_ == State::StringValue) emit_arguments(arguments_.end_string());
          else emit_arguments(arguments_.value(key_, coerce_value(value_, value_types_)));
          state_ = State::Invoke;
          break;
        }
        case State::NestedValue: {
          std::string end_tag = std::string(kNamespace) + "</" + key_ + ">";
          MarkerHit hit = find_marker(buffer_, {end_tag, kSectionEnd}, at_end);
          if (!hit.found()) {
            if (at_end) emit_arguments(arguments_.cut_off());  // a cut-off nested value is lost
            if (at_end) buffer_.clear();
            return;
          }
          json value = to_json(parse_nested(std::string_view(buffer_).substr(0, hit.pos)),
                               schemas_.parameter(tool_, key_));
          emit_arguments(arguments_.value(key_, value));
          consume(hit.marker == 0 ? hit.pos + hit.length : hit.pos);
          state_ = State::Invoke;
          break;
        }
      }
    }
  }

  // `tag` is <invoke name="NAME">.
  void open_invoke(std::string_view tag) {
    constexpr std::string_view kInvoke = "<invoke";
    std::string name = parse_attributes(tag.substr(kInvoke.size(), tag.size() - kInvoke.size() - 1))["name"];
    if (name.empty() || !schemas_.accepts(name)) {
      state_ = State::SkippedInvoke;
      return;
    }
    open_call(generated_id(), name);
    tool_ = name;
    arguments_ = ArgumentsWriter();
    state_ = State::Invoke;
  }

  // The next complete tag after NS, e.g. "<invoke name=\"f\">" or "</city>"; the text before its NS is
  // dropped (consumed). nullopt while it is incomplete.
  std::optional<std::string> next_tag(bool at_end) {
    while (true) {  // a loop, not a recursion: the model may write any number of bare namespace tokens
      MarkerHit hit = find_marker(buffer_, {kNamespace}, at_end);
      consume(hit.pos);
      if (!hit.found()) return std::nullopt;
      size_t close = buffer_.find('>', kNamespace.size());
      if (close == std::string::npos) {
        if (at_end) buffer_.clear();
        return std::nullopt;
      }
      std::string tag = buffer_.substr(kNamespace.size(), close + 1 - kNamespace.size());
      if (tag.starts_with("<")) return tag;
      consume(kNamespace.size());  // a namespace token without a tag: skip it
    }
  }

  void consume_tag(const std::string& tag) { consume(kNamespace.size() + tag.size()); }

  State state_ = State::Content;
  std::string tool_, key_, value_;
  std::set<std::string> value_types_;
  ArgumentsWriter arguments_;
};

}  // namespace

std::unique_ptr<ToolParser> make_minimax_m3_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed) {
  return std::make_unique<MinimaxM3ToolParser>(tools, id_seed);
}

}  // namespace sparrow::parsers
