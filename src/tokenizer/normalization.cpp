#include "tokenizer/normalization.h"

#include <algorithm>
#include <vector>

#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace sparrow::unicode {
namespace {

namespace tables = unicode_tables;

// Hangul syllables decompose and compose by arithmetic (Unicode §3.12).
constexpr char32_t kHangulBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161, kTrailBase = 0x11A7;
constexpr char32_t kLeadCount = 19, kVowelCount = 21, kTrailCount = 28;
constexpr char32_t kSyllableCount = kLeadCount * kVowelCount * kTrailCount;

// Below U+0300 nothing combines, decomposes into a different NFC form or has a non-zero class, so
// text made only of such characters is already in NFC.
constexpr char32_t kFirstAffected = 0x300;

int combining_class(char32_t c) {
  if (c < kFirstAffected) return 0;
  const auto* end = tables::kCombiningClasses + tables::kCombiningClassCount;
  const auto* it = std::upper_bound(tables::kCombiningClasses, end, c,
                                    [](char32_t v, const tables::CombiningClassRange& r) { return v < r.first; });
  if (it == tables::kCombiningClasses) return 0;
  --it;
  return c <= it->last ? it->combining_class : 0;
}

void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kHangulBase && c < kHangulBase + kSyllableCount) {
    char32_t index = c - kHangulBase;
    out.push_back(kLeadBase + index / (kVowelCount * kTrailCount));
    out.push_back(kVowelBase + (index % (kVowelCount * kTrailCount)) / kTrailCount);
    if (index % kTrailCount != 0) out.push_back(kTrailBase + index % kTrailCount);
    return;
  }
  const auto* end = tables::kDecompositions + tables::kDecompositionCount;
  const auto* it = std::lower_bound(tables::kDecompositions, end, c,
                                    [](const tables::Decomposition& d, char32_t v) { return d.code_point < v; });
  if (it == end || it->code_point != c) {
    out.push_back(c);
    return;
  }
  out.insert(out.end(), tables::kDecompositionCodePoints + it->start,
             tables::kDecompositionCodePoints + it->start + it->length);
}

// The primary composite of `first` + `second`, or 0 when there is none.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kLeadBase && first < kLeadBase + kLeadCount && second >= kVowelBase &&
      second < kVowelBase + kVowelCount)
    return kHangulBase + ((first - kLeadBase) * kVowelCount + (second - kVowelBase)) * kTrailCount;
  if (first >= kHangulBase && first < kHangulBase + kSyllableCount && (first - kHangulBase) % kTrailCount == 0 &&
      second > kTrailBase && second < kTrailBase + kTrailCount)
    return first + (second - kTrailBase);
  const auto* end = tables::kCompositions + tables::kCompositionCount;
  const auto* it = std::lower_bound(tables::kCompositions, end, std::pair{first, second},
                                    [](const tables::Composition& c, std::pair<char32_t, char32_t> v) {
                                      return c.first != v.first ? c.first < v.first : c.second < v.second;
                                    });
  return it != end && it->first == first && it->second == second ? it->composite : 0;
}

}  // namespace

std::string nfc(std::string_view text) {
  bool affected = false;
  for (size_t i = 0; i < text.size() && !affected;) affected = utf8::next(text, i) >= kFirstAffected;
  if (!affected) return std::string(text);

  std::vector<char32_t> chars;
  for (size_t i = 0; i < text.size();) decompose(utf8::next(text, i), chars);

  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < chars.size();) {
    if (combining_class(chars[i]) == 0) {
      ++i;
      continue;
    }
    size_t run_end = i;
    while (run_end < chars.size() && combining_class(chars[run_end]) != 0) ++run_end;
    std::stable_sort(chars.begin() + i, chars.begin() + run_end,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = run_end;
  }

  // Canonical composition: each character joins the last starter unless a character between them
  // blocks it (has a class of 0 or at least its own).
  size_t starter = 0, kept = 1;
  int last_class = combining_class(chars[0]) == 0 ? 0 : 256;  // 256: no starter to compose with yet
  for (size_t i = 1; i < chars.size(); ++i) {
    char32_t c = chars[i];
    int cls = combining_class(c);
    char32_t composite = compose(chars[starter], c);
    if (composite != 0 && (last_class < cls || last_class == 0)) {
      chars[starter] = composite;
      continue;
    }
    if (cls == 0) starter = kept;
    last_class = cls;
    chars[kept++] = c;
  }
  chars.resize(kept);

  std::string out;
  out.reserve(text.size());
  for (char32_t c : chars) utf8::append(out, c);
  return out;
}

}  // namespace sparrow::unicode
