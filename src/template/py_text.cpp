#include "template/py_text.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "template/jinja_limits.h"
#include "template/unicode.h"

namespace sparrow::jinja {

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  // std::to_chars gives the shortest round-trip digits, like CPython's dtoa mode 0; only the layout
  // differs. CPython (float_repr_style 'short') writes an exponent when the decimal point would sit
  // more than 16 digits right or 4 left of the first digit.
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, result.ptr);  // "-1.2345e-07"
  std::string out;
  if (sci[0] == '-') {
    out = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (sci[i] != '.') digits += sci[i];
  int point = std::atoi(sci.c_str() + e + 1) + 1;  // value = 0.<digits> × 10^point
  int n = static_cast<int>(digits.size());
  if (point <= -4 || point > 16) {
    out += digits[0];
    if (n > 1) out += "." + digits.substr(1);
    int exponent = point - 1;
    out += exponent < 0 ? "e-" : "e+";
    if (std::abs(exponent) < 10) out += '0';
    out += std::to_string(std::abs(exponent));
  } else if (point <= 0) {
    out += "0." + std::string(-point, '0') + digits;
  } else if (point >= n) {
    out += digits + std::string(point - n, '0') + ".0";
  } else {
    out += digits.substr(0, point) + "." + digits.substr(point);
  }
  return out;
}

namespace {

void append_hex(std::string& out, const char* prefix, unsigned value, int width) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s%0*x", prefix, width, value);
  out += buf;
}

}  // namespace

std::string string_repr(std::string_view s) {
  char quote = '\'';
  if (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) quote = '"';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (is_printable(c)) {
      utf8::append(out, c);
    } else if (c <= 0xFF) {
      append_hex(out, "\\x", c, 2);
    } else if (c <= 0xFFFF) {
      append_hex(out, "\\u", c, 4);
    } else {
      append_hex(out, "\\U", c, 8);
    }
  }
  out += quote;
  return out;
}

void json_quote(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c > 0xFFFF) {  // a surrogate pair, as Python writes it
        char32_t v = c - 0x10000;
        append_hex(out, "\\u", 0xD800 + (v >> 10), 4);
        append_hex(out, "\\u", 0xDC00 + (v & 0x3FF), 4);
      } else {
        append_hex(out, "\\u", c, 4);
      }
    } else {
      utf8::append(out, c);
    }
  }
  out += '"';
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  std::u32string text = utf8_decode(s);
  std::u32string set = chars ? utf8_decode(*chars) : std::u32string();
  auto strippable = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : is_space(c); };
  size_t begin = 0, end = text.size();
  if (left)
    while (begin < end && strippable(text[begin])) ++begin;
  if (right)
    while (end > begin && strippable(text[end - 1])) --end;
  return utf8_encode(std::u32string_view(text).substr(begin, end - begin));
}

namespace {

std::vector<std::string> split_whitespace(std::string_view s, int64_t maxsplit, bool from_right) {
  std::u32string text = utf8_decode(s);
  std::vector<std::u32string> parts;
  if (!from_right) {
    size_t i = 0, n = text.size();
    while (true) {
      while (i < n && is_space(text[i])) ++i;
      if (i == n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(text.substr(i));  // the rest, trailing whitespace included
        break;
      }
      size_t start = i;
      while (i < n && !is_space(text[i])) ++i;
      parts.push_back(text.substr(start, i - start));
      check_list_size(int64_t(parts.size()));
    }
  } else {
    size_t i = text.size();
    while (true) {
      while (i > 0 && is_space(text[i - 1])) --i;
      if (i == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(text.substr(0, i));
        break;
      }
      size_t end = i;
      while (i > 0 && !is_space(text[i - 1])) --i;
      parts.push_back(text.substr(i, end - i));
      check_list_size(int64_t(parts.size()));
    }
    std::reverse(parts.begin(), parts.end());
  }
  std::vector<std::string> out;
  for (const auto& p : parts) out.push_back(utf8_encode(p));
  return out;
}

}  // namespace

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  if (!sep) return split_whitespace(s, maxsplit, false);
  std::vector<std::string> out;
  size_t start = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t at = s.find(*sep, start);
    if (at == std::string_view::npos) break;
    out.emplace_back(s.substr(start, at - start));
    check_list_size(int64_t(out.size()));
    start = at + sep->size();
  }
  out.emplace_back(s.substr(start));
  return out;
}

std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  if (!sep) return split_whitespace(s, maxsplit, true);
  std::vector<std::string> out;
  size_t end = s.size();
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    if (end < sep->size()) break;
    size_t at = s.rfind(*sep, end - sep->size());
    if (at == std::string_view::npos) break;
    out.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
    check_list_size(int64_t(out.size()));
    end = at;
  }
  out.emplace_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> splitlines(std::string_view s, bool keep_ends) {
  std::u32string text = utf8_decode(s);
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    if (!is_line_break(text[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    i += (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ? 2 : 1;
    out.push_back(utf8_encode(std::u32string_view(text).substr(start, (keep_ends ? i : end) - start)));
    check_list_size(int64_t(out.size()));
    start = i;
  }
  if (start < text.size()) out.push_back(utf8_encode(std::u32string_view(text).substr(start)));
  return out;
}

std::string replace(std::string_view s, std::string_view old_text, std::string_view new_text, int64_t count) {
  std::string out;
  if (old_text.empty()) {  // Python inserts `new` before every character and at the end
    std::u32string text = utf8_decode(s);
    int64_t done = 0;
    for (char32_t c : text) {
      if (count < 0 || done < count) out += new_text, ++done;
      utf8::append(out, c);
      check_string_size(int64_t(out.size()));
    }
    if (count < 0 || done < count) out += new_text;
    return out;
  }
  size_t start = 0;
  for (int64_t done = 0; count < 0 || done < count; ++done) {
    size_t at = s.find(old_text, start);
    if (at == std::string_view::npos) break;
    out += s.substr(start, at - start);
    out += new_text;
    check_string_size(int64_t(out.size()));
    start = at + old_text.size();
  }
  out += s.substr(start);
  return out;
}

int64_t find(std::string_view s, std::string_view sub, bool from_right) {
  size_t at = from_right ? s.rfind(sub) : s.find(sub);
  if (at == std::string_view::npos) return -1;
  return static_cast<int64_t>(utf8_length(s.substr(0, at)));
}

int64_t count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(utf8_length(s)) + 1;
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string_view::npos; at = s.find(sub, at + sub.size())) ++n;
  return n;
}

namespace {

// Python's title case of one character (what str.title and str.capitalize put first).
void append_title_case(std::string& out, char32_t c) {
  if (c == 0xDF) out += "Ss";  // 'ß'.title() == 'Ss'
  else utf8::append(out, to_upper(c));
}

}  // namespace

std::string title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : utf8_decode(s)) {
    if (previous_cased) utf8::append(out, to_lower(c));
    else append_title_case(out, c);
    previous_cased = is_cased(c);
  }
  return out;
}

std::string capitalize(std::string_view s) {
  std::u32string text = utf8_decode(s);
  if (text.empty()) return "";
  std::string out;
  append_title_case(out, text[0]);
  out += lower(utf8_encode(text.substr(1)));
  return out;
}

std::string pad(std::string_view s, int64_t width, std::string_view fill, char align) {
  int64_t margin = width - static_cast<int64_t>(utf8_length(s));
  if (margin <= 0) return std::string(s);
  // CPython's str.center puts the odd extra character on the left only when width is odd.
  int64_t left = align == '<' ? 0 : align == '>' ? margin : margin / 2 + (margin & width & 1);
  check_string_size(int64_t(s.size()) + int64_t(std::min<uint64_t>(margin, kMaxStringBytes) * fill.size()));
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < margin - left; ++i) out += fill;
  return out;
}

namespace {

// Python number literals allow single underscores between digits; returns the text without them, or
// nullopt when an underscore is misplaced.
std::optional<std::string> without_underscores(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '_') {
      out += text[i];
      continue;
    }
    bool between_digits = i > 0 && i + 1 < text.size() && std::isalnum(static_cast<unsigned char>(text[i - 1])) &&
                          std::isalnum(static_cast<unsigned char>(text[i + 1]));
    if (!between_digits) return std::nullopt;
  }
  return out;
}

}  // namespace

std::optional<int64_t> parse_int(std::string_view text, int base) {
  std::string trimmed = strip(text, std::nullopt, true, true);
  auto clean = without_underscores(trimmed);
  if (!clean || clean->empty()) return std::nullopt;
  std::string_view digits = *clean;
  bool negative = false;
  if (digits[0] == '+' || digits[0] == '-') {
    negative = digits[0] == '-';
    digits.remove_prefix(1);
  }
  if (base == 16 && digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X'))
    digits.remove_prefix(2);
  if (digits.empty()) return std::nullopt;
  uint64_t magnitude = 0;
  auto result = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude, base);
  if (result.ec != std::errc() || result.ptr != digits.data() + digits.size()) return std::nullopt;
  if (magnitude > static_cast<uint64_t>(INT64_MAX) + (negative ? 1 : 0)) return std::nullopt;
  return negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
}

std::optional<double> parse_float(std::string_view text) {
  std::string trimmed = strip(text, std::nullopt, true, true);
  auto clean = without_underscores(trimmed);
  if (!clean || clean->empty()) return std::nullopt;
  for (char c : *clean)
    if (c == 'x' || c == 'X' || c == 'p' || c == 'P') return std::nullopt;  // strtod's hex floats
  char* end = nullptr;
  double value = std::strtod(clean->c_str(), &end);
  if (end != clean->c_str() + clean->size()) return std::nullopt;
  return value;
}

}  // namespace sparrow::jinja
