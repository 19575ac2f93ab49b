// A Hugging Face tokenizer.json with a byte-level BPE model, encoding as tokenizers'
// TokenizerImpl::encode_single_sequence:
//   1. cut the text at added tokens whose "normalized" is false;
//   2. normalize each remaining part (NFC or nothing), cut it at the normalized added tokens;
//   3. run the pre-tokenizers over each remaining part (Split / ByteLevel / Digits);
//   4. encode each piece with the BPE model.
// Decoding is the ByteLevel decoder: each token's characters mapped back to bytes.
// "post_processor" (BOS/EOS templates), "truncation" and "padding" are not applied: sparrow adds no
// special tokens, and transformers' fast tokenizers switch truncation and padding off unless asked.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace sparrow {

class HfTokenizer : public Tokenizer {
 public:
  // `tokenizer_json` is the parsed file; unsupported parts are one-line errors.
  explicit HfTokenizer(const nlohmann::json& tokenizer_json);

  std::vector<TokenId> encode(std::string_view text) const override;

 private:
  void encode_plain_text(std::string_view text, std::vector<TokenId>& ids) const;

  bool nfc_ = false;
  std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers_;
  BpeModel model_;
  AddedTokenMatcher raw_tokens_;         // added tokens with normalized = false
  AddedTokenMatcher normalized_tokens_;  // added tokens with normalized = true
};

}  // namespace sparrow
