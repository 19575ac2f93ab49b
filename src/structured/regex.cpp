// Regular expressions (vLLM's guided_regex, JSON Schema's `pattern`): the common subset of Python's re
// and ECMAScript, matched against the whole output (xgrammar and Outlines match whole outputs too).
#include <cctype>

#include "core/error.h"
#include "structured/front_ends.h"

namespace sparrow::structured {
namespace {

CharClass digit_class() { return CharClass::range('0', '9'); }
CharClass word_class() {
  CharClass c = CharClass::range('a', 'z');
  c.add('A', 'Z');
  c.add('0', '9');
  c.add('_', '_');
  return c;
}
CharClass space_class() {
  CharClass c = CharClass::range('\t', '\r');  // \t \n \v \f \r
  c.add(' ', ' ');
  return c;
}

class RegexParser {
 public:
  RegexParser(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  GrammarExpr parse() {
    if (int64_t(text_.size()) > kMaxSpecBytes) fail(what_, ": longer than ", kMaxSpecBytes, " bytes");
    if (!text_.empty() && text_[0] == '^') ++pos_;
    end_ = text_.size();
    // A final unescaped `$` anchors the end (the match is of the whole output anyway).
    if (end_ > pos_ && text_[end_ - 1] == '$') {
      size_t backslashes = 0;
      for (size_t i = end_ - 1; i > pos_ && text_[i - 1] == '\\'; --i) ++backslashes;
      if (backslashes % 2 == 0) --end_;
    }
    GrammarExpr e = parse_alternation(0);
    if (pos_ < end_) error("unmatched ')'");
    return e;
  }

 private:
  [[noreturn]] void error(const std::string& message) const { fail(what_, ": at offset ", pos_, ": ", message); }

  bool more() const { return pos_ < end_; }
  char peek() const { return text_[pos_]; }

  GrammarExpr parse_alternation(int depth) {
    if (depth > kMaxNesting) error("groups nest deeper than " + std::to_string(kMaxNesting) + " levels");
    std::vector<GrammarExpr> alts;
    alts.push_back(parse_concat(depth));
    while (more() && peek() == '|') {
      ++pos_;
      alts.push_back(parse_concat(depth));
    }
    return GrammarExpr::choice(std::move(alts));
  }

  GrammarExpr parse_concat(int depth) {
    std::vector<GrammarExpr> items;
    while (more() && peek() != '|' && peek() != ')') {
      GrammarExpr atom = parse_atom(depth);
      items.push_back(parse_quantifiers(std::move(atom)));
    }
    return GrammarExpr::sequence(std::move(items));
  }

  bool parse_braces(int64_t& m, int64_t& n) {
    size_t save = pos_;
    ++pos_;  // '{'
    auto number = [&](int64_t& v) {
      size_t start = pos_;
      v = 0;
      while (more() && std::isdigit(uint8_t(peek()))) v = std::min<int64_t>(v * 10 + (text_[pos_++] - '0'), int64_t(1) << 40);
      return pos_ > start;
    };
    bool ok = number(m);
    n = m;
    if (ok && more() && peek() == ',') {
      ++pos_;
      if (!number(n)) n = -1;
    }
    ok = ok && more() && peek() == '}';
    if (!ok) {
      pos_ = save;  // not a quantifier: a literal '{', as in Python
      return false;
    }
    ++pos_;
    return true;
  }

  GrammarExpr parse_quantifiers(GrammarExpr atom) {
    while (more()) {
      char c = peek();
      int64_t m = 0, n = -1;
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        m = 1;
        ++pos_;
      } else if (c == '?') {
        n = 1;
        ++pos_;
      } else if (c == '{') {
        if (!parse_braces(m, n)) break;
        if (n != -1 && n < m) error("repetition {m,n} needs m <= n");
        if (m > kMaxRepetition || n > kMaxRepetition)
          error("repetition counts above " + std::to_string(kMaxRepetition) + " are not supported");
      } else {
        break;
      }
      if (more() && (peek() == '?' || peek() == '+')) ++pos_;  // lazy / possessive: the same language
      atom = GrammarExpr::repeat(std::move(atom), m, n);
    }
    return atom;
  }

  GrammarExpr parse_atom(int depth) {
    char c = peek();
    if (c == '(') return parse_group(depth);
    if (c == '[') return GrammarExpr::chars_of(parse_class());
    if (c == '.') {
      ++pos_;
      return GrammarExpr::chars_of(CharClass::any().minus(CharClass::of('\n')));
    }
    if (c == '^' || c == '$') error("anchors (^ and $) are supported only at the start and the end");
    if (c == '*' || c == '+' || c == '?') error("nothing to repeat");
    if (c == '\\') return GrammarExpr::chars_of(parse_escape(false));
    return GrammarExpr::chars_of(CharClass::of(parse_utf8()));
  }

  GrammarExpr parse_group(int depth) {
    ++pos_;  // '('
    if (more() && peek() == '?') {
      std::string_view rest = text_.substr(pos_, end_ - pos_);
      if (rest.starts_with("?:")) {
        pos_ += 2;
      } else if (rest.starts_with("?P<") || (rest.starts_with("?<") && !rest.starts_with("?<=") && !rest.starts_with("?<!"))) {
        size_t close = text_.find('>', pos_);
        if (close == std::string_view::npos || close >= end_) error("unterminated group name");
        pos_ = close + 1;
      } else if (rest.starts_with("?=") || rest.starts_with("?!") || rest.starts_with("?<=") || rest.starts_with("?<!")) {
        error("lookaround assertions are not supported");
      } else if (rest.starts_with("?P=")) {
        error("backreferences are not supported");
      } else {
        error("group flags and extensions (?...) other than (?:, (?<name> and (?P<name> are not supported");
      }
    }
    GrammarExpr inner = parse_alternation(depth + 1);
    if (!more() || peek() != ')') error("missing ')'");
    ++pos_;
    return inner;
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (!more() || !std::isxdigit(uint8_t(peek()))) error("expected a hex digit");
      char d = char(std::tolower(uint8_t(text_[pos_++])));
      v = v * 16 + uint32_t(d <= '9' ? d - '0' : d - 'a' + 10);
    }
    if (v >= 0xD800 && v <= 0xDFFF) error("escape is a surrogate, not a character");
    return v;
  }

  // After '\': a class (\d, \w, \s and complements) or one character.
  CharClass parse_escape(bool in_class) {
    ++pos_;
    if (!more()) error("pattern ends with '\\'");
    char e = text_[pos_++];
    switch (e) {
      case 'd': return digit_class();
      case 'D': return digit_class().complement();
      case 'w': return word_class();
      case 'W': return word_class().complement();
      case 's': return space_class();
      case 'S': return space_class().complement();
      case 'n': return CharClass::of('\n');
      case 't': return CharClass::of('\t');
      case 'r': return CharClass::of('\r');
      case 'f': return CharClass::of('\f');
      case 'v': return CharClass::of('\v');
      case '0': return CharClass::of(0);
      case 'x': return CharClass::of(hex(2));
      case 'u': return CharClass::of(hex(4));
      case 'b':
        if (in_class) return CharClass::of('\b');
        error("word boundaries (\\b) are not supported");
      case 'B': case 'A': case 'Z': case 'z': case 'G':
        error(std::string("the assertion \\") + e + " is not supported");
      case 'p': case 'P':
        error("Unicode property classes (\\p{...}) are not supported");
      case 'k':
        error("backreferences are not supported");
      default:
        if (std::isdigit(uint8_t(e))) error("backreferences are not supported");
        if (std::isalnum(uint8_t(e))) error(std::string("unknown escape \\") + e);
        --pos_;
        return CharClass::of(parse_utf8());  // an escaped metacharacter or other symbol: itself
    }
  }

  uint32_t parse_utf8() {
    const auto b = uint8_t(peek());
    size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : 4;
    std::vector<uint32_t> cps;
    try {
      cps = decode_utf8(text_.substr(pos_, std::min(len, end_ - pos_)));
    } catch (const Error&) {
      error("invalid UTF-8");
    }
    pos_ += len;
    return cps.at(0);
  }

  CharClass parse_class() {
    ++pos_;  // '['
    bool negated = more() && peek() == '^';
    if (negated) ++pos_;
    CharClass c;
    bool first_item = true;
    while (true) {
      if (!more()) error("unterminated character class");
      if (peek() == ']' && !first_item) break;
      first_item = false;
      // One item: an escape class, or a character possibly starting a range.
      CharClass item;
      bool single = true;
      uint32_t lo = 0;
      if (peek() == '\\') {
        item = parse_escape(true);
        single = item.ranges().size() == 1 && item.ranges()[0].first == item.ranges()[0].last;
        lo = single ? item.ranges()[0].first : 0;
      } else if (peek() == '[' && text_.substr(pos_, 2) == "[:") {
        error("POSIX classes ([:alpha:]) are not supported");
      } else {
        lo = parse_utf8();
        item = CharClass::of(lo);
      }
      if (single && pos_ + 1 < end_ && peek() == '-' && text_[pos_ + 1] != ']') {
        ++pos_;
        uint32_t hi = 0;
        if (peek() == '\\') {
          CharClass h = parse_escape(true);
          if (h.ranges().size() != 1 || h.ranges()[0].first != h.ranges()[0].last) error("bad character range");
          hi = h.ranges()[0].first;
        } else {
          hi = parse_utf8();
        }
        if (hi < lo) error("character range is out of order");
        item = CharClass::range(lo, hi);
      }
      c.add(item);
    }
    ++pos_;  // ']'
    return negated ? c.complement() : c;
  }

  std::string_view text_, what_;
  size_t pos_ = 0, end_ = 0;
};

}  // namespace

GrammarExpr regex_expr(std::string_view pattern, std::string_view what) {
  return RegexParser(pattern, what).parse();
}

Grammar grammar_from_regex(std::string_view pattern) {
  GrammarExpr e = regex_expr(pattern, "regex");
  try {
    return lower_rules({{"root", std::move(e)}});
  } catch (const Error& err) {
    fail("regex: ", err.what());
  }
}

Grammar grammar_from_choices(std::span<const std::string> choices) {
  SPARROW_CHECK(!choices.empty(), "choice: the list of choices is empty");
  int64_t bytes = 0;
  std::vector<GrammarExpr> alts;
  for (const std::string& c : choices) {
    bytes += int64_t(c.size());
    SPARROW_CHECK(bytes <= kMaxSpecBytes, "choice: the choices are longer than ", kMaxSpecBytes, " bytes");
    try {
      alts.push_back(GrammarExpr::literal(c));
    } catch (const Error& e) {
      fail("choice: ", e.what());
    }
  }
  GrammarExpr root;
  root.kind = GrammarExpr::Kind::Choice;
  root.items = std::move(alts);
  try {
    return lower_rules({{"root", std::move(root)}});
  } catch (const Error& e) {
    fail("choice: ", e.what());
  }
}

}  // namespace sparrow::structured
