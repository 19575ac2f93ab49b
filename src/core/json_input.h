// JSON from outside: request bodies, the tool-call arguments inside them, and the JSON the tool parsers
// read from model output. Such text may nest as deep and hold objects as large as its sender likes, so
// it is parsed here, not with nlohmann's parse():
//   - nesting: nlohmann's parser is iterative, but dump(), ==, copies and everything sparrow writes
//     over parsed values (the chat template's values among them) recurse once per level, and 20,000
//     levels overflow the stack. Text nested deeper than kMaxJsonDepth is refused while it is parsed,
//     so no deep value ever exists.
//   - size: nlohmann's ordered_json finds keys one by one, so its parser takes quadratic time on an
//     object of many keys (minutes for 200,000). Here objects are built through a hash index.
#pragma once
#include <nlohmann/json.hpp>
#include <string_view>

namespace sparrow {

// The deepest nesting of arrays and objects accepted. Tool schemas and arguments nest a few levels,
// rarely more than 20; pydantic (vLLM's validator) stops a little above 200.
constexpr int kMaxJsonDepth = 128;

template <typename Json>
struct JsonInput {
  enum class Status { Ok, Invalid, TooDeep } status = Status::Ok;
  Json value;  // discarded unless Ok
  bool ok() const { return status == Status::Ok; }
};

// Parses one JSON text (RFC 8259; nothing may follow it). Objects keep their keys in the order written
// (nlohmann::ordered_json) or sorted (nlohmann::json); a repeated key keeps its first place and takes
// its last value, as Python's json.loads does. Time linear in the text's size.
template <typename Json>
JsonInput<Json> parse_json_input(std::string_view text);

extern template JsonInput<nlohmann::json> parse_json_input(std::string_view);
extern template JsonInput<nlohmann::ordered_json> parse_json_input(std::string_view);

}  // namespace sparrow
