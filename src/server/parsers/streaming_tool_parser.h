// What every tool parser shares: a buffer of text not yet decided, the content before the first tool
// section, the calls announced so far, and writers for the arguments JSON. Each format subclass only
// implements scan(): consume from the front of the buffer whatever can be decided now.
//
// The non-streaming result is the same machine fed the whole text at once (parse_output), so streamed
// and non-streamed results agree by construction; a format only has to make scan() independent of where
// the text was split, which it does by deciding nothing on a marker that could still be incomplete.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "server/parsers/parser.h"
#include "server/parsers/tool_schema.h"

namespace sparrow::parsers {

class StreamingToolParser : public ToolParser {
 public:
  StreamingToolParser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);
  ToolDelta feed(std::string_view text) final;
  ToolDelta finish() final;

 protected:
  // Consumes from the front of buffer_ what can be decided. at_end: the stream is over; decide all.
  virtual void scan(bool at_end) = 0;

  void consume(size_t n) { buffer_.erase(0, n); }

  // Text before the first tool section. Leading whitespace waits for the first visible character and
  // is dropped if tools come first (vLLM drops whitespace-only content before tool calls).
  void emit_content(std::string_view text);
  // The first tool section starts: content is over, whatever follows is tool markup or dropped.
  void begin_tools();

  // Announces the next call (index 0, 1, ...) and makes it the one emit_arguments() writes to.
  void open_call(std::string id, std::string name);
  void emit_arguments(std::string_view fragment);
  int calls_opened() const { return calls_opened_; }
  // "call_" + 24 hex digits, for formats whose calls carry no id (vLLM's MiniMax and DeepSeek parsers).
  std::string generated_id();

  std::string buffer_;
  const ToolSchemas schemas_;

 private:
  ToolDelta out_;
  std::string pending_space_;
  bool content_started_ = false, tools_begun_ = false;
  int calls_opened_ = 0;
  std::mt19937_64 id_random_;
};

// Writes one call's arguments as a JSON object, a parameter at a time, so that they can stream: a
// string value streams as its text arrives; any other value is written whole once known (its type can
// depend on all of its text). Each method returns the next fragment of the arguments text.
class ArgumentsWriter {
 public:
  std::string begin_string(std::string_view key);  // {"key":"   (or ,"key":")
  std::string string_part(std::string_view text);  // the escaped text
  std::string end_string();                         // "
  std::string value(std::string_view key, const nlohmann::json& value);
  std::string end();                                // } ({} without parameters)
  // The stream ended inside the call: what was written stays as it is ({} without parameters).
  std::string cut_off();

 private:
  std::string key_prefix(std::string_view key);
  bool has_parameters_ = false;
};

// Arguments the model writes as JSON text itself (Kimi): passed on verbatim as they arrive, without the
// whitespace around them (vLLM strips it), "{}" when there is nothing.
class RawArgumentsWriter {
 public:
  std::string part(std::string_view text);
  std::string end();  // "{}" when nothing was written

 private:
  std::string pending_space_;  // held until more text shows it is not trailing
  bool started_ = false;
};

// The format parsers, made by make_tool_parser.
std::unique_ptr<ToolParser> make_kimi_k2_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);
std::unique_ptr<ToolParser> make_kimi_k3_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);
std::unique_ptr<ToolParser> make_minimax_m2_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);
std::unique_ptr<ToolParser> make_minimax_m3_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);
std::unique_ptr<ToolParser> make_deepseek_v32_tool_parser(const nlohmann::json& tools, std::optional<uint64_t> id_seed);

}  // namespace sparrow::parsers
