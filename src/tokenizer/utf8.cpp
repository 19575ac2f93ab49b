#include "tokenizer/utf8.h"

namespace sparrow::utf8 {
namespace {

// The range the second byte of a sequence must fall in, by lead byte (Unicode Table 3-7); later bytes
// are always 80..BF. Returns false for bytes that cannot lead a sequence.
bool second_byte_range(unsigned char lead, unsigned char& low, unsigned char& high) {
  low = 0x80;
  high = 0xBF;
  switch (lead) {
    case 0xE0: low = 0xA0; break;   // no overlong 3-byte forms
    case 0xED: high = 0x9F; break;  // no surrogates
    case 0xF0: low = 0x90; break;   // no overlong 4-byte forms
    case 0xF4: high = 0x8F; break;  // nothing above U+10FFFF
  }
  return lead >= 0xC2 && lead <= 0xF4;
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// The sequence at bytes[i]: `taken` bytes that either form one character (`complete`) or are the
// maximal subpart of an ill-formed sequence (at least one byte), which is `truncated` when it is a
// well-formed start cut off by the end of `bytes`.
struct Sequence {
  size_t taken;
  bool complete;
  bool truncated = false;
};

Sequence scan(std::string_view bytes, size_t i) {
  unsigned char lead = bytes[i];
  if (lead < 0x80) return {1, true};
  unsigned char low, high;
  if (!second_byte_range(lead, low, high)) return {1, false};
  size_t length = sequence_length(lead), taken = 1;
  while (taken < length && i + taken < bytes.size()) {
    unsigned char b = bytes[i + taken];
    bool fits = taken == 1 ? (b >= low && b <= high) : (b >= 0x80 && b <= 0xBF);
    if (!fits) break;
    ++taken;
  }
  return {taken, taken == length, taken < length && i + taken == bytes.size()};
}

}  // namespace

size_t sequence_length(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF8) return 4;
  return 1;
}

char32_t next(std::string_view s, size_t& i) {
  unsigned char lead = s[i];
  size_t length = sequence_length(lead);
  char32_t c = length == 1 ? lead : lead & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += length;
  return c;
}

void append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

size_t decode_lossy(std::string_view bytes, bool final, std::string& out) {
  size_t i = 0;
  while (i < bytes.size()) {
    Sequence seq = scan(bytes, i);
    if (seq.complete) {
      out.append(bytes.substr(i, seq.taken));
    } else if (seq.truncated && !final) {
      break;  // a sequence that the next bytes may still complete
    } else {
      out += kReplacement;
    }
    i += seq.taken;
  }
  return i;
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    Sequence seq = scan(s, i);
    if (!seq.complete) return false;
    i += seq.taken;
  }
  return true;
}

}  // namespace sparrow::utf8
