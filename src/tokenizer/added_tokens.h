// tokenizer.json "added_tokens": special and added tokens that are found in the text before it is
// pre-tokenized, as tokenizers' AddedVocabulary does.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/token_types.h"

namespace sparrow {

struct AddedToken {
  std::string content;
  TokenId id = -1;
  bool special = false;
  bool normalized = false;   // matched in normalized text (its own content normalized too)
  bool lstrip = false;       // also takes the white space before it
  bool rstrip = false;       // also takes the white space after it
  bool single_word = false;  // only where no word character touches it
};

// Finds a set of added tokens in text: leftmost match first, the longest at one position, then the
// search resumes after it (tokenizers' Aho-Corasick in LeftmostLongest mode).
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;  // matches nothing
  // `patterns[k]` is the text that finds `tokens[k]` (its content, or its normalized content).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);

  // A part of the text: either an added token or the text between tokens.
  struct Segment {
    size_t begin, end;
    TokenId token;  // -1 for plain text
  };
  // The text cut at the tokens, with the lstrip / rstrip / single_word rules of
  // AddedVocabulary::find_matches. Segments cover the text in order.
  std::vector<Segment> split(std::string_view text) const;

 private:
  // The leftmost match at or after `from`, the longest there: (start, pattern index).
  std::optional<std::pair<size_t, size_t>> next_match(std::string_view text, size_t from) const;

  std::vector<AddedToken> tokens_;
  std::vector<std::string> patterns_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // pattern indices, longest first
};

}  // namespace sparrow
