// The "model" of a Hugging Face tokenizer.json of type BPE: vocabulary plus ranked merges, applied to
// one pre-tokenized piece at a time.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/token_types.h"

namespace sparrow {

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object. Supported: vocab, merges as "a b" strings or
  // ["a", "b"] pairs, ignore_merges, unk_token (fuse_unk); not dropout, byte_fallback or the
  // subword prefix/suffix options (one-line errors).
  explicit BpeModel(const nlohmann::json& model);

  // Appends the ids of `piece`, as tokenizers' BPE::tokenize: the characters of the piece, then the
  // merge of lowest rank applied repeatedly (leftmost first among equal ranks).
  void encode(std::string_view piece, std::vector<TokenId>& out) const;

  const StringMap<TokenId>& vocab() const { return vocab_; }

 private:
  std::vector<TokenId> merge_word(std::string_view piece) const;

  struct Merge {
    uint32_t rank;
    TokenId result;
  };
  static uint64_t pair_key(TokenId left, TokenId right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }

  StringMap<TokenId> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // by (left id, right id)
  bool ignore_merges_ = false;
  std::optional<TokenId> unk_id_;
  bool fuse_unk_ = false;

  // tokenizers caches the result of each short piece; so do we (bounded, shared by threads).
  static constexpr size_t kCacheCapacity = 100000, kCacheMaxPieceBytes = 256;
  mutable std::mutex cache_mutex_;
  mutable StringMap<std::vector<TokenId>> cache_;
};

}  // namespace sparrow
