// The vocabulary as the matcher sees it: each token's bytes, which tokens a grammar may never allow
// (special tokens, tokens without bytes), and a byte trie of the others, built once per tokenizer and
// shared by every compiled grammar.
//
// The trie is stored in preorder: node i's descendants are i+1 .. subtree_end-1, its first child is
// i+1 and the next sibling of child c is c's subtree_end. A depth-first walk over it shares the work
// of the tokens' common prefixes, and "every token below node i" is the node range [i, subtree_end).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace sparrow {
class Tokenizer;
}

namespace sparrow::structured {

class TokenVocabulary {
 public:
  struct TrieNode {
    uint8_t byte = 0;          // the byte leading here from the parent (none for the root)
    int32_t subtree_end = 0;   // one past the last descendant
    int32_t tokens_begin = 0;  // tokens whose bytes end here: token_ids()[tokens_begin, tokens_end)
    int32_t tokens_end = 0;
  };

  // bytes[i]: token i's bytes; excluded[i]: never allowed by a grammar (special tokens). `mask_size`
  // (>= bytes.size()) is the width of the masks: the model's vocabulary, which may have rows no token
  // uses.
  TokenVocabulary(std::vector<std::string> bytes, std::vector<char> excluded, int32_t mask_size);
  // From a tokenizer: its special tokens excluded.
  static std::shared_ptr<const TokenVocabulary> from_tokenizer(const Tokenizer& tokenizer, int32_t mask_size);

  int32_t mask_size() const { return mask_size_; }
  int32_t size() const { return int32_t(bytes_.size()); }  // tokens with bytes (excluded ones too)
  int64_t mask_words() const { return (int64_t(mask_size_) + 31) / 32; }
  bool excluded(int32_t id) const { return id < 0 || id >= int32_t(bytes_.size()) || excluded_[size_t(id)]; }
  const std::string& bytes(int32_t id) const { return bytes_.at(size_t(id)); }

  const std::vector<TrieNode>& trie() const { return trie_; }
  std::span<const int32_t> tokens_at(int32_t node) const {
    const TrieNode& n = trie_[size_t(node)];
    return {token_ids_.data() + n.tokens_begin, size_t(n.tokens_end - n.tokens_begin)};
  }

 private:
  std::vector<std::string> bytes_;
  std::vector<char> excluded_;
  int32_t mask_size_;
  std::vector<TrieNode> trie_;
  std::vector<int32_t> token_ids_;
};

}  // namespace sparrow::structured
