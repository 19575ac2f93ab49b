// The one grammar IR every structured-output front end lowers into (EBNF / GBNF, regex, choice, JSON
// Schema: front_ends.h), and the tree the front ends build it from.
//
// A Grammar is a list of rules; a rule is a list of alternatives; an alternative is a sequence of
// elements, each either a character class (a set of Unicode code points, matched as their UTF-8 bytes)
// or a reference to a rule. Literals are sequences of one-character classes; repetition (`*`, `+`, `?`,
// `{m,n}`) and nested groups are lowered to rules of their own (lower_rules). Rule 0 is the start rule.
//
// The matcher (matcher.h) is a pushdown recognizer over this IR: it needs no left recursion, so
// lower_rules refuses grammars where a rule can reach itself without consuming a character (llama.cpp's
// GBNF parser refuses left recursion the same way), and rules that can never finish.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::structured {

// Limits on what a request controls (docs/server.md, "Structured outputs"). Beyond them the front ends
// refuse the input with a one-line sparrow::Error.
inline constexpr int64_t kMaxSpecBytes = 256 * 1024;     // grammar, regex or schema text
inline constexpr int64_t kMaxRepetition = 2000;          // m and n of {m,n} (larger n: see the front ends)
inline constexpr int64_t kMaxGrammarElements = 200000;   // elements of all alternatives after lowering
inline constexpr int64_t kMaxNesting = 100;              // nested groups / schema levels

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

struct CodePointRange {
  uint32_t first = 0, last = 0;  // inclusive
  bool operator==(const CodePointRange&) const = default;
};

// A set of code points: sorted, disjoint, non-adjacent ranges; surrogates (U+D800..U+DFFF) never in it.
class CharClass {
 public:
  CharClass() = default;
  static CharClass of(uint32_t code_point) { return range(code_point, code_point); }
  static CharClass range(uint32_t first, uint32_t last);
  static CharClass any();  // every code point

  void add(uint32_t first, uint32_t last);
  void add(const CharClass& other);
  CharClass complement() const;
  CharClass minus(const CharClass& other) const;
  bool contains(uint32_t code_point) const;
  bool intersects(uint32_t first, uint32_t last) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<CodePointRange>& ranges() const { return ranges_; }
  bool operator==(const CharClass&) const = default;
  std::string to_string() const;  // [a-z\u00e9] form, for messages and tests

 private:
  void normalize();
  std::vector<CodePointRange> ranges_;
};

// What the front ends build: a regular-expression-like tree over rule names.
struct GrammarExpr {
  enum class Kind { Chars, Ref, Sequence, Choice, Repeat };
  Kind kind = Kind::Sequence;  // an empty sequence matches the empty string
  CharClass chars;                 // Chars
  std::string rule;                // Ref
  std::vector<GrammarExpr> items;  // Sequence, Choice; Repeat: one item
  int64_t min = 0, max = -1;       // Repeat: {min, max}, max -1 = unbounded

  static GrammarExpr empty() { return {}; }
  static GrammarExpr chars_of(CharClass c);
  static GrammarExpr literal(std::string_view utf8);  // exact text
  static GrammarExpr ref(std::string name);
  static GrammarExpr sequence(std::vector<GrammarExpr> items);
  static GrammarExpr choice(std::vector<GrammarExpr> items);
  static GrammarExpr repeat(GrammarExpr item, int64_t min, int64_t max);
};

struct NamedRule {
  std::string name;
  GrammarExpr body;
};

// The IR.
struct Grammar {
  struct Element {
    enum class Kind : uint8_t { Chars, Ref } kind = Kind::Chars;
    int32_t index = 0;  // into classes (Chars) or rules (Ref)
  };
  using Alternative = std::vector<Element>;
  struct Rule {
    std::string name;
    std::vector<Alternative> alternatives;
    // The optional copies of a counted repetition X{m,n} form a chain of rules (copy k: X then copy k+1,
    // or nothing); `chain` numbers the chain (-1: not in one) and `chain_remaining` is how many copies
    // this rule and those after it allow. Rules of one chain differ only in their link to the next, so
    // the matcher treats all that allow more copies than a token can fill as one (matcher.cpp).
    int32_t chain = -1;
    int32_t chain_remaining = 0;
  };
  std::vector<Rule> rules;  // rules[0] is the start rule
  std::vector<CharClass> classes;

  int64_t num_elements() const;
  std::string to_string() const;  // one line per rule, GBNF-like (tests, debugging)
};

// The grammar as GBNF text that grammar_from_ebnf (front_ends.h) reads back into the same language: rule i
// is named `rule_prefix` + i (rule_prefix + "0" starts), so several grammars (a JSON schema per tool
// argument, say) can be pasted into one EBNF grammar that references them. rule_prefix must be a GBNF
// name (letters, digits, '-', '_', '.').
std::string to_gbnf(const Grammar& grammar, std::string_view rule_prefix);
// `text` as a GBNF "literal" (quotes included; backslash, quote and control characters escaped).
std::string gbnf_literal(std::string_view text);

// Lowers named rules (the first is the start rule) into the IR and checks it: every reference names a
// rule, repetitions within kMaxRepetition, the size within kMaxGrammarElements, no left recursion, no
// repetition of something that can match the empty string, every rule able to finish. Errors name the
// rule.
Grammar lower_rules(const std::vector<NamedRule>& rules);

// UTF-8 helpers the front ends share: the code points of valid UTF-8 text (one-line error otherwise).
std::vector<uint32_t> decode_utf8(std::string_view text);
void append_utf8(std::string& out, uint32_t code_point);

}  // namespace sparrow::structured
