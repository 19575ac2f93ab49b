// Unicode data for NFC normalization, generated into unicode_tables.cpp by tools/make_unicode_tables.py.
// Every table is sorted by its first field, for binary search.
#pragma once
#include <cstddef>
#include <cstdint>

namespace sparrow::unicode_tables {

struct CombiningClassRange {
  char32_t first, last;
  uint8_t combining_class;
};
// Full canonical decomposition of `code_point`: kDecompositionCodePoints[start, start + length).
struct Decomposition {
  char32_t code_point;
  uint16_t start;
  uint8_t length;
};
// NFC composes `first` + `second` into `composite`.
struct Composition {
  char32_t first, second, composite;
};

extern const CombiningClassRange kCombiningClasses[];
extern const size_t kCombiningClassCount;
extern const char32_t kDecompositionCodePoints[];
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionCount;
extern const Composition kCompositions[];
extern const size_t kCompositionCount;

}  // namespace sparrow::unicode_tables
