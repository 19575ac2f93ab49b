// GBNF (llama.cpp grammars/README.md), the EBNF vLLM's xgrammar backend takes as guided_grammar.
// Differences from llama.cpp, all more lenient: a rule may continue over lines anywhere (a rule ends
// where the next `name ::=` starts), and literals may also be 'single-quoted'.
#include <cctype>
#include <optional>

#include "core/error.h"
#include "structured/front_ends.h"

namespace sparrow::structured {
namespace {

class EbnfParser {
 public:
  explicit EbnfParser(std::string_view text) : text_(text) {}

  Grammar parse() {
    SPARROW_CHECK(int64_t(text_.size()) <= kMaxSpecBytes, "grammar: longer than ", kMaxSpecBytes, " bytes");
    std::vector<NamedRule> rules;
    skip_space();
    while (pos_ < text_.size()) {
      std::string name = parse_name();
      skip_space();
      if (text_.substr(pos_, 3) != "::=") error("expected '::=' after rule name '" + name + "'");
      pos_ += 3;
      skip_space();
      rules.push_back({name, parse_alternatives(0)});
      skip_space();
      if (pos_ < text_.size() && !starts_rule()) error("unexpected '" + std::string(1, text_[pos_]) + "'");
    }
    size_t root = rules.size();
    for (size_t i = 0; i < rules.size(); ++i)
      if (rules[i].name == "root") root = i;
    SPARROW_CHECK(root < rules.size(), "grammar: there is no 'root' rule (the start rule)");
    std::swap(rules[0], rules[root]);
    try {
      return lower_rules(rules);
    } catch (const Error& e) {
      fail("grammar: ", e.what());
    }
  }

 private:
  [[noreturn]] void error(const std::string& message) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    fail("grammar: line ", line, " column ", column, ": ", message);
  }

  static bool name_char(char c) { return std::isalnum(uint8_t(c)) || c == '-' || c == '_' || c == '.'; }

  void skip_space() {
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == '#') {
        while (pos_ < text_.size() && text_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else {
        break;
      }
    }
  }

  // At `name ::=`?
  bool starts_rule() {
    size_t save = pos_;
    size_t i = pos_;
    while (i < text_.size() && name_char(text_[i]) && text_[i] != '.') ++i;
    bool is = i > pos_;
    if (is) {
      pos_ = i;
      skip_space();
      is = text_.substr(pos_, 3) == "::=";
    }
    pos_ = save;
    return is;
  }

  std::string parse_name() {
    size_t start = pos_;
    while (pos_ < text_.size() && name_char(text_[pos_]) && text_[pos_] != '.') ++pos_;
    if (pos_ == start) error("expected a rule name");
    return std::string(text_.substr(start, pos_ - start));
  }

  GrammarExpr parse_alternatives(int depth) {
    if (depth > kMaxNesting) error("groups nest deeper than " + std::to_string(kMaxNesting) + " levels");
    std::vector<GrammarExpr> alts;
    alts.push_back(parse_sequence(depth));
    while (pos_ < text_.size() && text_[pos_] == '|') {
      ++pos_;
      skip_space();
      alts.push_back(parse_sequence(depth));
    }
    return GrammarExpr::choice(std::move(alts));
  }

  GrammarExpr parse_sequence(int depth) {
    std::vector<GrammarExpr> items;
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == '|' || c == ')') break;
      if (std::isalpha(uint8_t(c)) && starts_rule()) break;
      GrammarExpr term = parse_term(depth);
      skip_space();
      items.push_back(parse_quantifiers(std::move(term)));
    }
    return GrammarExpr::sequence(std::move(items));
  }

  GrammarExpr parse_quantifiers(GrammarExpr term) {
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == '*') {
        term = GrammarExpr::repeat(std::move(term), 0, -1);
      } else if (c == '+') {
        term = GrammarExpr::repeat(std::move(term), 1, -1);
      } else if (c == '?') {
        term = GrammarExpr::repeat(std::move(term), 0, 1);
      } else if (c == '{') {
        ++pos_;
        skip_space();
        int64_t m = parse_count();
        int64_t n = m;
        skip_space();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          skip_space();
          n = pos_ < text_.size() && std::isdigit(uint8_t(text_[pos_])) ? parse_count() : -1;
          skip_space();
        }
        if (pos_ >= text_.size() || text_[pos_] != '}') error("expected '}' to close the repetition");
        if (n != -1 && n < m) error("repetition {m,n} needs m <= n");
        if (m > kMaxRepetition || n > kMaxRepetition)
          error("repetition counts above " + std::to_string(kMaxRepetition) + " are not supported");
        term = GrammarExpr::repeat(std::move(term), m, n);
      } else {
        break;
      }
      ++pos_;
      skip_space();
    }
    return term;
  }

  int64_t parse_count() {
    size_t start = pos_;
    int64_t v = 0;
    while (pos_ < text_.size() && std::isdigit(uint8_t(text_[pos_]))) {
      v = std::min<int64_t>(v * 10 + (text_[pos_] - '0'), int64_t(1) << 40);
      ++pos_;
    }
    if (pos_ == start) error("expected a number in the repetition");
    return v;
  }

  GrammarExpr parse_term(int depth) {
    char c = text_[pos_];
    if (c == '"' || c == '\'') return parse_literal(c);
    if (c == '[') return parse_class();
    if (c == '.') {
      ++pos_;
      return GrammarExpr::chars_of(CharClass::any());
    }
    if (c == '(') {
      ++pos_;
      skip_space();
      GrammarExpr inner = parse_alternatives(depth + 1);
      if (pos_ >= text_.size() || text_[pos_] != ')') error("expected ')'");
      ++pos_;
      return inner;
    }
    if (name_char(c)) return GrammarExpr::ref(parse_name());
    error("unexpected '" + std::string(1, c) + "'");
  }

  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (pos_ >= text_.size() || !std::isxdigit(uint8_t(text_[pos_]))) error("expected a hex digit");
      char d = char(std::tolower(uint8_t(text_[pos_++])));
      v = v * 16 + uint32_t(d <= '9' ? d - '0' : d - 'a' + 10);
    }
    if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) error("escape is not a Unicode character");
    return v;
  }

  // One character of a literal or class: an escape or a UTF-8 character.
  uint32_t parse_char() {
    if (pos_ >= text_.size()) error("unexpected end of the grammar");
    if (text_[pos_] == '\\') {
      ++pos_;
      if (pos_ >= text_.size()) error("unfinished escape");
      char e = text_[pos_++];
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'x': return hex(2);
        case 'u': return hex(4);
        case 'U': return hex(8);
        case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/': return uint32_t(e);
        default: --pos_; error("unknown escape '\\" + std::string(1, e) + "'");
      }
    }
    size_t len = 1;
    const auto b = uint8_t(text_[pos_]);
    if (b >= 0x80) len = (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : 4;
    std::vector<uint32_t> cps;
    try {
      cps = decode_utf8(text_.substr(pos_, len));
    } catch (const Error&) {
      error("invalid UTF-8");
    }
    pos_ += len;
    return cps.at(0);
  }

  GrammarExpr parse_literal(char quote) {
    ++pos_;
    std::vector<GrammarExpr> chars;
    while (true) {
      if (pos_ >= text_.size()) error("unterminated literal");
      if (text_[pos_] == quote) break;
      if (text_[pos_] == '\n') error("newline inside a literal (write \\n)");
      chars.push_back(GrammarExpr::chars_of(CharClass::of(parse_char())));
    }
    ++pos_;
    GrammarExpr e;  // an empty literal "" is the empty sequence
    e.items = std::move(chars);
    return e;
  }

  GrammarExpr parse_class() {
    ++pos_;
    bool negated = pos_ < text_.size() && text_[pos_] == '^';
    if (negated) ++pos_;
    CharClass c;
    while (true) {
      if (pos_ >= text_.size()) error("unterminated character class");
      if (text_[pos_] == ']') break;
      uint32_t first = parse_char(), last = first;
      if (pos_ + 1 < text_.size() && text_[pos_] == '-' && text_[pos_ + 1] != ']') {
        ++pos_;
        last = parse_char();
        if (last < first) error("character range is out of order");
      }
      c.add(first, last);
    }
    ++pos_;
    return GrammarExpr::chars_of(negated ? c.complement() : c);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

Grammar grammar_from_ebnf(std::string_view text) { return EbnfParser(text).parse(); }

}  // namespace sparrow::structured
