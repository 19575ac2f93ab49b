#include "tokenizer/added_tokens.h"

#include <algorithm>

#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

// tokenizers decides these with Rust regexes: \w$ / ^\w for single_word, \s*$ / ^\s* for the strips.
bool is_word_char(std::string_view one_char) {
  static const Regex word(R"(\w)");
  return !word.find_all(one_char).empty();
}

bool is_white_space(std::string_view one_char) {
  static const Regex space(R"(\s)");
  return !space.find_all(one_char).empty();
}

std::string_view first_char(std::string_view s) {
  return s.substr(0, utf8::sequence_length(static_cast<unsigned char>(s[0])));
}

std::string_view last_char(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return s.substr(start);
}

// Where the white space at the end of `s` begins.
size_t trailing_space_start(std::string_view s) {
  while (!s.empty() && is_white_space(last_char(s))) s.remove_suffix(last_char(s).size());
  return s.size();
}

// How many bytes of white space `s` begins with.
size_t leading_space_length(std::string_view s) {
  size_t n = 0;
  while (n < s.size() && is_white_space(first_char(s.substr(n)))) n += first_char(s.substr(n)).size();
  return n;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)), patterns_(std::move(patterns)) {
  for (size_t k = 0; k < patterns_.size(); ++k)
    if (!patterns_[k].empty()) by_first_byte_[static_cast<unsigned char>(patterns_[k][0])].push_back(k);
  for (auto& bucket : by_first_byte_)
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](size_t a, size_t b) { return patterns_[a].size() > patterns_[b].size(); });
}

std::optional<std::pair<size_t, size_t>> AddedTokenMatcher::next_match(std::string_view text, size_t from) const {
  for (size_t start = from; start < text.size(); ++start)
    for (size_t k : by_first_byte_[static_cast<unsigned char>(text[start])])
      if (text.compare(start, patterns_[k].size(), patterns_[k]) == 0) return std::pair{start, k};
  return std::nullopt;
}

std::vector<AddedTokenMatcher::Segment> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<Segment> segments;
  size_t start_offset = 0;  // end of the last segment
  size_t search = 0;        // where the next match may start
  while (auto match = next_match(text, search)) {
    auto [start, k] = *match;
    size_t stop = start + patterns_[k].size();
    search = stop;

    const AddedToken& token = tokens_[k];
    if (token.single_word) {
      bool word_before = start > 0 && is_word_char(last_char(text.substr(0, start)));
      bool word_after = stop < text.size() && is_word_char(first_char(text.substr(stop)));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (start_offset < start) segments.push_back({start_offset, start, -1});
    segments.push_back({start, stop, token.id});
    start_offset = stop;
  }
  if (start_offset != text.size()) segments.push_back({start_offset, text.size(), -1});
  return segments;
}

}  // namespace sparrow
