#include "structured/grammar.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <unordered_map>

#include "core/error.h"

namespace sparrow::structured {

// --- CharClass ---------------------------------------------------------------------------------------

namespace {
constexpr uint32_t kSurrogateFirst = 0xD800, kSurrogateLast = 0xDFFF;
}

CharClass CharClass::range(uint32_t first, uint32_t last) {
  CharClass c;
  c.add(first, last);
  return c;
}

CharClass CharClass::any() { return range(0, kMaxCodePoint); }

void CharClass::add(uint32_t first, uint32_t last) {
  last = std::min(last, kMaxCodePoint);
  if (first > last) return;
  // Surrogates are not characters: UTF-8 cannot encode them (RFC 3629), so no class holds them.
  if (first < kSurrogateFirst && last >= kSurrogateFirst) {
    ranges_.push_back({first, kSurrogateFirst - 1});
    if (last > kSurrogateLast) ranges_.push_back({kSurrogateLast + 1, last});
  } else if (first >= kSurrogateFirst && first <= kSurrogateLast) {
    if (last > kSurrogateLast) ranges_.push_back({kSurrogateLast + 1, last});
  } else {
    ranges_.push_back({first, last});
  }
  normalize();
}

void CharClass::add(const CharClass& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  normalize();
}

void CharClass::normalize() {
  std::sort(ranges_.begin(), ranges_.end(),
            [](const CodePointRange& a, const CodePointRange& b) { return a.first < b.first; });
  std::vector<CodePointRange> merged;
  for (const CodePointRange& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().last + 1)
      merged.back().last = std::max(merged.back().last, r.last);
    else
      merged.push_back(r);
  }
  ranges_ = std::move(merged);
}

CharClass CharClass::complement() const {
  CharClass out;
  uint32_t next = 0;
  for (const CodePointRange& r : ranges_) {
    if (r.first > next) out.add(next, r.first - 1);
    next = r.last + 1;
  }
  if (next <= kMaxCodePoint) out.add(next, kMaxCodePoint);
  return out;
}

CharClass CharClass::minus(const CharClass& other) const {
  CharClass out = other.complement();
  // this ∩ ¬other
  CharClass result;
  for (const CodePointRange& a : ranges_)
    for (const CodePointRange& b : out.ranges_) {
      uint32_t lo = std::max(a.first, b.first), hi = std::min(a.last, b.last);
      if (lo <= hi) result.ranges_.push_back({lo, hi});
    }
  result.normalize();
  return result;
}

bool CharClass::contains(uint32_t cp) const { return intersects(cp, cp); }

bool CharClass::intersects(uint32_t first, uint32_t last) const {
  // The first range ending at or after `first`.
  auto it = std::lower_bound(ranges_.begin(), ranges_.end(), first,
                             [](const CodePointRange& r, uint32_t v) { return r.last < v; });
  return it != ranges_.end() && it->first <= last;
}

namespace {
void append_class_char(std::string& out, uint32_t cp) {
  if (cp == '\\' || cp == ']' || cp == '-' || cp == '^' || cp == '[') {
    out += '\\';
    out += char(cp);
  } else if (cp >= 0x20 && cp < 0x7F) {
    out += char(cp);
  } else {
    char buf[16];
    std::snprintf(buf, sizeof buf, cp <= 0xFFFF ? "\\u%04X" : "\\U%08X", cp);
    out += buf;
  }
}
}  // namespace

std::string CharClass::to_string() const {
  std::string out = "[";
  for (const CodePointRange& r : ranges_) {
    append_class_char(out, r.first);
    if (r.last != r.first) {
      out += '-';
      append_class_char(out, r.last);
    }
  }
  return out + "]";
}

// --- GrammarExpr ---------------------------------------------------------------------------------------

GrammarExpr GrammarExpr::chars_of(CharClass c) {
  GrammarExpr e;
  e.kind = Kind::Chars;
  e.chars = std::move(c);
  return e;
}

GrammarExpr GrammarExpr::literal(std::string_view utf8) {
  GrammarExpr e;
  for (uint32_t cp : decode_utf8(utf8)) e.items.push_back(chars_of(CharClass::of(cp)));
  return e;
}

GrammarExpr GrammarExpr::ref(std::string name) {
  GrammarExpr e;
  e.kind = Kind::Ref;
  e.rule = std::move(name);
  return e;
}

GrammarExpr GrammarExpr::sequence(std::vector<GrammarExpr> items) {
  if (items.size() == 1) return std::move(items[0]);
  GrammarExpr e;
  e.items = std::move(items);
  return e;
}

GrammarExpr GrammarExpr::choice(std::vector<GrammarExpr> items) {
  if (items.size() == 1) return std::move(items[0]);
  GrammarExpr e;
  e.kind = Kind::Choice;
  e.items = std::move(items);
  return e;
}

GrammarExpr GrammarExpr::repeat(GrammarExpr item, int64_t min, int64_t max) {
  GrammarExpr e;
  e.kind = Kind::Repeat;
  e.items.push_back(std::move(item));
  e.min = min;
  e.max = max;
  return e;
}

// --- Grammar -------------------------------------------------------------------------------------------

int64_t Grammar::num_elements() const {
  int64_t n = 0;
  for (const Rule& r : rules)
    for (const Alternative& a : r.alternatives) n += int64_t(a.size());
  return n;
}

std::string Grammar::to_string() const {
  std::string out;
  for (const Rule& r : rules) {
    out += r.name + " ::=";
    for (size_t a = 0; a < r.alternatives.size(); ++a) {
      if (a) out += " |";
      if (r.alternatives[a].empty()) out += " \"\"";
      for (const Element& e : r.alternatives[a])
        out += " " + (e.kind == Element::Kind::Chars ? classes[size_t(e.index)].to_string() : rules[size_t(e.index)].name);
    }
    out += "\n";
  }
  return out;
}

std::string to_gbnf(const Grammar& grammar, std::string_view rule_prefix) {
  const std::string prefix(rule_prefix);
  std::string out;
  for (size_t r = 0; r < grammar.rules.size(); ++r) {
    out += prefix + std::to_string(r) + " ::=";
    const auto& alternatives = grammar.rules[r].alternatives;
    for (size_t a = 0; a < alternatives.size(); ++a) {
      if (a) out += " |";
      if (alternatives[a].empty()) out += " \"\"";
      for (const Grammar::Element& e : alternatives[a])
        out += " " + (e.kind == Grammar::Element::Kind::Chars ? grammar.classes[size_t(e.index)].to_string()
                                                               : prefix + std::to_string(e.index));
    }
    out += "\n";
  }
  return out;
}

std::string gbnf_literal(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (uint8_t(c) < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", unsigned(uint8_t(c)));
      out += buf;
    } else {
      out += c;  // UTF-8 bytes pass as they are: the GBNF reader takes UTF-8 characters in literals
    }
  }
  return out + "\"";
}

namespace {

class Lowering {
 public:
  explicit Lowering(const std::vector<NamedRule>& named) {
    SPARROW_CHECK(!named.empty(), "the grammar has no rules");
    for (const NamedRule& r : named) {
      SPARROW_CHECK(!ids_.count(r.name), "rule '", r.name, "' is defined twice");
      ids_[r.name] = int32_t(out_.rules.size());
      out_.rules.push_back({r.name, {}});
    }
    for (size_t i = 0; i < named.size(); ++i) {
      current_ = named[i].name;
      out_.rules[i].alternatives = alternatives(named[i].body, 0);
    }
  }
  Grammar take() { return std::move(out_); }

 private:
  void count(int64_t n) {
    elements_ += n;
    SPARROW_CHECK(elements_ <= kMaxGrammarElements, "the grammar is too large: more than ", kMaxGrammarElements,
                  " elements after expanding repetitions (rule '", current_, "')");
  }

  int32_t class_index(const CharClass& c) {
    // Classes are shared: the matcher's per-class work is then per distinct class.
    for (size_t i = 0; i < out_.classes.size(); ++i)
      if (out_.classes[i] == c) return int32_t(i);
    out_.classes.push_back(c);
    return int32_t(out_.classes.size() - 1);
  }

  int32_t new_rule(const std::string& suffix, std::vector<Grammar::Alternative> alts) {
    out_.rules.push_back({current_ + "/" + suffix + std::to_string(out_.rules.size()), std::move(alts)});
    return int32_t(out_.rules.size() - 1);
  }

  std::vector<Grammar::Alternative> alternatives(const GrammarExpr& e, int depth) {
    SPARROW_CHECK(depth <= kMaxNesting, "rule '", current_, "' nests deeper than ", kMaxNesting, " levels");
    if (e.kind == GrammarExpr::Kind::Choice) {
      std::vector<Grammar::Alternative> out;
      for (const GrammarExpr& item : e.items)
        for (auto& alt : alternatives(item, depth + 1)) out.push_back(std::move(alt));
      return out;
    }
    Grammar::Alternative alt;
    append(e, alt, depth);
    return {std::move(alt)};
  }

  // Appends the elements matching `e` to `alt`.
  void append(const GrammarExpr& e, Grammar::Alternative& alt, int depth) {
    SPARROW_CHECK(depth <= kMaxNesting, "rule '", current_, "' nests deeper than ", kMaxNesting, " levels");
    using Kind = GrammarExpr::Kind;
    switch (e.kind) {
      case Kind::Chars:
        count(1);
        alt.push_back({Grammar::Element::Kind::Chars, class_index(e.chars)});
        return;
      case Kind::Ref: {
        auto it = ids_.find(e.rule);
        SPARROW_CHECK(it != ids_.end(), "rule '", e.rule, "' is not defined (referenced in '", current_, "')");
        count(1);
        alt.push_back({Grammar::Element::Kind::Ref, it->second});
        return;
      }
      case Kind::Sequence:
        for (const GrammarExpr& item : e.items) append(item, alt, depth + 1);
        return;
      case Kind::Choice: {
        count(1);
        alt.push_back({Grammar::Element::Kind::Ref, new_rule("group", alternatives(e, depth + 1))});
        return;
      }
      case Kind::Repeat:
        append_repeat(e, alt, depth);
        return;
    }
  }

  void append_repeat(const GrammarExpr& e, Grammar::Alternative& alt, int depth) {
    SPARROW_CHECK(e.min >= 0 && e.min <= kMaxRepetition && (e.max == -1 || (e.max >= e.min && e.max <= kMaxRepetition)),
                  "repetition {", e.min, ",", e.max == -1 ? std::string() : std::to_string(e.max), "} in rule '",
                  current_, "' is out of range: counts must satisfy 0 <= m <= n <= ", kMaxRepetition);
    const GrammarExpr& item = e.items.at(0);
    std::vector<Grammar::Alternative> body = alternatives(item, depth + 1);
    int64_t body_size = 0;
    for (const auto& a : body) body_size += int64_t(a.size());
    // A large body is referenced rather than copied into every repetition.
    if (body.size() > 1 && (body_size > 16 || e.min > 1)) {
      count(1);
      body = {{{Grammar::Element::Kind::Ref, new_rule("item", std::move(body))}}};
      body_size = 1;
    }
    for (int64_t i = 0; i < e.min; ++i) {
      if (body.size() == 1) {
        count(int64_t(body[0].size()));
        alt.insert(alt.end(), body[0].begin(), body[0].end());
      } else {  // several short alternatives: one group, referenced min times
        count(1);
        alt.push_back({Grammar::Element::Kind::Ref, new_rule("group", body)});
      }
    }
    if (e.max == e.min) return;
    // What may follow the required copies: a loop (unbounded), or a chain of optional copies, each
    // alternative ending in a tail reference (the matcher reuses the frame: no stack growth).
    if (e.max == -1) {
      const int32_t loop = new_rule("repeat", {});
      std::vector<Grammar::Alternative> alts;
      for (const auto& a : body) {
        alts.push_back(a);
        alts.back().push_back({Grammar::Element::Kind::Ref, loop});
      }
      alts.push_back({});
      count(body_size + int64_t(body.size()));
      out_.rules[size_t(loop)].alternatives = std::move(alts);
      count(1);
      alt.push_back({Grammar::Element::Kind::Ref, loop});
      return;
    }
    int32_t next = -1;  // built from the last optional copy back to the first
    const int32_t chain = chains_++;
    for (int64_t i = e.max - e.min; i >= 1; --i) {
      std::vector<Grammar::Alternative> alts;
      for (const auto& a : body) {
        alts.push_back(a);
        if (next >= 0) alts.back().push_back({Grammar::Element::Kind::Ref, next});
      }
      alts.push_back({});
      count(body_size + int64_t(body.size()));
      next = new_rule("optional", std::move(alts));
      out_.rules[size_t(next)].chain = chain;
      out_.rules[size_t(next)].chain_remaining = int32_t(e.max - e.min - i + 1);
    }
    count(1);
    alt.push_back({Grammar::Element::Kind::Ref, next});
  }

  Grammar out_;
  std::unordered_map<std::string, int32_t> ids_;
  std::string current_;
  int64_t elements_ = 0;
  int32_t chains_ = 0;
};

void check(const Grammar& g) {
  const size_t n = g.rules.size();
  using Kind = Grammar::Element::Kind;
  // Nullable and productive rules (fixpoints).
  std::vector<char> nullable(n, 0), productive(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r)
      for (const auto& alt : g.rules[r].alternatives) {
        bool all_nullable = true, all_productive = true;
        for (const auto& e : alt) {
          if (e.kind == Kind::Chars) {
            all_nullable = false;
            all_productive &= !g.classes[size_t(e.index)].empty();
          } else {
            all_nullable &= bool(nullable[size_t(e.index)]);
            all_productive &= bool(productive[size_t(e.index)]);
          }
        }
        if (all_nullable && !nullable[r]) nullable[r] = changed = true;
        if (all_productive && !productive[r]) productive[r] = changed = true;
      }
  }
  for (size_t r = 0; r < n; ++r)
    SPARROW_CHECK(productive[r], "rule '", g.rules[r].name,
                  "' can never finish (every alternative needs itself, or matches nothing)");
  // Left recursion: an edge r -> s when s can be the first thing r matches.
  std::vector<std::vector<int32_t>> left(n);
  for (size_t r = 0; r < n; ++r)
    for (const auto& alt : g.rules[r].alternatives)
      for (const auto& e : alt) {
        if (e.kind == Kind::Chars) break;
        left[r].push_back(e.index);
        if (!nullable[size_t(e.index)]) break;
      }
  std::vector<char> state(n, 0);  // 0 new, 1 on the path, 2 done
  std::function<void(size_t)> visit = [&](size_t r) {
    state[r] = 1;
    for (int32_t s : left[r]) {
      SPARROW_CHECK(state[size_t(s)] != 1, "rule '", g.rules[size_t(s)].name,
                    "' is left-recursive (it can reach itself before matching a character, directly, through rules "
                    "that can match the empty string, or by repeating something that can be empty); rewrite it "
                    "with repetition");
      if (state[size_t(s)] == 0) visit(size_t(s));
    }
    state[r] = 2;
  };
  for (size_t r = 0; r < n; ++r)
    if (state[r] == 0) visit(r);
}

}  // namespace

Grammar lower_rules(const std::vector<NamedRule>& rules) {
  Grammar g = Lowering(rules).take();
  check(g);
  return g;
}

// --- UTF-8 ---------------------------------------------------------------------------------------------

std::vector<uint32_t> decode_utf8(std::string_view text) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < text.size();) {
    const auto b = uint8_t(text[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    SPARROW_CHECK(len > 0 && i + size_t(len) <= text.size(), "invalid UTF-8 at byte ", i);
    uint32_t cp = len == 1 ? b : b & (0x7F >> len);
    for (int k = 1; k < len; ++k) {
      const auto c = uint8_t(text[i + size_t(k)]);
      SPARROW_CHECK((c & 0xC0) == 0x80, "invalid UTF-8 at byte ", i);
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kMinOf[5] = {0, 0, 0x80, 0x800, 0x10000};
    SPARROW_CHECK(cp >= kMinOf[len] && cp <= kMaxCodePoint && !(cp >= 0xD800 && cp <= 0xDFFF),
                  "invalid UTF-8 at byte ", i);
    out.push_back(cp);
    i += size_t(len);
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

}  // namespace sparrow::structured
