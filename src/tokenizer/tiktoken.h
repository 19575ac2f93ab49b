// Kimi's tokenizer: a tiktoken BPE (tiktoken.model) with the split pattern and special tokens of Kimi's
// tokenization_kimi.py (TikTokenTokenizer). Encodes as tiktoken's
// Encoding(pat_str, mergeable_ranks, special_tokens).encode(text, allowed_special="all").
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"

namespace sparrow {

// TikTokenTokenizer.pat_str of tokenization_kimi.py, in the syntax of Rust's regex crate.
extern const char* const kKimiPattern;

class TiktokenTokenizer : public Tokenizer {
 public:
  // `model_text` is tiktoken.model: lines "<base64 token bytes> <rank>". The 256 ids after the ranks
  // are special tokens named by `tokenizer_config`'s added_tokens_decoder, the rest
  // <|reserved_token_{id}|> (`tokenizer_config` may be null).
  TiktokenTokenizer(std::string_view model_text, const nlohmann::json& tokenizer_config);

  std::vector<TokenId> encode(std::string_view text) const override;

 private:
  std::vector<TokenId> byte_pair_encode(std::string_view piece) const;

  StringMap<TokenId> ranks_;
  Regex pattern_;
  AddedTokenMatcher specials_;
};

}  // namespace sparrow
