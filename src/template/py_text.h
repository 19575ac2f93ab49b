// Python's text behaviour on UTF-8 strings, byte-exact with CPython: repr of floats and strings,
// json.dumps string escaping, and the str methods chat templates call (split, strip, replace, ...).
// Positions and lengths count code points, as Python does.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::jinja {

// repr(float): the shortest string that round-trips ("0.1", "1e-05", "1e+16", "inf", "nan").
std::string float_repr(double x);
// repr(str): quoted with ' (or " when the text holds ' but no "), escaping like CPython.
std::string string_repr(std::string_view s);
// The quoted JSON string json.dumps writes for `s`.
void json_quote(std::string& out, std::string_view s, bool ensure_ascii);

// str.strip / lstrip / rstrip; `chars` absent strips whitespace.
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
// str.split / str.rsplit; `sep` absent splits on runs of whitespace. maxsplit < 0: no limit.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> splitlines(std::string_view s, bool keep_ends);
// str.replace(old, new, count); count < 0 replaces all.
std::string replace(std::string_view s, std::string_view old_text, std::string_view new_text, int64_t count);
// str.find / str.rfind: the code-point index of the first / last occurrence, or -1.
int64_t find(std::string_view s, std::string_view sub, bool from_right);
int64_t count(std::string_view s, std::string_view sub);  // non-overlapping occurrences
std::string title(std::string_view s);                    // str.title
std::string capitalize(std::string_view s);               // str.capitalize
// str.center / ljust / rjust with a one-character fill.
// replace and pad build strings larger than their input: both keep to kMaxStringBytes (jinja_limits.h);
// the splits keep to kMaxListItems pieces.
std::string pad(std::string_view s, int64_t width, std::string_view fill, char align);

// Parses an int the way Python's int(text, base) does (whitespace, sign, underscores); nullopt when
// the text is not an integer.
std::optional<int64_t> parse_int(std::string_view text, int base);
// Python's float(text); nullopt when the text is not a number.
std::optional<double> parse_float(std::string_view text);

}  // namespace sparrow::jinja
