// Structured outputs (src/structured): each front end accepts and refuses what it should, the matcher's
// masks equal a brute-force check of every token of a real vocabulary, rollback restores states, and
// random walks through the masks always end in output that parses and fits the schema.
#include <gtest/gtest.h>

#include <limits>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "core/error.h"
#include "structured/front_ends.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::structured {
namespace {

// Every single byte is a token: accept_bytes tests a string exactly.
std::shared_ptr<const TokenVocabulary> byte_vocabulary() {
  static auto vocab = [] {
    std::vector<std::string> bytes;
    for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
    return std::make_shared<const TokenVocabulary>(bytes, std::vector<char>(256, 0), 256);
  }();
  return vocab;
}

bool bit(const std::vector<uint32_t>& words, int32_t t) { return (words[size_t(t) >> 5] >> (t & 31)) & 1; }

bool matches(const Grammar& grammar, std::string_view text) {
  GrammarMatcher m(std::make_shared<const CompiledGrammar>(grammar, byte_vocabulary()), {});
  return m.accept_bytes(text) && m.is_terminated();
}

// A prefix of some sentence of the grammar?
bool prefix_ok(const Grammar& grammar, std::string_view text) {
  GrammarMatcher m(std::make_shared<const CompiledGrammar>(grammar, byte_vocabulary()), {});
  return m.accept_bytes(text);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_HAS(statement, text)                                   \
  do {                                                                      \
    const std::string message = error_of([&] { (void)(statement); });       \
    EXPECT_NE(message.find(text), std::string::npos) << "error: " << message; \
  } while (0)

TEST(StructuredGrammar, CharClassSetOperations) {
  CharClass c = CharClass::range('a', 'z');
  c.add('0', '9');
  EXPECT_TRUE(c.contains('q'));
  EXPECT_FALSE(c.contains('A'));
  EXPECT_EQ(c.to_string(), "[0-9a-z]");
  CharClass n = c.complement();
  EXPECT_TRUE(n.contains('A'));
  EXPECT_FALSE(n.contains('5'));
  EXPECT_FALSE(n.contains(0xD800));  // surrogates are in no class
  EXPECT_TRUE(n.contains(0x10FFFF));
  EXPECT_EQ(c.minus(CharClass::range('a', 'x')).to_string(), "[0-9y-z]");
}

TEST(StructuredEbnf, AcceptsAndRejects) {
  Grammar g = grammar_from_ebnf(R"(
    # a comment
    root ::= greeting " " name ("!" | "?")*
    greeting ::= "hello" | "hi"
    name ::= [A-Z] [a-z\u00e9]{1,5}
  )");
  EXPECT_TRUE(matches(g, "hello Bob"));
  EXPECT_TRUE(matches(g, "hi Ren\xC3\xA9!?!"));
  EXPECT_FALSE(matches(g, "hello bob"));
  EXPECT_FALSE(matches(g, "hello Bobbbbb"));
  EXPECT_FALSE(matches(g, "hey Bob"));
  EXPECT_TRUE(prefix_ok(g, "hel"));
  EXPECT_FALSE(matches(g, "hel"));

  Grammar counts = grammar_from_ebnf(R"(root ::= "a"{2} "b"{1,} "c"{0,2} [^abc] .)");
  EXPECT_TRUE(matches(counts, "aabbbccx\xE2\x82\xAC"));
  EXPECT_TRUE(matches(counts, "aabzz"));
  EXPECT_FALSE(matches(counts, "abzz"));
  EXPECT_FALSE(matches(counts, "aabccczz"));
  EXPECT_FALSE(matches(counts, "aabaz"));

  Grammar escapes = grammar_from_ebnf(R"(root ::= "\"\\\n\t\x41\u00e9" ['-\]])");
  EXPECT_TRUE(matches(escapes, "\"\\\n\tA\xC3\xA9]"));
  EXPECT_TRUE(matches(escapes, "\"\\\n\tA\xC3\xA9'"));

  // Recursion (not left recursion) is fine.
  Grammar nested = grammar_from_ebnf(R"g(root ::= "(" root ")" | "x")g");
  EXPECT_TRUE(matches(nested, "(((x)))"));
  EXPECT_FALSE(matches(nested, "((x)"));
}

TEST(StructuredEbnf, RefusesBadGrammars) {
  EXPECT_ERROR_HAS(grammar_from_ebnf("start ::= \"a\""), "no 'root' rule");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= thing"), "rule 'thing' is not defined");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= root \"a\" | \"b\""), "left-recursive");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= (\"a\"?)* \"b\""), "left-recursive");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= \"a"), "unterminated literal");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= \"a\"{0,100000}"), "repetition counts above");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= [b-a]"), "out of order");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= \"a\" a\na ::= \"x\" a"), "can never finish");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= \"a\"\nroot ::= \"b\""), "defined twice");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= \"a\" )"), "line 1 column");
  EXPECT_ERROR_HAS(grammar_from_ebnf("root ::= (((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((("
                                     "(((((((((((((((((((((((((((((((((\"a\""), "nest deeper");
}

TEST(StructuredRegex, AcceptsAndRejects) {
  Grammar phone = grammar_from_regex(R"(^\(\d{3}\) \d{3}-\d{4}$)");
  EXPECT_TRUE(matches(phone, "(555) 123-4567"));
  EXPECT_FALSE(matches(phone, "555-123-4567"));
  Grammar words = grammar_from_regex(R"((?:[A-Z]\w*\s?)+|none)");
  EXPECT_TRUE(matches(words, "Hello World_1"));
  EXPECT_TRUE(matches(words, "none"));
  EXPECT_FALSE(matches(words, "hello"));
  Grammar dot = grammar_from_regex("a.c");
  EXPECT_TRUE(matches(dot, "a\xE2\x82\xAC" "c"));
  EXPECT_FALSE(matches(dot, "a\nc"));
  Grammar classes = grammar_from_regex(R"([^\d\s]+[\-\]x-z]*?\.\\\u00e9\x41{2,}?)");
  EXPECT_TRUE(matches(classes, "ab-]y.\\\xC3\xA9" "AAA"));
  EXPECT_FALSE(matches(classes, "a1.\\\xC3\xA9" "AA"));
  Grammar named = grammar_from_regex(R"((?P<year>\d{4})-(?<m>\d\d))");
  EXPECT_TRUE(matches(named, "2024-05"));
  Grammar brace = grammar_from_regex("a{b");  // not a quantifier: a literal brace, as in Python
  EXPECT_TRUE(matches(brace, "a{b"));
}

TEST(StructuredRegex, RefusesWhatItCannotMatch) {
  EXPECT_ERROR_HAS(grammar_from_regex(R"((a)\1)"), "backreferences");
  EXPECT_ERROR_HAS(grammar_from_regex("a(?=b)"), "lookaround");
  EXPECT_ERROR_HAS(grammar_from_regex("a(?<!b)"), "lookaround");
  EXPECT_ERROR_HAS(grammar_from_regex("a^b"), "anchors");
  EXPECT_ERROR_HAS(grammar_from_regex(R"(\p{L})"), "Unicode property");
  EXPECT_ERROR_HAS(grammar_from_regex("(ab"), "missing ')'");
  EXPECT_ERROR_HAS(grammar_from_regex("ab)"), "unmatched ')'");
  EXPECT_ERROR_HAS(grammar_from_regex("[ab"), "unterminated");
  EXPECT_ERROR_HAS(grammar_from_regex("*a"), "nothing to repeat");
  EXPECT_ERROR_HAS(grammar_from_regex("a{5,3}"), "m <= n");
  EXPECT_ERROR_HAS(grammar_from_regex("a{0,100000}"), "repetition counts above");
  EXPECT_ERROR_HAS(grammar_from_regex("(a*)*"), "left-recursive");
}

TEST(StructuredChoice, ExactAlternatives) {
  std::vector<std::string> choices = {"yes", "no", "not sure", ""};
  Grammar g = grammar_from_choices(choices);
  for (const auto& c : choices) EXPECT_TRUE(matches(g, c)) << c;
  EXPECT_FALSE(matches(g, "ye"));
  EXPECT_FALSE(matches(g, "nope"));
  EXPECT_ERROR_HAS(grammar_from_choices(std::vector<std::string>{}), "empty");
}

// --- JSON Schema -------------------------------------------------------------------------------------

Grammar schema(const char* text, bool any_whitespace = true) { return grammar_from_json_schema(text, {any_whitespace}); }

TEST(StructuredJsonSchema, ObjectsPropertiesInOrder) {
  Grammar g = schema(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]})");
  EXPECT_TRUE(matches(g, R"({"name": "Ann", "age": 31})"));
  EXPECT_TRUE(matches(g, R"({"name":"Ann","age":-3,"tags":["a","b\n\u00e9"]})"));
  EXPECT_TRUE(matches(g, "{\n  \"name\": \"Ann\",\n  \"age\": 0\n}"));
  EXPECT_FALSE(matches(g, R"({"age": 31, "name": "Ann"})"));  // the schema's order
  EXPECT_FALSE(matches(g, R"({"name": "Ann"})"));             // age is required
  EXPECT_FALSE(matches(g, R"({"name": "Ann", "age": 31, "x": 1})"));  // no additional properties (strict)
  EXPECT_FALSE(matches(g, R"({"name": "Ann", "age": 3.5})"));
  EXPECT_FALSE(matches(g, R"({"name": "Ann", "age": 01})"));
  EXPECT_FALSE(matches(g, std::string("{\"name\": \"A") + char(1) + "\", \"age\": 1}"));
  // Whitespace is bounded (kMaxJsonWhitespace in a row).
  EXPECT_FALSE(matches(g, "{" + std::string(40, ' ') + "\"name\": \"Ann\", \"age\": 1}"));
  Grammar compact = schema(R"({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                               "required": ["a", "b"]})", false);
  EXPECT_TRUE(matches(compact, R"({"a": true, "b": null})"));
  EXPECT_FALSE(matches(compact, R"({"a":true,"b":null})"));
}

TEST(StructuredJsonSchema, OptionalAndAdditionalProperties) {
  Grammar g = schema(R"({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
                         "required": ["b"], "additionalProperties": {"type": "boolean"}})");
  EXPECT_TRUE(matches(g, R"({"b": 1})"));
  EXPECT_TRUE(matches(g, R"({"a": 1, "b": 2, "c": 3})"));
  EXPECT_TRUE(matches(g, R"({"b": 2, "c": 3, "extra": true})"));
  EXPECT_FALSE(matches(g, R"({"a": 1})"));
  EXPECT_FALSE(matches(g, R"({"b": 2, "extra": 1})"));
  Grammar open = schema(R"({"type": "object", "additionalProperties": true})");
  EXPECT_TRUE(matches(open, R"({"x": [1, {"y": null}], "z": "w"})"));
  EXPECT_TRUE(matches(open, "{}"));
}

TEST(StructuredJsonSchema, ArraysEnumsConstsAndChoices) {
  Grammar arr = schema(R"({"type": "array", "items": {"enum": ["red", 2, null, {"k": [1]}]}, "minItems": 2, "maxItems": 3})");
  EXPECT_TRUE(matches(arr, R"(["red", 2])"));
  EXPECT_TRUE(matches(arr, R"([null, {"k":[1]}, "red"])"));
  EXPECT_FALSE(matches(arr, R"(["red"])"));
  EXPECT_FALSE(matches(arr, R"(["red", 2, 2, 2])"));
  EXPECT_FALSE(matches(arr, R"(["blue", 2])"));
  Grammar tuple = schema(R"({"type": "array", "prefixItems": [{"type": "number"}, {"const": "x"}], "items": false})");
  EXPECT_TRUE(matches(tuple, R"([1.5e-3, "x"])"));
  EXPECT_TRUE(matches(tuple, "[]"));
  EXPECT_FALSE(matches(tuple, R"([1, "x", 3])"));
  Grammar any_of = schema(R"({"anyOf": [{"type": "integer", "minimum": 0}, {"type": ["string", "null"]}]})");
  EXPECT_TRUE(matches(any_of, "12"));
  EXPECT_FALSE(matches(any_of, "-12"));
  EXPECT_TRUE(matches(any_of, R"("s")"));
  EXPECT_TRUE(matches(any_of, "null"));
  EXPECT_FALSE(matches(any_of, "true"));
}

TEST(StructuredJsonSchema, RefsAndRecursion) {
  Grammar tree = schema(R"({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
      "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["value", "children"]}}})");
  EXPECT_TRUE(matches(tree, R"({"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": [{"value": 4, "children": []}]}]})"));
  EXPECT_FALSE(matches(tree, R"({"value": 1, "children": [{"value": 2}]})"));
  Grammar old = schema(R"({"type": "object", "properties": {"p": {"$ref": "#/definitions/point"}}, "required": ["p"],
                           "definitions": {"point": {"type": "array", "items": {"type": "number"}}}})");
  EXPECT_TRUE(matches(old, R"({"p": [1, 2]})"));
  Grammar self = schema(R"({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]})");
  EXPECT_TRUE(matches(self, R"({"next": {"next": null}})"));
}

TEST(StructuredJsonSchema, StringConstraints) {
  Grammar g = schema(R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d+$"},
      "short": {"type": "string", "minLength": 2, "maxLength": 3},
      "day": {"type": "string", "format": "date"},
      "id": {"type": "string", "format": "uuid"},
      "when": {"type": "string", "format": "date-time"},
      "mail": {"type": "string", "format": "email"},
      "ip": {"type": "string", "format": "ipv4"}},
      "required": ["code", "short", "day", "id", "when", "mail", "ip"]})");
  const std::string good = R"({"code": "ABC-12", "short": "ab", "day": "2024-02-29", "id": "123e4567-e89b-12d3-a456-426614174000", "when": "2024-01-01T10:00:00Z", "mail": "a.b@example.com", "ip": "192.168.0.255"})";
  EXPECT_TRUE(matches(g, good));
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  EXPECT_FALSE(matches(g, with("ABC-12", "AB-12")));
  EXPECT_FALSE(matches(g, with("\"ab\"", "\"abcd\"")));
  EXPECT_FALSE(matches(g, with("\"ab\"", "\"a\"")));
  EXPECT_FALSE(matches(g, with("2024-02-29", "2024-13-01")));
  EXPECT_FALSE(matches(g, with("192.168.0.255", "192.168.0.256")));
  EXPECT_FALSE(matches(g, with("T10:00:00Z", "T25:00:00Z")));
}

// Integer bounds (minimum, maximum and both exclusive forms) hold digit by digit: every integer of a window
// around the bounds is accepted exactly when it lies within them, written as JSON writes it (no leading
// zeros, no "-0"); the bounds that take nothing are refused.
TEST(StructuredJsonSchema, IntegerBounds) {
  struct Case {
    std::string bounds;
    int64_t lo, hi;  // the accepted range; INT64_MIN / INT64_MAX: open
  };
  const int64_t open_lo = INT64_MIN, open_hi = INT64_MAX;
  const std::vector<Case> cases = {
      {R"("minimum": 0, "maximum": 100)", 0, 100},
      {R"("minimum": 7, "maximum": 7)", 7, 7},
      {R"("minimum": -250, "maximum": -3)", -250, -3},
      {R"("minimum": -19, "maximum": 1042)", -19, 1042},
      {R"("minimum": 95)", 95, open_hi},
      {R"("maximum": -95)", open_lo, -95},
      {R"("maximum": 230)", open_lo, 230},
      {R"("minimum": -8)", -8, open_hi},
      {R"("exclusiveMinimum": 9, "exclusiveMaximum": 101)", 10, 100},
      {R"("minimum": 9, "exclusiveMinimum": true, "maximum": 1.5)", open_hi, open_hi},  // nothing: refused
      {R"("minimum": 2.5, "maximum": 99.9)", 3, 99},
      {R"("minimum": 10, "exclusiveMaximum": 10.5)", 10, 10},
      {R"("minimum": -1e30, "maximum": 1e30)", open_lo, open_hi},
      {R"("minimum": 250)", 250, open_hi},
      {R"("minimum": 137, "maximum": 863)", 137, 863},
      {R"("minimum": -863, "maximum": -137)", -863, -137},
      {R"("minimum": -1073, "maximum": 38)", -1073, 38},
      {R"("maximum": 1049)", open_lo, 1049},
  };
  for (const Case& c : cases) {
    const std::string text = R"({"type": "integer", )" + c.bounds + "}";
    if (c.lo == open_hi) {
      EXPECT_ERROR_HAS(schema(text.c_str()), "no integer lies between");
      continue;
    }
    const Grammar g = schema(text.c_str());
    for (int64_t v = -1200; v <= 1200; ++v) {
      const bool inside = (c.lo == open_lo || v >= c.lo) && (c.hi == open_hi || v <= c.hi);
      EXPECT_EQ(matches(g, std::to_string(v)), inside) << c.bounds << ": " << v;
    }
    EXPECT_EQ(matches(g, "123456789012"), c.hi == open_hi) << c.bounds;
    EXPECT_EQ(matches(g, "-123456789012"), c.lo == open_lo) << c.bounds;
    EXPECT_FALSE(matches(g, "007")) << c.bounds;
    EXPECT_FALSE(matches(g, "-0")) << c.bounds;
    EXPECT_FALSE(matches(g, "1.0")) << c.bounds;
  }
  EXPECT_ERROR_HAS(schema(R"({"type": "integer", "minimum": "3"})"), "minimum must be a number");
}

// Number bounds hold digit by digit on plain decimals: every number of a grid around the bounds (whole
// numbers, one to four fraction digits, trailing zeros) is accepted exactly when it lies within them; no
// exponent, no "-0"; the bounds that take nothing are refused.
TEST(StructuredJsonSchema, NumberBounds) {
  struct Case {
    std::string bounds;
    double lo, hi;
    bool lo_exclusive, hi_exclusive;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {
      {R"("minimum": 0, "maximum": 1)", 0, 1, false, false},
      {R"("minimum": 0.5, "maximum": 2.25)", 0.5, 2.25, false, false},
      {R"("exclusiveMinimum": 0.5, "exclusiveMaximum": 2.25)", 0.5, 2.25, true, true},
      {R"("minimum": -1.75, "maximum": 3.1)", -1.75, 3.1, false, false},
      {R"("minimum": -2.5, "exclusiveMaximum": -0.125)", -2.5, -0.125, false, true},
      {R"("exclusiveMinimum": 0)", 0, inf, true, false},
      {R"("minimum": 1.05)", 1.05, inf, false, false},
      {R"("maximum": -0.3)", -inf, -0.3, false, false},
      {R"("exclusiveMaximum": 0)", -inf, 0, false, true},
      {R"("maximum": 0)", -inf, 0, false, false},
      {R"("minimum": 1.5, "maximum": 1.5)", 1.5, 1.5, false, false},
      {R"("minimum": 2, "exclusiveMaximum": 2.001)", 2, 2.001, false, true},
      {R"("minimum": 3, "exclusiveMinimum": true, "maximum": 12)", 3, 12, true, false},  // draft 4
      {R"("minimum": 0.1, "maximum": 0.3)", 0.1, 0.3, false, false},
  };
  std::vector<std::string> grid;
  for (int whole = -14; whole <= 14; ++whole)
    for (const char* fraction : {"", ".0", ".00", ".001", ".05", ".1", ".125", ".1001", ".25", ".2999", ".3", ".3001",
                                 ".5", ".75", ".7501", ".9", ".99", ".9999"}) {
      grid.push_back(std::to_string(whole) + fraction);
      if (whole == 0) grid.push_back(std::string("-0") + fraction);
    }
  for (const Case& c : cases) {
    const Grammar g = schema((R"({"type": "number", )" + c.bounds + "}").c_str());
    for (const std::string& text : grid) {
      const double v = std::strtod(text.c_str(), nullptr);
      const bool inside = (c.lo_exclusive ? v > c.lo : v >= c.lo) && (c.hi_exclusive ? v < c.hi : v <= c.hi);
      const bool minus_zero = text[0] == '-' && v == 0;  // "-0.0" is never written
      EXPECT_EQ(matches(g, text), inside && !minus_zero) << c.bounds << ": " << text;
    }
    EXPECT_FALSE(matches(g, "1e0")) << c.bounds;
    EXPECT_FALSE(matches(g, "01.5")) << c.bounds;
    EXPECT_FALSE(matches(g, "1.")) << c.bounds;
    EXPECT_EQ(matches(g, "123456789.5"), c.hi == inf) << c.bounds;
    EXPECT_EQ(matches(g, "-123456789.5"), c.lo == -inf) << c.bounds;
  }
  EXPECT_ERROR_HAS(schema(R"({"type": "number", "minimum": 2.5, "maximum": 2.4})"), "no number lies between");
  EXPECT_ERROR_HAS(schema(R"({"type": "number", "exclusiveMinimum": 2.5, "maximum": 2.5})"), "no number lies between");
  EXPECT_ERROR_HAS(schema(R"({"type": "number", "maximum": "3"})"), "maximum must be a number");
  // Unbounded numbers keep JSON's whole syntax.
  const Grammar open = schema(R"({"type": "number"})");
  EXPECT_TRUE(matches(open, "-1.5e-3"));
}

TEST(StructuredJsonSchema, RefusesWhatItCannotEnforce) {
  EXPECT_ERROR_HAS(schema(R"({"not": {"type": "string"}})"), "'not' is not supported");
  EXPECT_ERROR_HAS(schema(R"({"allOf": [{"type": "string"}, {"minLength": 1}]})"), "allOf");
  EXPECT_ERROR_HAS(schema(R"({"$ref": "https://example.com/s.json"})"), "$ref");
  EXPECT_ERROR_HAS(schema(R"({"$ref": "#/$defs/missing"})"), "points at nothing");
  EXPECT_ERROR_HAS(schema(R"({"type": "text"})"), "unknown type 'text'");
  EXPECT_ERROR_HAS(schema(R"({"type": "object", "properties": {"a": {"type": "wrong"}}})"), "root/properties/a");
  EXPECT_ERROR_HAS(schema("{\"type\": "), "not valid JSON");
  EXPECT_ERROR_HAS(schema(R"({"type": "string", "pattern": "(a)\\1"})"), "backreferences");
  EXPECT_ERROR_HAS(schema(R"({"type": "array", "minItems": 100000})"), "minItems above");
  EXPECT_ERROR_HAS(schema("false"), "matches nothing");
  std::string deep;
  for (int i = 0; i < 120; ++i) deep += R"({"type": "array", "items": )";
  deep += "{}";
  for (int i = 0; i < 120; ++i) deep += "}";
  EXPECT_ERROR_HAS(schema(deep.c_str()), "deeper than");
}

TEST(StructuredFrontEnds, MutatedInputsAreErrorsOrGrammarsNeverCrashes) {
  // Random edits of valid inputs: each front end either returns a grammar the matcher then runs on, or
  // throws sparrow::Error; nothing else (a crash, another exception, a hang) may happen.
  const std::vector<std::pair<int, std::string>> seeds = {
      {0, R"(root ::= "a" b* ("c" | [d-f]{1,3})+ # x
             b ::= [^\n"] "\u00e9" .?)"},
      {1, R"(^(?:[A-Z]\w{2,5}|\d+\.\d*)+[^\s\]]{0,3}(a|b)?$)"},
      {2, R"({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/x"}, "maxItems": 3},
             "b": {"anyOf": [{"type": "string", "pattern": "[a-z]+"}, {"enum": [1, null]}]}}, "required": ["a"],
             "$defs": {"x": {"type": ["integer", "null"], "minimum": 0}}, "additionalProperties": {"type": "boolean"}})"},
  };
  const std::string alphabet = "()[]{}|*+?.^$\\\"'#:=,-0123456789abcxyz \n\t{}<>!/u";
  std::mt19937 rng(2024);
  auto byte_grammar_runs = [&](const Grammar& g) {
    GrammarMatcher m(std::make_shared<const CompiledGrammar>(g, byte_vocabulary()), {});
    std::vector<uint32_t> words(8);
    for (int step = 0; step < 8; ++step) {
      if (m.fill_next_token_bitmask(words.data()) == 0) break;
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < 256; ++t)
        if (bit(words, t)) allowed.push_back(t);
      ASSERT_TRUE(m.accept_token(allowed[rng() % allowed.size()]));
    }
  };
  int grammars = 0, errors = 0;
  for (int i = 0; i < 3000; ++i) {
    const auto& [kind, seed] = seeds[size_t(i) % seeds.size()];
    std::string text = seed;
    for (int edits = 1 + int(rng() % 4); edits > 0 && !text.empty(); --edits) {
      const size_t at = rng() % text.size();
      switch (rng() % 3) {
        case 0: text.erase(at, 1 + rng() % 3); break;
        case 1: text.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: text[at] = alphabet[rng() % alphabet.size()]; break;
      }
    }
    try {
      Grammar g = kind == 0 ? grammar_from_ebnf(text) : kind == 1 ? grammar_from_regex(text) : grammar_from_json_schema(text);
      ++grammars;
      byte_grammar_runs(g);
    } catch (const Error& e) {
      ++errors;
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "a one-line error: " << e.what();
    }
  }
  EXPECT_GT(grammars, 100);
  EXPECT_GT(errors, 100);
}

// --- the matcher over a real vocabulary ---------------------------------------------------------------

struct RealVocabulary {
  std::unique_ptr<Tokenizer> tokenizer;
  std::shared_ptr<const TokenVocabulary> vocab;
  int32_t eos = 0;
};

const RealVocabulary& real_vocabulary() {
  static RealVocabulary v = [] {
    RealVocabulary r;
    r.tokenizer = load_tokenizer(SPARROW_SOURCE_DIR "/models/deepseek_v32");
    r.vocab = TokenVocabulary::from_tokenizer(*r.tokenizer, r.tokenizer->vocab_size() + 5);  // padded rows
    r.eos = *r.tokenizer->eos_id();
    return r;
  }();
  return v;
}


// The mask equals accepting each token on its own.
void expect_mask_is_brute_force(GrammarMatcher& m, const std::string& where) {
  const auto& real = real_vocabulary();
  std::vector<uint32_t> words(size_t(real.vocab->mask_words()));
  const int64_t allowed = m.fill_next_token_bitmask(words.data());
  int64_t count = 0, mismatches = 0;
  for (int32_t t = 0; t < real.vocab->mask_size(); ++t) {
    const bool ok = m.accept_token(t);
    if (ok) {
      m.rollback(1);
      ++count;
    }
    if (ok != bit(words, t) && mismatches++ < 5)
      ADD_FAILURE() << where << ": token " << t << " ('" << (real.vocab->excluded(t) ? "<special>" : real.vocab->bytes(t))
                    << "') mask " << bit(words, t) << " but accept_token " << ok;
  }
  EXPECT_EQ(allowed, count) << where;
}

std::vector<StructuredOutputSpec> sample_specs() {
  using Kind = StructuredOutputSpec::Kind;
  std::vector<StructuredOutputSpec> specs;
  specs.push_back({Kind::JsonSchema, R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
      "age": {"type": "integer"}, "email": {"type": "string", "format": "email"},
      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["name", "age"]})", {}, true});
  specs.push_back({Kind::JsonObject, "", {}, true});
  specs.push_back({Kind::Regex, R"((\d{1,3}\.){3}\d{1,3}|[a-z]+@[a-z]+\.com)", {}, true});
  specs.push_back({Kind::Choice, "", {"positive", "negative", "neutral \xC3\xA9"}, true});
  // Long counted repetitions: chain positions far from their bound share splits and masks (canonical).
  specs.push_back({Kind::Regex, R"(([a-z]+ ){2,300}[0-9]{0,80}\.)", {}, true});
  specs.push_back({Kind::JsonSchema, R"({"type": "array", "items": {"type": "string", "maxLength": 150}, "maxItems": 40})", {}, true});
  specs.push_back({Kind::Grammar, R"(root ::= "def " name "(" (name ("," " "? name)*)? "):" [\n] body
      name ::= [a-z_] [a-z_0-9]*
      body ::= ("    return " name [\n])+)", {}, true});
  return specs;
}

TEST(StructuredMatcher, MaskEqualsBruteForceOverARealVocabulary) {
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab);
  std::mt19937 rng(7);
  for (const StructuredOutputSpec& spec : sample_specs()) {
    GrammarMatcher m(compiler.compile(spec), {real.eos});
    std::vector<uint32_t> words(size_t(real.vocab->mask_words()));
    for (int step = 0; step < 12 && !m.is_completed(); ++step) {
      expect_mask_is_brute_force(m, spec.cache_key().substr(0, 40) + " step " + std::to_string(step));
      m.fill_next_token_bitmask(words.data());
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < real.vocab->mask_size(); ++t)
        if (bit(words, t)) allowed.push_back(t);
      ASSERT_FALSE(allowed.empty());
      ASSERT_TRUE(m.accept_token(allowed[rng() % allowed.size()]));
    }
  }
}

TEST(StructuredMatcher, SpecialTokensOnlyEndWhenTheGrammarCan) {
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab);
  StructuredOutputSpec spec{StructuredOutputSpec::Kind::Choice, "", {"yes", "yesterday"}, true};
  GrammarMatcher m(compiler.compile(spec), {real.eos});
  std::vector<uint32_t> words(size_t(real.vocab->mask_words()));
  m.fill_next_token_bitmask(words.data());
  EXPECT_FALSE(bit(words, real.eos));
  for (int32_t t = 0; t < real.tokenizer->vocab_size(); ++t)
    if (real.tokenizer->is_special(t)) EXPECT_FALSE(bit(words, t)) << t;
  EXPECT_FALSE(m.accept_token(real.eos));
  ASSERT_TRUE(m.accept_bytes("yes"));
  EXPECT_TRUE(m.is_terminated());
  m.fill_next_token_bitmask(words.data());
  EXPECT_TRUE(bit(words, real.eos));
  ASSERT_TRUE(m.accept_bytes("terday"));
  EXPECT_EQ(m.fill_next_token_bitmask(words.data()), 1);  // only the end token
  EXPECT_TRUE(m.accept_token(real.eos));
  EXPECT_TRUE(m.is_completed());
  EXPECT_EQ(m.fill_next_token_bitmask(words.data()), 0);
  EXPECT_FALSE(m.accept_token(real.eos));
}

TEST(StructuredMatcher, RollbackRestoresEarlierStates) {
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab);
  GrammarMatcher m(compiler.compile(sample_specs()[0]), {real.eos});
  const int64_t words_n = real.vocab->mask_words();
  std::vector<std::vector<uint32_t>> masks;
  const std::vector<int32_t> ids = real.tokenizer->encode(R"({"name": "Bob", "age": 4)");
  for (int32_t id : ids) {
    masks.emplace_back(size_t(words_n));
    m.fill_next_token_bitmask(masks.back().data());
    ASSERT_TRUE(m.accept_token(id)) << id;
  }
  EXPECT_FALSE(m.accept_token(ids[0]));  // '{' cannot come again: refused, state unchanged
  for (size_t k = ids.size(); k-- > 0;) {
    m.rollback(1);
    std::vector<uint32_t> again(static_cast<size_t>(words_n));
    m.fill_next_token_bitmask(again.data());
    EXPECT_EQ(again, masks[k]) << "after rolling back to token " << k;
  }
  EXPECT_EQ(m.num_accepted(), 0);
  EXPECT_ERROR_HAS(m.rollback(1), "rollback");
  // Token splits are computed once per compiled grammar and kept.
  EXPECT_GT(m.grammar().num_cached_splits(), 0u);
}

TEST(StructuredMatcher, CountedRepetitionsKeepTheirBound) {
  // With one-byte tokens, chain positions allowing more than 2 copies share one split and mask key; the
  // bound itself must still hold exactly.
  auto grammar = std::make_shared<const CompiledGrammar>(grammar_from_regex("(ab|c){0,100}d"), byte_vocabulary());
  GrammarMatcher m(grammar, {});
  std::vector<uint32_t> words(8);
  for (int k = 0; k <= 100; ++k) {
    m.fill_next_token_bitmask(words.data());
    EXPECT_EQ(bit(words, 'a'), k < 100) << k;
    EXPECT_EQ(bit(words, 'c'), k < 100) << k;
    EXPECT_TRUE(bit(words, 'd')) << k;
    EXPECT_FALSE(bit(words, 'b')) << k;
    if (k < 100) ASSERT_TRUE(m.accept_bytes(k % 2 ? "ab" : "c"));
  }
  EXPECT_FALSE(m.accept_bytes("c"));
  EXPECT_TRUE(m.accept_bytes("d"));
  EXPECT_TRUE(m.is_terminated());
}

TEST(StructuredMatcher, ManyTopsAreMaskedByOneWalk) {
  // 500 choices: the first state has 500 distinct tops (past kMaxSplitTops), masked by a walk of the real
  // stacks; the mask still equals brute force.
  const auto& real = real_vocabulary();
  std::vector<std::string> choices;
  for (int i = 0; i < 500; ++i) choices.push_back("item" + std::to_string(i * 7919 % 100000) + (i % 3 ? " x" : ""));
  GrammarCompiler compiler(real.vocab);
  StructuredOutputSpec spec{StructuredOutputSpec::Kind::Choice, "", choices, true};
  GrammarMatcher m(compiler.compile(spec), {real.eos});
  ASSERT_TRUE(m.accept_bytes("ite"));
  expect_mask_is_brute_force(m, "500 choices");
  EXPECT_EQ(m.grammar().num_cached_splits(), 0u);  // none computed for a state of many tops
}

TEST(StructuredMatcher, CompilerCachesByCanonicalText) {
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab, 2);
  StructuredOutputSpec a{StructuredOutputSpec::Kind::Regex, "a+", {}, true};
  StructuredOutputSpec b{StructuredOutputSpec::Kind::Regex, "b+", {}, true};
  StructuredOutputSpec c{StructuredOutputSpec::Kind::Regex, "c+", {}, true};
  auto first = compiler.compile(a);
  EXPECT_EQ(compiler.compile(a), first);
  compiler.compile(b);
  compiler.compile(c);  // evicts a (least recently used)
  EXPECT_NE(compiler.compile(a), first);
  EXPECT_ERROR_HAS(compiler.compile({StructuredOutputSpec::Kind::Regex, "(", {}, true}), "regex");
}

// --- end to end: random walks through the masks -------------------------------------------------------

using nlohmann::json;

// A small validator for the schemas below (types, required, no extra properties, enums, bounds).
bool valid(const json& value, const json& s) {
  if (s.contains("enum")) return std::find(s["enum"].begin(), s["enum"].end(), value) != s["enum"].end();
  const std::string type = s.value("type", "");
  if (type == "object") {
    if (!value.is_object()) return false;
    for (const auto& r : s.value("required", json::array()))
      if (!value.contains(r.get<std::string>())) return false;
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (!s["properties"].contains(it.key())) return false;
      if (!valid(it.value(), s["properties"][it.key()])) return false;
    }
    return true;
  }
  if (type == "array") {
    if (!value.is_array()) return false;
    if (s.contains("maxItems") && value.size() > s["maxItems"].get<size_t>()) return false;
    if (s.contains("minItems") && value.size() < s["minItems"].get<size_t>()) return false;
    for (const auto& v : value)
      if (!valid(v, s["items"])) return false;
    return true;
  }
  if (type == "string") {
    if (!value.is_string()) return false;
    if (s.contains("pattern") && !std::regex_match(value.get<std::string>(), std::regex(s["pattern"].get<std::string>())))
      return false;
    size_t characters = 0;  // code points: maxLength counts characters, not bytes
    for (char c : value.get<std::string>()) characters += (uint8_t(c) & 0xC0) != 0x80;
    return !s.contains("maxLength") || characters <= s["maxLength"].get<size_t>();
  }
  if (type == "integer") return value.is_number_integer();
  if (type == "number") return value.is_number();
  if (type == "boolean") return value.is_boolean();
  if (type == "null") return value.is_null();
  return false;
}

TEST(StructuredMatcher, RandomWalksYieldValidJson) {
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab);
  const json schema_json = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8},
      "kind": {"enum": ["cat", "dog", 3, null]},
      "score": {"type": "number"},
      "ok": {"type": "boolean"},
      "code": {"type": "string", "pattern": "[A-Z]{2}[0-9]{2}"},
      "items": {"type": "array", "maxItems": 3, "items": {"type": "object",
          "properties": {"id": {"type": "integer"}, "note": {"type": "null"}}, "required": ["id"]}}},
      "required": ["name", "kind", "code"]})");
  StructuredOutputSpec spec{StructuredOutputSpec::Kind::JsonSchema, schema_json.dump(), {}, true};
  std::mt19937 rng(11);
  std::vector<uint32_t> words(size_t(real.vocab->mask_words()));
  int finished = 0;
  for (int walk = 0; walk < 40; ++walk) {
    GrammarMatcher m(compiler.compile(spec), {real.eos});
    std::vector<int32_t> out;
    while (!m.is_completed() && out.size() < 600) {
      ASSERT_GT(m.fill_next_token_bitmask(words.data()), 0) << real.tokenizer->decode(out);
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < real.vocab->mask_size(); ++t)
        if (bit(words, t)) allowed.push_back(t);
      // Prefer short tokens and ending, so walks finish.
      int32_t pick = allowed[rng() % allowed.size()];
      if (bit(words, real.eos) && rng() % 2 == 0) pick = real.eos;
      for (int tries = 0; tries < 3 && pick != real.eos && real.vocab->bytes(pick).size() > 2; ++tries)
        pick = allowed[rng() % allowed.size()];
      ASSERT_TRUE(m.accept_token(pick));
      if (pick != real.eos) out.push_back(pick);
    }
    if (!m.is_completed()) continue;  // a walk that wandered: no verdict
    ++finished;
    const std::string text = real.tokenizer->decode(out);
    json value;
    try {
      value = json::parse(text);
    } catch (const json::out_of_range&) {
      continue;  // valid JSON with a number beyond double's range (e.g. 1E10294): nlohmann cannot hold it
    } catch (const json::parse_error& e) {
      ADD_FAILURE() << e.what() << "\n" << text;
      continue;
    }
    EXPECT_TRUE(valid(value, schema_json)) << text;
  }
  EXPECT_GE(finished, 10);
}

TEST(StructuredMatcher, MaskTimingsArePrinted) {
  // Timings for the record (bench/results/structured.md has the full table); nothing is asserted.
  const auto& real = real_vocabulary();
  GrammarCompiler compiler(real.vocab);
  GrammarMatcher m(compiler.compile(sample_specs()[0]), {real.eos});
  std::vector<uint32_t> words(size_t(real.vocab->mask_words()));
  const std::vector<int32_t> ids = real.tokenizer->encode(R"({"name": "Bobby Tables", "age": 42, "email": "bob@x.org"})");
  auto start = std::chrono::steady_clock::now();
  int64_t masks = 0;
  for (int32_t id : ids) {
    m.fill_next_token_bitmask(words.data());
    ++masks;
    if (!m.accept_token(id)) break;
  }
  const double first_pass = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.rollback(m.num_accepted());
  start = std::chrono::steady_clock::now();
  for (int32_t id : ids) {
    m.fill_next_token_bitmask(words.data());
    if (!m.accept_token(id)) break;
  }
  const double warm = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ timing ] %lld masks over %d tokens: %.1f us each cold (token splits computed), %.1f us warm\n",
              (long long)masks, real.vocab->mask_size(), 1e6 * first_pass / double(masks), 1e6 * warm / double(masks));
}

}  // namespace
}  // namespace sparrow::structured
