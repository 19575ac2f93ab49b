#include "structured/matcher.h"

#include <algorithm>
#include <bit>
#include <bitset>
#include <climits>
#include <map>

#include "core/error.h"

namespace sparrow::structured {

namespace {

// A frame's parent: another frame, or one of these.
constexpr int32_t kNoParent = -1;  // the start rule's frame: finishing it finishes the grammar
constexpr int32_t kExitFrame = -2;  // token splits: finishing the top rule leaves the part computed alone

// A frame part-way through a multi-byte character: (code point bits so far << 5) | (bytes still to read
// << 3) | (the character's length in bytes); 0 at a character boundary.
constexpr uint32_t partial_of(uint32_t value, uint32_t remaining, uint32_t length) {
  return (value << 5) | (remaining << 3) | length;
}
constexpr uint32_t partial_value(uint32_t p) { return p >> 5; }
constexpr uint32_t partial_remaining(uint32_t p) { return (p >> 3) & 3; }
constexpr uint32_t partial_length(uint32_t p) { return p & 7; }

constexpr uint32_t kMinCodePointOfLength[5] = {0, 0, 0x80, 0x800, 0x10000};
constexpr uint32_t kMaxCodePointOfLength[5] = {0, 0x7F, 0x7FF, 0xFFFF, 0x10FFFF};

bool token_allowed_in(const uint32_t* words, int32_t t) { return (words[t >> 5] >> (t & 31)) & 1u; }
void allow_token(uint32_t* words, int32_t t) { words[t >> 5] |= 1u << (t & 31); }

uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

// Frames interned in an open-addressing table (linear probing, backward-shift deletion), so equal stacks
// share one id. release(mark) forgets the frames made after `mark` (a rolled-back token, a mask's walk).
class StackArena {
 public:
  struct Frame {
    int32_t position, parent;
    uint32_t partial;
  };

  StackArena() { table_.assign(1024, -1); }

  int32_t intern(int32_t position, int32_t parent, uint32_t partial) {
    if ((frames_.size() + 1) * 2 > table_.size()) grow();
    const size_t mask = table_.size() - 1;
    for (size_t i = hash(position, parent, partial) & mask;; i = (i + 1) & mask) {
      const int32_t id = table_[i];
      if (id < 0) {
        table_[i] = int32_t(frames_.size());
        frames_.push_back({position, parent, partial});
        return table_[i];
      }
      const Frame& f = frames_[size_t(id)];
      if (f.position == position && f.parent == parent && f.partial == partial) return id;
    }
  }

  const Frame& operator[](int32_t id) const { return frames_[size_t(id)]; }
  int32_t size() const { return int32_t(frames_.size()); }

  void release(int32_t mark) {
    while (int32_t(frames_.size()) > mark) {
      erase(int32_t(frames_.size()) - 1);
      frames_.pop_back();
    }
  }

 private:
  static size_t hash(int32_t position, int32_t parent, uint32_t partial) {
    return size_t(mix((uint64_t(uint32_t(position)) | (uint64_t(uint32_t(parent)) << 32)) ^ mix(partial)));
  }
  size_t home(int32_t id) const {
    const Frame& f = frames_[size_t(id)];
    return hash(f.position, f.parent, f.partial) & (table_.size() - 1);
  }

  void erase(int32_t id) {
    const size_t mask = table_.size() - 1;
    size_t i = home(id);
    while (table_[i] != id) i = (i + 1) & mask;
    table_[i] = -1;
    for (size_t j = (i + 1) & mask; table_[j] >= 0; j = (j + 1) & mask) {
      const size_t k = home(table_[j]);
      // Move the entry at j back to the hole at i unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (k > i && k <= j) : (k > i || k <= j);
      if (!stays) {
        table_[i] = table_[j];
        table_[j] = -1;
        i = j;
      }
    }
  }

  void grow() {
    table_.assign(table_.size() * 2, -1);
    const size_t mask = table_.size() - 1;
    for (size_t id = 0; id < frames_.size(); ++id) {
      size_t i = home(int32_t(id));
      while (table_[i] >= 0) i = (i + 1) & mask;
      table_[i] = int32_t(id);
    }
  }

  std::vector<Frame> frames_;
  std::vector<int32_t> table_;
};

struct ParserState {
  std::vector<int32_t> tops;  // frames at a character class, after closure
  bool can_end = false;       // the start rule can finish here
  bool exited = false;        // token splits: the top rule can finish here
  bool completed = false;     // an end token was accepted
  int32_t arena_mark = 0;     // the arena's size before this state was built

  bool alive() const { return !tops.empty() || can_end || exited; }
  void clear() {
    tops.clear();
    can_end = exited = completed = false;
  }
};

namespace {

using State = ParserState;

// The closure and the byte step over a compiled grammar and an arena.
class Recognizer {
 public:
  Recognizer(const CompiledGrammar& grammar, StackArena& arena) : g_(grammar), arena_(arena) {}

  // out = the closure of `seeds`: frames at character classes, and whether a frame reached the end of
  // the start rule (can_end) or of a token split's top rule (exited).
  void closure(State& out) {
    if (++stamp_ == 0) {
      std::fill(seen_.begin(), seen_.end(), 0);
      stamp_ = 1;
    }
    const auto& positions = g_.positions();
    while (!work_.empty()) {
      const int32_t id = work_.back();
      work_.pop_back();
      if (size_t(id) >= seen_.size()) seen_.resize(size_t(arena_.size()) * 2 + 64, 0);
      if (seen_[size_t(id)] == stamp_) continue;
      seen_[size_t(id)] = stamp_;
      const StackArena::Frame frame = arena_[id];
      const CompiledGrammar::Position& p = positions[size_t(frame.position)];
      switch (p.kind) {
        case CompiledGrammar::Position::Kind::Chars:
          out.tops.push_back(id);
          break;
        case CompiledGrammar::Position::Kind::End:
          if (frame.parent == kNoParent)
            out.can_end = true;
          else if (frame.parent == kExitFrame)
            out.exited = true;
          else
            work_.push_back(frame.parent);
          break;
        case CompiledGrammar::Position::Kind::Ref: {
          // A reference that ends its alternative returns straight to the parent (a tail call).
          const bool tail = positions[size_t(frame.position + 1)].kind == CompiledGrammar::Position::Kind::End;
          const int32_t next = tail ? frame.parent : arena_.intern(frame.position + 1, frame.parent, 0);
          for (int32_t start : g_.alternative_starts(p.arg)) work_.push_back(arena_.intern(start, next, 0));
          break;
        }
      }
    }
  }

  void seed(int32_t frame) { work_.push_back(frame); }

  // out = the state after reading `byte` in `in`.
  void step(const State& in, uint8_t byte, State& out) {
    out.clear();
    const auto& positions = g_.positions();
    for (int32_t id : in.tops) {
      const StackArena::Frame frame = arena_[id];
      const int32_t cls = positions[size_t(frame.position)].arg;
      const uint32_t partial = frame.partial;
      if (partial == 0) {
        if (byte < 0x80) {
          if (g_.ascii_in_class(cls, byte)) work_.push_back(arena_.intern(frame.position + 1, frame.parent, 0));
          continue;
        }
        const uint32_t length = byte >= 0xC2 && byte <= 0xDF ? 2 : (byte & 0xF0) == 0xE0 ? 3 : byte >= 0xF0 && byte <= 0xF4 ? 4 : 0;
        if (length == 0) continue;
        const uint32_t value = byte & (0x7F >> length);
        if (possible(cls, value, length - 1, length))
          work_.push_back(arena_.intern(frame.position, frame.parent, partial_of(value, length - 1, length)));
        continue;
      }
      if ((byte & 0xC0) != 0x80) continue;
      const uint32_t value = (partial_value(partial) << 6) | (byte & 0x3F);
      const uint32_t remaining = partial_remaining(partial) - 1, length = partial_length(partial);
      if (!possible(cls, value, remaining, length)) continue;
      work_.push_back(remaining == 0 ? arena_.intern(frame.position + 1, frame.parent, 0)
                                     : arena_.intern(frame.position, frame.parent, partial_of(value, remaining, length)));
    }
    closure(out);
  }

 private:
  // Whether some character of class `cls`, `length` bytes long, starts with the bits `value` with
  // `remaining` bytes to come (overlong forms and surrogates excluded: classes hold no surrogates).
  bool possible(int32_t cls, uint32_t value, uint32_t remaining, uint32_t length) const {
    const uint32_t shift = 6 * remaining;
    const uint32_t lo = std::max(value << shift, kMinCodePointOfLength[length]);
    const uint32_t hi = std::min((value << shift) | ((1u << shift) - 1), kMaxCodePointOfLength[length]);
    return lo <= hi && g_.grammar().classes[size_t(cls)].intersects(lo, hi);
  }

  const CompiledGrammar& g_;
  StackArena& arena_;
  std::vector<int32_t> work_;
  std::vector<uint32_t> seen_;
  uint32_t stamp_ = 0;
};

using ByteSet = std::bitset<256>;

// The bytes a character of the class can start with.
ByteSet first_bytes(const CharClass& c) {
  ByteSet out;
  for (const CodePointRange& r : c.ranges()) {
    for (uint32_t length = 1; length <= 4; ++length) {
      uint32_t lo = std::max(r.first, kMinCodePointOfLength[length]), hi = std::min(r.last, kMaxCodePointOfLength[length]);
      if (length == 1) lo = std::max(r.first, 0u);
      if (lo > hi) continue;
      static constexpr uint32_t kLeadShift[5] = {0, 0, 6, 12, 18};
      static constexpr uint32_t kLeadBits[5] = {0, 0, 0xC0, 0xE0, 0xF0};
      for (uint32_t b = (lo >> kLeadShift[length]) | kLeadBits[length]; b <= ((hi >> kLeadShift[length]) | kLeadBits[length]); ++b)
        out.set(b);
    }
  }
  return out;
}

}  // namespace

// --- CompiledGrammar -----------------------------------------------------------------------------------

CompiledGrammar::CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
                                 std::vector<int32_t> special_tokens, std::vector<int32_t> start_after)
    : grammar_(std::move(grammar)),
      vocabulary_(std::move(vocabulary)),
      special_tokens_(std::move(special_tokens)),
      start_after_(std::move(start_after)) {
  using Kind = Grammar::Element::Kind;
  const size_t num_rules = grammar_.rules.size();
  alternative_starts_.resize(num_rules);
  for (size_t r = 0; r < num_rules; ++r)
    for (const auto& alt : grammar_.rules[r].alternatives) {
      alternative_starts_[r].push_back(int32_t(positions_.size()));
      for (const auto& e : alt)
        positions_.push_back({e.kind == Kind::Chars ? Position::Kind::Chars : Position::Kind::Ref, e.index, int32_t(r)});
      positions_.push_back({Position::Kind::End, 0, int32_t(r)});
    }
  std::vector<ByteSet> class_first;
  for (const CharClass& c : grammar_.classes) {
    std::array<uint64_t, 2> ascii{};
    for (const CodePointRange& r : c.ranges())
      for (uint32_t cp = r.first; cp <= std::min(r.last, 0x7Fu); ++cp) ascii[cp >> 6] |= uint64_t(1) << (cp & 63);
    ascii_.push_back(ascii);
    class_first.push_back(first_bytes(c));
  }
  // FIRST and nullable of each rule, then FOLLOW (the bytes that can come right after it), as fixpoints
  // (Aho, Sethi, Ullman, "Compilers", 4.4), over bytes.
  std::vector<ByteSet> first(num_rules), follow(num_rules);
  std::vector<char> nullable(num_rules, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < num_rules; ++r)
      for (const auto& alt : grammar_.rules[r].alternatives) {
        ByteSet f = first[r];
        bool all_nullable = true;
        for (const auto& e : alt) {
          if (e.kind == Kind::Chars) {
            f |= class_first[size_t(e.index)];
            all_nullable = false;
            break;
          }
          f |= first[size_t(e.index)];
          if (!nullable[size_t(e.index)]) {
            all_nullable = false;
            break;
          }
        }
        if (f != first[r]) first[r] = f, changed = true;
        if (all_nullable && !nullable[r]) nullable[r] = 1, changed = true;
      }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t s = 0; s < num_rules; ++s)
      for (const auto& alt : grammar_.rules[s].alternatives)
        for (size_t i = 0; i < alt.size(); ++i) {
          if (alt[i].kind != Kind::Ref) continue;
          const size_t r = size_t(alt[i].index);
          ByteSet f = follow[r];
          bool rest_nullable = true;
          for (size_t j = i + 1; j < alt.size() && rest_nullable; ++j) {
            if (alt[j].kind == Kind::Chars) {
              f |= class_first[size_t(alt[j].index)];
              rest_nullable = false;
            } else {
              f |= first[size_t(alt[j].index)];
              rest_nullable = nullable[size_t(alt[j].index)];
            }
          }
          if (rest_nullable) f |= follow[s];
          if (f != follow[r]) follow[r] = f, changed = true;
        }
  }
  for (const ByteSet& f : follow) {
    std::array<uint64_t, 4> words{};
    for (size_t b = 0; b < 256; ++b)
      if (f[b]) words[b >> 6] |= uint64_t(1) << (b & 63);
    follow_.push_back(words);
  }
  // Where each rule's frames return: a non-tail reference at p returns to p + 1; a tail reference from
  // rule S returns where S's frames return (one place, however many tail references S makes). A rule with
  // one such place gets the reference standing for it (any of S's tail references will do).
  only_reference_.assign(num_rules, -1);
  std::vector<int64_t> return_target(num_rules, INT64_MIN);  // p + 1, or -(S + 1) for a tail from S
  std::vector<char> several(num_rules, 0);
  for (size_t p = 0; p < positions_.size(); ++p)
    if (positions_[p].kind == Position::Kind::Ref) {
      const size_t r = size_t(positions_[p].arg);
      const bool tail = positions_[p + 1].kind == Position::Kind::End;
      // A rule's tail reference to itself (a repetition loop) returns where the rule returns: no new place.
      if (tail && int32_t(r) == positions_[p].rule) continue;
      const int64_t target = tail ? -int64_t(positions_[p].rule) - 1 : int64_t(p) + 1;
      if (return_target[r] == INT64_MIN) {
        return_target[r] = target;
        only_reference_[r] = int32_t(p);
      } else if (return_target[r] != target) {
        several[r] = 1;
      }
    }
  for (size_t r = 0; r < num_rules; ++r)
    if (several[r] || r == 0) only_reference_[r] = -1;
  // Canonical positions (matcher.h): chain rules allowing more than `enough` copies map onto the one
  // allowing exactly `enough`, position by position (same alternative, same offset).
  int64_t longest = 1;
  for (int32_t id = 0; id < vocabulary_->mask_size(); ++id)
    if (!vocabulary_->excluded(id)) longest = std::max<int64_t>(longest, int64_t(vocabulary_->bytes(id).size()));
  const int64_t enough = longest + 1;
  std::map<std::pair<int32_t, int64_t>, int32_t> chain_rule;  // (chain, remaining) -> rule
  for (size_t r = 0; r < num_rules; ++r)
    if (grammar_.rules[r].chain >= 0) chain_rule[{grammar_.rules[r].chain, grammar_.rules[r].chain_remaining}] = int32_t(r);
  canonical_.resize(positions_.size());
  for (size_t r = 0; r < num_rules; ++r) {
    const Grammar::Rule& rule = grammar_.rules[r];
    int32_t target = int32_t(r);
    if (rule.chain >= 0 && rule.chain_remaining > enough) target = chain_rule.at({rule.chain, enough});
    for (size_t a = 0; a < alternative_starts_[r].size(); ++a) {
      const int32_t from = alternative_starts_[r][a], to = alternative_starts_[size_t(target)][a];
      const size_t length = rule.alternatives[a].size() + 1;  // the End too
      for (size_t k = 0; k < length; ++k) canonical_[size_t(from) + k] = to + int32_t(k);
    }
  }
}

size_t CompiledGrammar::num_cached_splits() const {
  std::lock_guard lock(mutex_);
  return splits_.size();
}

std::shared_ptr<const TokenSplit> CompiledGrammar::token_split(int32_t position, uint32_t partial) const {
  position = canonical_[size_t(position)];
  const uint64_t key = (uint64_t(uint32_t(position)) << 32) | partial;
  {
    std::lock_guard lock(mutex_);
    if (auto it = splits_.find(key); it != splits_.end()) return it->second;
  }
  // Walk the whole trie from the one frame, alone (its parent is kExitFrame).
  auto split = std::make_shared<TokenSplit>();
  const TokenVocabulary& vocab = *vocabulary_;
  const auto& trie = vocab.trie();
  split->accepted.assign(size_t(vocab.mask_words()), 0);
  StackArena arena;
  Recognizer recognizer(*this, arena);
  // The frame's parents, as far as they are fixed: while the rule is referenced from one place only, its
  // frame returns to the position after that reference (or, for a tail reference, to where that rule's
  // frame returns). The rule whose end leaves the known part is the one whose FOLLOW filters the exits.
  std::vector<int32_t> returns;  // positions to return to, innermost first
  int32_t rule = positions_[size_t(position)].rule;
  for (int hops = 0; only_reference_[size_t(rule)] >= 0 && hops < 64; ++hops) {
    const int32_t site = only_reference_[size_t(rule)];
    if (positions_[size_t(site + 1)].kind != Position::Kind::End) returns.push_back(site + 1);
    rule = positions_[size_t(site)].rule;
  }
  int32_t parent = kExitFrame;
  for (size_t i = returns.size(); i-- > 0;) parent = arena.intern(returns[i], parent, 0);
  std::vector<State> states(1);
  states[0].tops.push_back(arena.intern(position, parent, partial));
  auto accept_node = [&](int32_t node) {
    for (int32_t id : vocab.tokens_at(node)) allow_token(split->accepted.data(), id);
  };
  auto walk = [&](auto&& self, int32_t node, size_t depth, bool uncertain_below) -> void {
    if (states.size() <= depth + 1) states.resize(depth + 2);
    for (int32_t c = node + 1; c < trie[size_t(node)].subtree_end; c = trie[size_t(c)].subtree_end) {
      const uint8_t byte = trie[size_t(c)].byte;
      const bool uncertain = uncertain_below || (states[depth].exited && may_follow(rule, byte));
      const int32_t mark = arena.size();
      recognizer.step(states[depth], byte, states[depth + 1]);
      const bool consumed = !states[depth + 1].tops.empty() || states[depth + 1].exited;
      if (consumed) {
        accept_node(c);
        if (trie[size_t(c)].subtree_end > c + 1) self(self, c, depth + 1, uncertain);
      } else if (uncertain) {
        for (int32_t n = c; n < trie[size_t(c)].subtree_end; ++n)
          if (!vocab.tokens_at(n).empty()) split->uncertain_nodes.push_back(n);
      }
      arena.release(mark);
    }
  };
  walk(walk, 0, 0, false);
  // Tokens consumed on one path and uncertain on another are accepted: drop them from the uncertain.
  std::erase_if(split->uncertain_nodes, [&](int32_t n) {
    const int32_t id = vocab.tokens_at(n)[0];
    return token_allowed_in(split->accepted.data(), id);
  });
  std::lock_guard lock(mutex_);
  // Bounded: past kSplitCacheBytes the splits start over (those in use stay alive with their users).
  const size_t bytes = size_t(vocab.mask_words()) * 4 + split->uncertain_nodes.size() * 4 + 64;
  if (split_bytes_ + bytes > size_t(kSplitCacheBytes)) {
    splits_.clear();
    split_bytes_ = 0;
  }
  split_bytes_ += bytes;
  return splits_.emplace(key, std::move(split)).first->second;
}

std::shared_ptr<const CompiledGrammar::CachedMask> CompiledGrammar::cached_mask(const std::string& key) const {
  if (!mask_cache_enabled_) return nullptr;
  std::lock_guard lock(mutex_);
  auto it = mask_index_.find(key);
  if (it == mask_index_.end()) return nullptr;
  masks_.splice(masks_.begin(), masks_, it->second);
  return it->second->second;
}

void CompiledGrammar::keep_mask(const std::string& key, std::shared_ptr<const CachedMask> mask) const {
  if (!mask_cache_enabled_) return;
  const size_t capacity = size_t(std::max<int64_t>(16, kMaskCacheBytes / (vocabulary_->mask_words() * 4 + 64)));
  std::lock_guard lock(mutex_);
  if (mask_index_.count(key)) return;
  masks_.emplace_front(key, std::move(mask));
  mask_index_[key] = masks_.begin();
  while (masks_.size() > capacity) {
    mask_index_.erase(masks_.back().first);
    masks_.pop_back();
  }
}

// --- GrammarMatcher ------------------------------------------------------------------------------------

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<int32_t> end_tokens)
    : grammar_(std::move(grammar)), end_tokens_(std::move(end_tokens)), arena_(std::make_unique<StackArena>()) {
  ParserState start;
  Recognizer recognizer(*grammar_, *arena_);
  for (int32_t s : grammar_->alternative_starts(0)) recognizer.seed(arena_->intern(s, kNoParent, 0));
  recognizer.closure(start);
  history_.push_back(std::move(start));
  started_ = grammar_->start_after().empty();
}

GrammarMatcher::~GrammarMatcher() = default;

int64_t GrammarMatcher::num_accepted() const { return int64_t(before_start_.size() + history_.size()) - 1; }
bool GrammarMatcher::is_terminated() const { return started_ && history_.back().can_end; }
bool GrammarMatcher::is_completed() const { return history_.back().completed; }

bool GrammarMatcher::accept_token(int32_t token) {
  if (!started_) {
    before_start_.push_back(token);
    const std::vector<int32_t>& trigger = grammar_->start_after();
    started_ = before_start_.size() >= trigger.size() &&
               std::equal(trigger.rbegin(), trigger.rend(), before_start_.rbegin());
    return true;
  }
  const ParserState& now = history_.back();
  if (now.completed) return false;
  if (std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end() && now.can_end) {
    ParserState done;
    done.completed = true;
    done.arena_mark = arena_->size();
    history_.push_back(std::move(done));
    return true;
  }
  if (grammar_->vocabulary().excluded(token) && !grammar_->is_special_token(token)) return false;
  return accept_bytes(grammar_->vocabulary().bytes(token));
}

bool GrammarMatcher::bytes_fit(std::string_view bytes) {
  const int32_t mark = arena_->size();
  Recognizer recognizer(*grammar_, *arena_);
  ParserState a = history_.back(), b;
  bool fits = true;
  for (char c : bytes) {
    recognizer.step(a, uint8_t(c), b);
    if (b.tops.empty() && !b.can_end) {
      fits = false;
      break;
    }
    std::swap(a, b);
  }
  arena_->release(mark);
  return fits;
}

bool GrammarMatcher::accept_bytes(std::string_view bytes) {
  if (history_.back().completed) return false;
  const int32_t mark = arena_->size();
  Recognizer recognizer(*grammar_, *arena_);
  ParserState a = history_.back(), b;
  for (char c : bytes) {
    recognizer.step(a, uint8_t(c), b);
    if (b.tops.empty() && !b.can_end) {
      arena_->release(mark);
      return false;
    }
    std::swap(a, b);
  }
  a.arena_mark = mark;
  history_.push_back(std::move(a));
  return true;
}

void GrammarMatcher::rollback(int64_t n) {
  SPARROW_CHECK(n >= 0 && n <= num_accepted(), "rollback of ", n, " tokens, but only ", num_accepted(), " were accepted");
  for (int64_t i = 0; i < n; ++i) {
    if (history_.size() > 1) {
      arena_->release(history_.back().arena_mark);
      history_.pop_back();
    } else {  // back before the grammar started
      before_start_.pop_back();
      started_ = false;
    }
  }
}

int64_t GrammarMatcher::fill_next_token_bitmask(uint32_t* words) {
  const TokenVocabulary& vocab = grammar_->vocabulary();
  const int64_t num_words = vocab.mask_words();
  if (!started_) {  // still reasoning: nothing is constrained
    std::fill(words, words + num_words, ~0u);
    if (vocab.mask_size() % 32) words[num_words - 1] = (1u << (vocab.mask_size() % 32)) - 1;
    return vocab.mask_size();
  }
  std::fill(words, words + num_words, 0u);
  const ParserState& now = history_.back();
  if (now.completed) return 0;
  // End tokens where the grammar can end, and the grammar's special tokens where their text fits: added
  // to the mask after the cache, which holds only what the vocabulary's trie gives.
  auto end_tokens = [&](int64_t allowed) {
    if (now.can_end)
      for (int32_t id : end_tokens_)
        if (id >= 0 && id < vocab.mask_size() && !token_allowed_in(words, id)) {
          allow_token(words, id);
          ++allowed;
        }
    for (int32_t id : grammar_->special_tokens())
      if (id < vocab.mask_size() && !token_allowed_in(words, id) && bytes_fit(vocab.bytes(id))) {
        allow_token(words, id);
        ++allowed;
      }
    return allowed;
  };
  // The state's content: each stack as its frames' (position, partial) from the top down, sorted.
  std::vector<std::string> stacks;
  for (int32_t id = 0; size_t(id) < now.tops.size(); ++id) {
    std::string chain;
    for (int32_t f = now.tops[size_t(id)]; f >= 0; f = (*arena_)[f].parent) {
      const int32_t frame[2] = {grammar_->canonical((*arena_)[f].position), int32_t((*arena_)[f].partial)};
      chain.append(reinterpret_cast<const char*>(frame), sizeof frame);
    }
    stacks.push_back(std::move(chain));
  }
  std::sort(stacks.begin(), stacks.end());
  std::string key;
  for (const std::string& chain : stacks) key += std::to_string(chain.size()) + ":" + chain;
  if (auto cached = grammar_->cached_mask(key)) {
    std::copy(cached->words.begin(), cached->words.end(), words);
    return end_tokens(cached->allowed);
  }
  // The tops' splits: accepted tokens at once, the uncertain ones gathered for the walk below.
  std::vector<std::pair<int32_t, uint32_t>> keys;
  for (int32_t id : now.tops) keys.push_back({grammar_->canonical((*arena_)[id].position), (*arena_)[id].partial});
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  // A state of many distinct tops (a long list of choices, a wide alternation) would compute and keep a
  // split per top, each a walk of the whole trie: then one walk of the real stacks over every token is
  // cheaper, and keeps nothing but the whole mask.
  const bool walk_everything = int64_t(keys.size()) > kMaxSplitTops;
  if (walk_everything) keys.clear();
  std::vector<std::shared_ptr<const TokenSplit>> splits;
  for (auto [position, partial] : keys) {
    splits.push_back(grammar_->token_split(position, partial));
    const std::vector<uint32_t>& accepted = splits.back()->accepted;
    for (int64_t w = 0; w < num_words; ++w) words[w] |= accepted[size_t(w)];
  }
  std::vector<int32_t> merged;
  std::span<const int32_t> uncertain;
  if (splits.size() == 1) {
    uncertain = splits[0]->uncertain_nodes;
  } else {
    for (const auto& s : splits) merged.insert(merged.end(), s->uncertain_nodes.begin(), s->uncertain_nodes.end());
    std::sort(merged.begin(), merged.end());
    merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
    uncertain = merged;
  }
  if (!uncertain.empty() || walk_everything) {
    // The uncertain tokens against the real stacks: a trie walk entering only subtrees that hold one.
    const auto& trie = vocab.trie();
    Recognizer recognizer(*grammar_, *arena_);
    std::vector<ParserState> states(1);
    states[0].tops = now.tops;
    auto walk = [&](auto&& self, int32_t node, size_t depth) -> void {
      if (states.size() <= depth + 1) states.resize(depth + 2);
      for (int32_t c = node + 1; c < trie[size_t(node)].subtree_end; c = trie[size_t(c)].subtree_end) {
        const int32_t end = trie[size_t(c)].subtree_end;
        auto it = std::lower_bound(uncertain.begin(), uncertain.end(), c);
        if (!walk_everything && (it == uncertain.end() || *it >= end)) continue;
        const int32_t mark = arena_->size();
        recognizer.step(states[depth], trie[size_t(c)].byte, states[depth + 1]);
        if (!states[depth + 1].tops.empty() || states[depth + 1].can_end) {
          if (walk_everything || *it == c)
            for (int32_t id : vocab.tokens_at(c)) allow_token(words, id);
          if (end > c + 1) self(self, c, depth + 1);
        }
        arena_->release(mark);
      }
    };
    walk(walk, 0, 0);
  }
  auto mask = std::make_shared<CompiledGrammar::CachedMask>();
  mask->words.assign(words, words + num_words);
  for (int64_t w = 0; w < num_words; ++w) mask->allowed += std::popcount(words[w]);
  const int64_t allowed = mask->allowed;
  grammar_->keep_mask(key, std::move(mask));
  return end_tokens(allowed);
}

// --- GrammarCompiler -----------------------------------------------------------------------------------

GrammarCompiler::GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocabulary, size_t capacity)
    : vocabulary_(std::move(vocabulary)), capacity_(std::max<size_t>(capacity, 1)) {}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::compile(const StructuredOutputSpec& spec) {
  const std::string key = spec.cache_key();
  {
    std::lock_guard lock(mutex_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  // The spec's special tokens by their text: the vocabulary's excluded tokens with exactly those bytes.
  std::vector<int32_t> special;
  if (!spec.special_tokens.empty())
    for (int32_t id = 0; id < vocabulary_->mask_size(); ++id) {
      if (!vocabulary_->excluded(id) || id >= vocabulary_->size()) continue;
      const std::string& bytes = vocabulary_->bytes(id);
      if (!bytes.empty() && std::find(spec.special_tokens.begin(), spec.special_tokens.end(), bytes) !=
                                spec.special_tokens.end())
        special.push_back(id);
    }
  for (int32_t id : spec.start_after)
    SPARROW_CHECK(id >= 0 && id < vocabulary_->mask_size(), "structured output: start_after token id ", id,
                  " is outside the vocabulary");
  auto compiled = std::make_shared<const CompiledGrammar>(build_grammar(spec), vocabulary_, std::move(special),
                                                          spec.start_after);
  std::lock_guard lock(mutex_);
  if (auto it = index_.find(key); it != index_.end()) return it->second->second;  // compiled meanwhile
  lru_.emplace_front(key, compiled);
  index_[key] = lru_.begin();
  if (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return compiled;
}

}  // namespace sparrow::structured
