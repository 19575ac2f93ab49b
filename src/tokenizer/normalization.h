// Unicode normalization for tokenizer.json normalizers.
#pragma once
#include <string>
#include <string_view>

namespace sparrow::unicode {

// Normalization Form C (UAX #15): canonical decomposition, canonical ordering, canonical composition.
// `text` must be valid UTF-8.
std::string nfc(std::string_view text);

}  // namespace sparrow::unicode
