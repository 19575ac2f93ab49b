// The matcher: a byte-level pushdown recognizer over the grammar IR (grammar.h), and the token masks
// it gives the sampler.
//
// Design (after xgrammar's pushdown automaton and llguidance's token trie walk; no code of either):
//   - A parser state is a set of stacks. A stack is a persistent linked list of frames, each a
//     position in one alternative of a rule (plus the bytes read so far of a multi-byte character),
//     interned in an arena so equal stacks are one id and sets of stacks stay small. A reference at the
//     end of an alternative reuses its frame (a tail call), so repetition loops never deepen a stack.
//   - Masks walk the vocabulary's byte trie (vocabulary.h) depth first, so common prefixes are read once.
//   - The adaptive token cache (xgrammar's idea): for a stack's top position alone, most tokens are
//     accepted or rejected whatever lies below it; only tokens that finish the top rule and read on
//     into whatever follows it are "uncertain". Each position's split is computed once per compiled
//     grammar (on first use) and kept. A rule whose frames always return to one place (one non-tail
//     reference, or tail references from one rule) is followed out into that place by the split
//     (xgrammar's context expansion), up to the first rule that returns to several places. A mask is then the union of the accepted sets of the tops, plus
//     a trie walk of the real stacks restricted to the uncertain tokens. Tokens leaving the rule with a
//     byte that cannot follow it anywhere in the grammar (its FOLLOW set) are rejected outright.
//   - Whole masks are kept too, keyed by the content of the state's stacks (positions and partial
//     characters, not arena ids), so a state met again — the next character of a long string, the same
//     field of the same schema in another request — costs a copy (Outlines caches masks per automaton
//     state the same way; here the stacks make the state). Bounded per grammar (kMaskCacheBytes, LRU).
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "structured/grammar.h"
#include "structured/spec.h"
#include "structured/vocabulary.h"

namespace sparrow::structured {

// The memory a compiled grammar may keep in whole masks (least recently used dropped first) and in token
// splits (all dropped when full, then computed again as needed).
inline constexpr int64_t kMaskCacheBytes = int64_t(8) << 20;
inline constexpr int64_t kSplitCacheBytes = int64_t(64) << 20;
// A state with more distinct stack tops than this is masked by one walk of its real stacks over the whole
// trie instead of a split per top.
inline constexpr int64_t kMaxSplitTops = 32;

// Per position of a stack top: which tokens it settles alone.
struct TokenSplit {
  std::vector<uint32_t> accepted;        // mask words: accepted whatever is below the top
  std::vector<int32_t> uncertain_nodes;  // trie nodes (ascending) whose tokens need the whole stack
};

class CompiledGrammar {
 public:
  // `special_tokens`: ids of tokens the vocabulary excludes that this grammar may still produce, as their
  // bytes (StructuredOutputSpec::special_tokens); `start_after`: the token sequence after which the
  // grammar starts (StructuredOutputSpec::start_after).
  CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::vector<int32_t> special_tokens = {}, std::vector<int32_t> start_after = {});

  const Grammar& grammar() const { return grammar_; }
  const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  const std::vector<int32_t>& special_tokens() const { return special_tokens_; }
  bool is_special_token(int32_t id) const {
    return std::find(special_tokens_.begin(), special_tokens_.end(), id) != special_tokens_.end();
  }
  const std::vector<int32_t>& start_after() const { return start_after_; }

  // The flattened IR: one position per element of each alternative plus one End per alternative.
  struct Position {
    enum class Kind : uint8_t { Chars, Ref, End } kind;
    int32_t arg = 0;   // class (Chars) or rule (Ref)
    int32_t rule = 0;  // the rule the position is in
  };
  const std::vector<Position>& positions() const { return positions_; }
  std::span<const int32_t> alternative_starts(int32_t rule) const { return alternative_starts_[size_t(rule)]; }
  bool ascii_in_class(int32_t cls, uint8_t byte) const { return (ascii_[size_t(cls)][byte >> 6] >> (byte & 63)) & 1; }
  bool may_follow(int32_t rule, uint8_t byte) const { return (follow_[size_t(rule)][byte >> 6] >> (byte & 63)) & 1; }

  // The token split of a top at `position` having read `partial` (frame encoding, matcher.cpp); computed
  // on first use, then shared (thread-safe).
  std::shared_ptr<const TokenSplit> token_split(int32_t position, uint32_t partial) const;
  size_t num_cached_splits() const;

  // Whole masks by state content (GrammarMatcher builds the key); none kept when disabled (benchmarks).
  struct CachedMask {
    std::vector<uint32_t> words;
    int64_t allowed = 0;
  };
  std::shared_ptr<const CachedMask> cached_mask(const std::string& key) const;
  void keep_mask(const std::string& key, std::shared_ptr<const CachedMask> mask) const;
  void set_mask_cache(bool enabled) { mask_cache_enabled_ = enabled; }

 private:
  Grammar grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<int32_t> special_tokens_, start_after_;
  std::vector<Position> positions_;
  std::vector<std::vector<int32_t>> alternative_starts_;
  std::vector<std::array<uint64_t, 2>> ascii_;   // per class: its ASCII members
  std::vector<std::array<uint64_t, 4>> follow_;  // per rule: the bytes that may come right after it
  // per rule: a position referencing it, when all its references return to one place (and it is not the
  // start rule), else -1: its frames' parents are then known without the stack (context expansion).
  std::vector<int32_t> only_reference_;
  // per position: the position standing for it in token splits and mask keys. A position in a counted
  // repetition's chain allowing more copies than the longest token has bytes behaves, for any token, as
  // the same place in the chain's rule allowing just that many (every copy reads at least one byte): all
  // of them share that rule's splits and masks, so X{0,2000} costs as many splits as the longest token.
  std::vector<int32_t> canonical_;

 public:
  int32_t canonical(int32_t position) const { return canonical_[size_t(position)]; }

 private:
  mutable std::mutex mutex_;
  mutable std::unordered_map<uint64_t, std::shared_ptr<const TokenSplit>> splits_;
  mutable size_t split_bytes_ = 0;
  bool mask_cache_enabled_ = true;
  mutable std::list<std::pair<std::string, std::shared_ptr<const CachedMask>>> masks_;  // most recent first
  mutable std::unordered_map<std::string, decltype(masks_)::iterator> mask_index_;
};

// Interned stack frames and the parser's state (matcher.cpp).
class StackArena;
struct ParserState;

class GrammarMatcher {
 public:
  // `end_tokens`: the ids that end generation (EOS, stop_token_ids), allowed exactly when the grammar
  // can end.
  GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<int32_t> end_tokens);
  ~GrammarMatcher();
  GrammarMatcher(const GrammarMatcher&) = delete;
  GrammarMatcher& operator=(const GrammarMatcher&) = delete;

  // Advances by one token; false (and no change) when the grammar does not allow it. An end token is
  // allowed when the grammar can end; afterwards the matcher is completed and allows nothing. Before the
  // grammar's start_after sequence has been accepted every token is (the model is still reasoning).
  bool accept_token(int32_t token);
  // Advances by raw bytes (tests, jump-forward); false and no change when they do not fit.
  bool accept_bytes(std::string_view bytes);
  // Undoes the last n accept_token / accept_bytes calls (speculative decoding).
  void rollback(int64_t n);
  int64_t num_accepted() const;

  // The grammar can end here: end tokens are allowed.
  bool is_terminated() const;
  // An end token was accepted.
  bool is_completed() const;

  // words[0 .. mask_words): bit t of words[t / 32] set when token t may come next. Returns how many
  // tokens are allowed. Before start_after has been seen: every token of the mask.
  int64_t fill_next_token_bitmask(uint32_t* words);
  // The grammar constrains the next token (start_after has been seen, or there is none).
  bool started() const { return started_; }

  const CompiledGrammar& grammar() const { return *grammar_; }

 private:
  std::shared_ptr<const CompiledGrammar> grammar_;
  std::vector<int32_t> end_tokens_;
  std::unique_ptr<StackArena> arena_;
  std::vector<ParserState> history_;  // history_.back(): now
  // Before the grammar starts: the tokens accepted so far (their last ones are matched against
  // start_after); they stay, for rollback, once it has started.
  std::vector<int32_t> before_start_;
  bool started_ = true;
  bool bytes_fit(std::string_view bytes);  // accept_bytes would take them (nothing changes)
};

// Compiles specs against one vocabulary and keeps the most recently used compiled grammars (LRU, keyed by
// StructuredOutputSpec::cache_key), so a schema used again costs nothing and keeps its token splits.
// Thread-safe.
class GrammarCompiler {
 public:
  explicit GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocabulary, size_t capacity = 32);
  std::shared_ptr<const CompiledGrammar> compile(const StructuredOutputSpec& spec);
  const TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  size_t capacity_;
  std::mutex mutex_;
  std::list<std::pair<std::string, std::shared_ptr<const CompiledGrammar>>> lru_;  // most recent first
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
};

}  // namespace sparrow::structured
