#include "structured/vocabulary.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::structured {

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes, std::vector<char> excluded, int32_t mask_size)
    : bytes_(std::move(bytes)), excluded_(std::move(excluded)), mask_size_(mask_size) {
  SPARROW_CHECK(excluded_.size() == bytes_.size(), "TokenVocabulary: ", excluded_.size(), " flags for ",
                bytes_.size(), " tokens");
  SPARROW_CHECK(int64_t(mask_size_) >= int64_t(bytes_.size()), "TokenVocabulary: mask size ", mask_size_,
                " is below the vocabulary's ", bytes_.size());
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (bytes_[i].empty()) excluded_[i] = 1;  // nothing to match: never allowed
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!excluded_[i]) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[size_t(a)] != bytes_[size_t(b)] ? bytes_[size_t(a)] < bytes_[size_t(b)] : a < b;
  });
  // Sorted insertion: the path from the root to the previous token is the stack; a token shares the
  // longest common prefix with its predecessor.
  trie_.push_back({});
  std::vector<int32_t> path = {0};  // path[d]: the node at depth d
  const std::string* previous = nullptr;
  auto close_to = [&](size_t depth) {
    while (path.size() > depth + 1) {
      trie_[size_t(path.back())].subtree_end = int32_t(trie_.size());
      path.pop_back();
    }
  };
  for (int32_t id : order) {
    const std::string& s = bytes_[size_t(id)];
    size_t common = 0;
    if (previous)
      while (common < s.size() && common < previous->size() && s[common] == (*previous)[common]) ++common;
    close_to(common);
    for (size_t d = common; d < s.size(); ++d) {
      TrieNode node;
      node.byte = uint8_t(s[d]);
      node.tokens_begin = node.tokens_end = int32_t(token_ids_.size());
      path.push_back(int32_t(trie_.size()));
      trie_.push_back(node);
    }
    TrieNode& end = trie_[size_t(path.back())];
    if (end.tokens_end == end.tokens_begin) end.tokens_begin = end.tokens_end = int32_t(token_ids_.size());
    token_ids_.push_back(id);
    end.tokens_end = int32_t(token_ids_.size());
    previous = &s;
  }
  close_to(0);
  trie_[0].subtree_end = int32_t(trie_.size());
}

std::shared_ptr<const TokenVocabulary> TokenVocabulary::from_tokenizer(const Tokenizer& tokenizer, int32_t mask_size) {
  const int32_t n = std::min(tokenizer.vocab_size(), mask_size);
  std::vector<std::string> bytes(static_cast<size_t>(n));
  std::vector<char> excluded(size_t(n), 0);
  for (int32_t id = 0; id < n; ++id) {
    const std::string* b = tokenizer.token_bytes(id);
    if (b) bytes[size_t(id)] = *b;
    excluded[size_t(id)] = !b || tokenizer.is_special(id);
  }
  return std::make_shared<const TokenVocabulary>(std::move(bytes), std::move(excluded), mask_size);
}

}  // namespace sparrow::structured
