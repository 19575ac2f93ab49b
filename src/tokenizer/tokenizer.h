// Text <-> token ids, exactly as the model's reference tokenizer does it.
//
// A model folder holds one of:
//   tokenizer.json   Hugging Face byte-level BPE (DeepSeek-V3.2, MiniMax, Qwen families): HfTokenizer
//   tiktoken.model   Kimi's tiktoken BPE (Kimi-K2, Kimi-Linear): TiktokenTokenizer
// plus, usually, tokenizer_config.json (bos/eos tokens; Kimi's special-token names).
//
// encode() equals tokenizers' encode(text, add_special_tokens=False) and tiktoken's
// encode(text, allowed_special="all"): no BOS/EOS is added, and special tokens written in the text are
// matched. decode() equals tokenizers' decode(ids, skip_special_tokens=False) and tiktoken's decode():
// the tokens' bytes joined, with bytes that do not form UTF-8 replaced by U+FFFD.
#pragma once
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/token_types.h"

namespace sparrow {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // `text` must be valid UTF-8 (one-line error otherwise).
  virtual std::vector<TokenId> encode(std::string_view text) const = 0;

  // Ids with no token (beyond the vocabulary, or holes in it) contribute nothing, as in tokenizers.
  std::string decode(std::span<const TokenId> ids) const;

  // The raw bytes `id` adds to decoded text (possibly part of a UTF-8 sequence); nullptr for an id
  // with no token. decode() is these bytes joined, then decoded; IncrementalDetokenizer streams them.
  const std::string* token_bytes(TokenId id) const;

  // The token's vocabulary string (byte-level characters for BPE tokens, the text of special tokens).
  std::optional<std::string> id_to_token(TokenId id) const;
  std::optional<TokenId> token_to_id(std::string_view token) const;

  bool is_special(TokenId id) const;
  // One past the largest id.
  int32_t vocab_size() const { return int32_t(tokens_.size()); }
  // From tokenizer_config.json's bos_token / eos_token, when present and known.
  std::optional<TokenId> bos_id() const { return bos_id_; }
  std::optional<TokenId> eos_id() const { return eos_id_; }

  // encode() plus the special tokens transformers' tokenizer(text) adds (add_special_tokens=True): the
  // BOS first when tokenizer_config.json sets add_bos_token. The one BOS rule, for every raw-text prompt:
  // generate, perplexity, kv-quality, and the server's completions and /tokenize prompts. (Chat prompts
  // are encoded without it: the chat template writes any BOS itself.)
  std::vector<TokenId> encode_with_special_tokens(std::string_view text) const;

 protected:
  // Called by the loaders for every id. A later call for the same id replaces the earlier one.
  void set_token(TokenId id, std::string text, std::string bytes, bool special);

 private:
  struct Entry {
    std::string text, bytes;
    bool present = false, special = false;
  };
  std::vector<Entry> tokens_;
  StringMap<TokenId> ids_by_text_;
  std::optional<TokenId> bos_id_, eos_id_;
  bool add_bos_ = false;  // tokenizer_config.json's add_bos_token

  friend std::unique_ptr<Tokenizer> load_tokenizer(const std::string& model_dir);  // sets bos / eos / add_bos_
};

// Loads the tokenizer of a model folder (tokenizer.json preferred over tiktoken.model). Errors name
// the file and the problem.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& model_dir);

}  // namespace sparrow
