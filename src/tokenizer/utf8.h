// UTF-8 helpers for the tokenizers: walking code points, validation, and the lossy decoding that both
// reference libraries use when token bytes do not form UTF-8.
#pragma once
#include <string>
#include <string_view>

namespace sparrow::utf8 {

// The code point starting at s[i]; advances i past it. `s` must be valid UTF-8.
char32_t next(std::string_view s, size_t& i);

// The length in bytes of the UTF-8 sequence that starts with `lead` (1 for a byte that starts none).
size_t sequence_length(unsigned char lead);

void append(std::string& out, char32_t code_point);

bool is_valid(std::string_view s);

// Decodes `bytes` as Rust's String::from_utf8_lossy and Python's bytes.decode("utf-8", "replace") do:
// every maximal subpart of an ill-formed sequence becomes one U+FFFD (Unicode 15 §3.9, "U+FFFD
// substitution of maximal subparts"). Appends to `out` and returns the number of bytes consumed.
// With `final` false, a sequence cut off by the end of `bytes` that could still complete is left
// unconsumed, so a stream decodes to the same text as the whole.
size_t decode_lossy(std::string_view bytes, bool final, std::string& out);

inline std::string decode_lossy(std::string_view bytes) {
  std::string out;
  decode_lossy(bytes, /*final=*/true, out);
  return out;
}

}  // namespace sparrow::utf8
