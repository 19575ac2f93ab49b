#include "core/base64.h"

#include <algorithm>
#include <cstdint>

#include "core/error.h"

namespace sparrow {

std::string base64_decode(std::string_view text) {
  auto value = [](char c) -> uint32_t {
    if (c >= 'A' && c <= 'Z') return uint32_t(c - 'A');
    if (c >= 'a' && c <= 'z') return uint32_t(c - 'a' + 26);
    if (c >= '0' && c <= '9') return uint32_t(c - '0' + 52);
    if (c == '+') return 62;
    if (c == '/') return 63;
    fail("bad base64 character");
  };
  SPARROW_CHECK(text.size() % 4 == 0 && !text.empty(), "bad base64 length ", text.size());
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const int padding = text[i + 3] != '=' ? 0 : text[i + 2] != '=' ? 1 : 2;
    SPARROW_CHECK(padding == 0 || i + 4 == text.size(), "bad base64 padding");
    const uint32_t bits = (value(text[i]) << 18) | (value(text[i + 1]) << 12) |
                          (padding == 2 ? 0 : value(text[i + 2]) << 6) | (padding >= 1 ? 0 : value(text[i + 3]));
    out += char(bits >> 16);
    if (padding < 2) out += char((bits >> 8) & 0xFF);
    if (padding < 1) out += char(bits & 0xFF);
  }
  return out;
}

std::string base64_encode(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t bits = uint32_t(uint8_t(bytes[i])) << 16;
    if (n > 1) bits |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    if (n > 2) bits |= uint32_t(uint8_t(bytes[i + 2]));
    out += kAlphabet[(bits >> 18) & 63];
    out += kAlphabet[(bits >> 12) & 63];
    out += n > 1 ? kAlphabet[(bits >> 6) & 63] : '=';
    out += n > 2 ? kAlphabet[bits & 63] : '=';
  }
  return out;
}

}  // namespace sparrow
