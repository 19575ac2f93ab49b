#include "template/unicode.h"

#include "tokenizer/utf8.h"

namespace sparrow::jinja {

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) out.push_back(utf8::next(s, i));
  return out;
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8::append(out, c);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char ch : s) n += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return n;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_printable(char32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7F;
  if (c <= 0xA0 || c == 0xAD) return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x1680 || c == 0x180E) return false;
  if ((c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x2064) ||
      (c >= 0x2066 && c <= 0x206F) || c == 0x3000)
    return false;
  if ((c >= 0xD800 && c <= 0xF8FF) || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB) || c == 0xFFFE || c == 0xFFFF)
    return false;
  if (c == 0xE0001 || (c >= 0xE0020 && c <= 0xE007F) || c >= 0xF0000) return false;
  return true;
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}

namespace {

// Blocks where upper and lower case alternate (upper on even or odd code points).
bool alternating_upper(char32_t c, char32_t first, char32_t last) {
  return c >= first && c <= last && ((c - first) % 2 == 0);
}
bool alternating_lower(char32_t c, char32_t first, char32_t last) {
  return c >= first && c <= last && ((c - first) % 2 == 1);
}

struct AlternatingBlock {
  char32_t first, last;  // `first` is an upper-case letter
};
constexpr AlternatingBlock kAlternating[] = {
    {0x100, 0x12F}, {0x132, 0x137}, {0x139, 0x148}, {0x14A, 0x177},   {0x179, 0x17E},   {0x460, 0x481},
    {0x48A, 0x4BF}, {0x4C1, 0x4CE}, {0x4D0, 0x52F}, {0x1E00, 0x1E95}, {0x1EA0, 0x1EFF},
};

struct ShiftedBlock {
  char32_t first, last;  // upper-case range
  char32_t delta;        // lower = upper + delta
};
constexpr ShiftedBlock kShifted[] = {
    {'A', 'Z', 32},       {0xC0, 0xD6, 32},     {0xD8, 0xDE, 32},     {0x388, 0x38A, 37}, {0x38E, 0x38F, 63},
    {0x391, 0x3A1, 32},   {0x3A3, 0x3AB, 32},   {0x400, 0x40F, 80},   {0x410, 0x42F, 32}, {0x531, 0x556, 48},
    {0x2160, 0x216F, 16}, {0x24B6, 0x24CF, 26}, {0xFF21, 0xFF3A, 32},
};

}  // namespace

char32_t to_lower(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  for (const auto& b : kShifted)
    if (c >= b.first && c <= b.last) return c + b.delta;
  for (const auto& b : kAlternating)
    if (alternating_upper(c, b.first, b.last)) return c + 1;
  switch (c) {
    case 0x130:
      return 'i';
    case 0x178:
      return 0xFF;
    case 0x386:
      return 0x3AC;
    case 0x38C:
      return 0x3CC;
    case 0x4C0:
      return 0x4CF;
    case 0x1E9E:
      return 0xDF;
    default:
      return c;
  }
}

char32_t to_upper(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  for (const auto& b : kShifted)
    if (c >= b.first + b.delta && c <= b.last + b.delta) return c - b.delta;
  for (const auto& b : kAlternating)
    if (alternating_lower(c, b.first, b.last)) return c - 1;
  switch (c) {
    case 0xB5:
      return 0x39C;
    case 0xFF:
      return 0x178;
    case 0x131:
      return 'I';
    case 0x17F:
      return 'S';
    case 0x3C2:
      return 0x3A3;
    case 0x3AC:
      return 0x386;
    case 0x3CC:
      return 0x38C;
    case 0x4CF:
      return 0x4C0;
    default:
      return c;
  }
}

bool is_cased(char32_t c) { return to_lower(c) != c || to_upper(c) != c || c == 0xDF || c == 0x130; }

bool is_alpha(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (is_cased(c) || c == 0xAA || c == 0xBA) return true;
  return (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) || (c >= 0x904 && c <= 0x939) ||
         (c >= 0xE01 && c <= 0xE30) || (c >= 0x3041 && c <= 0x3096) || (c >= 0x30A1 && c <= 0x30FA) ||
         (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xAC00 && c <= 0xD7A3) ||
         (c >= 0x20000 && c <= 0x2FA1F);
}

bool is_digit(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 0x660 && c <= 0x669) || (c >= 0x6F0 && c <= 0x6F9) ||
         (c >= 0x966 && c <= 0x96F) || (c >= 0xFF10 && c <= 0xFF19);
}

std::string lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : utf8_decode(s)) {
    if (c == 0x130) {  // Python: 'İ'.lower() == 'i̇' (i + combining dot above)
      out += "i\xCC\x87";
      continue;
    }
    utf8::append(out, to_lower(c));
  }
  return out;
}

std::string upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : utf8_decode(s)) {
    if (c == 0xDF) {  // Python: 'ß'.upper() == 'SS'
      out += "SS";
      continue;
    }
    utf8::append(out, to_upper(c));
  }
  return out;
}

}  // namespace sparrow::jinja
