#include "server/parsers/streaming_tool_parser.h"

#include <cstdio>
#include <utility>

#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {
uint64_t random_seed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}
}  // namespace

StreamingToolParser::StreamingToolParser(const nlohmann::json& tools, std::optional<uint64_t> id_seed)
    : schemas_(tools), id_random_(id_seed ? *id_seed : random_seed()) {}

ToolDelta StreamingToolParser::feed(std::string_view text) {
  buffer_ += text;
  scan(/*at_end=*/false);
  return std::exchange(out_, {});
}

ToolDelta StreamingToolParser::finish() {
  scan(/*at_end=*/true);
  buffer_.clear();
  if (!tools_begun_) out_.content += pending_space_;  // whitespace-only content with no tools after it
  pending_space_.clear();
  return std::exchange(out_, {});
}

void StreamingToolParser::emit_content(std::string_view text) {
  if (tools_begun_ || text.empty()) return;
  if (!content_started_) {
    if (leading_space(text) == text.size()) {
      pending_space_ += text;
      return;
    }
    out_.content += pending_space_;
    pending_space_.clear();
    content_started_ = true;
  }
  out_.content += text;
}

void StreamingToolParser::begin_tools() {
  tools_begun_ = true;
  pending_space_.clear();
}

void StreamingToolParser::open_call(std::string id, std::string name) {
  out_.tool_calls.push_back({calls_opened_, std::move(id), std::move(name), ""});
  ++calls_opened_;
}

void StreamingToolParser::emit_arguments(std::string_view fragment) {
  if (fragment.empty() || calls_opened_ == 0) return;
  int index = calls_opened_ - 1;
  if (!out_.tool_calls.empty() && out_.tool_calls.back().index == index)
    out_.tool_calls.back().arguments += fragment;
  else
    out_.tool_calls.push_back({index, "", "", std::string(fragment)});
}

std::string StreamingToolParser::generated_id() {
  uint64_t high = id_random_(), low = id_random_();
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx%08llx", static_cast<unsigned long long>(high),
                static_cast<unsigned long long>(low >> 32));
  return std::string("call_") + hex;
}

std::string ArgumentsWriter::key_prefix(std::string_view key) {
  std::string prefix = has_parameters_ ? "," : "{";
  has_parameters_ = true;
  return prefix + "\"" + json_string_body(key) + "\":";
}

std::string ArgumentsWriter::begin_string(std::string_view key) { return key_prefix(key) + "\""; }

std::string ArgumentsWriter::string_part(std::string_view text) { return json_string_body(text); }

std::string ArgumentsWriter::end_string() { return "\""; }

std::string ArgumentsWriter::value(std::string_view key, const nlohmann::json& value) {
  return key_prefix(key) + json_text(value);
}

std::string ArgumentsWriter::end() { return has_parameters_ ? "}" : "{}"; }

std::string ArgumentsWriter::cut_off() { return has_parameters_ ? "" : "{}"; }

std::string RawArgumentsWriter::part(std::string_view text) {
  if (!started_) {
    text.remove_prefix(leading_space(text));
    if (text.empty()) return "";
    started_ = true;
  }
  size_t trailing = trailing_space(text);
  if (trailing == text.size()) {
    pending_space_ += text;
    return "";
  }
  std::string out = std::move(pending_space_) + std::string(text.substr(0, text.size() - trailing));
  pending_space_ = std::string(text.substr(text.size() - trailing));
  return out;
}

std::string RawArgumentsWriter::end() {
  pending_space_.clear();
  return started_ ? "" : "{}";
}

}  // namespace sparrow::parsers
