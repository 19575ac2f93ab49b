// Small text helpers the streaming parsers share: finding markers in buffered text without deciding
// too early (a marker may be split across deltas), whitespace, and JSON text.
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::parsers {

// The earliest complete occurrence of any of `markers` in `text` (at one position, the first listed
// wins): `marker` is its index, `pos` where it starts, `length` its length. Without one, `marker` is -1 and `pos` is how much
// of `text` is decided: all of it at the end of the stream, otherwise all but the longest tail that
// could still grow into a marker. No marker may be a prefix of another (the answer would depend on how
// the text was split).
struct MarkerHit {
  size_t pos = 0;
  int marker = -1;
  size_t length = 0;
  bool found() const { return marker >= 0; }
};
MarkerHit find_marker(std::string_view text, const std::vector<std::string_view>& markers, bool at_end);

// `text` is a proper beginning of `whole` (more text could complete it).
inline bool could_become(std::string_view text, std::string_view whole) {
  return text.size() < whole.size() && whole.substr(0, text.size()) == text;
}

inline bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }
size_t leading_space(std::string_view text);   // how many bytes of whitespace `text` starts with
size_t trailing_space(std::string_view text);  // how many bytes of whitespace `text` ends with
std::string_view trim(std::string_view text);

// The attributes of a tag written `name="value" other='value' bare=value`: name -> value, as written
// (no unescaping).
std::map<std::string, std::string> parse_attributes(std::string_view text);

// Compact JSON text (vLLM's json.dumps with ensure_ascii=False, without the spaces); invalid UTF-8 is
// replaced, never thrown.
std::string json_text(const nlohmann::json& value);
// The body of a JSON string holding `raw`: escaped, without the quotes. Escaping piece by piece equals
// escaping the joined text, so string values can stream.
std::string json_string_body(std::string_view raw);

}  // namespace sparrow::parsers
