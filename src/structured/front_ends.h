// The front ends: each turns one kind of structured-output request into the grammar IR (grammar.h), or
// throws sparrow::Error with a one-line message saying what is wrong and where. docs/server.md
// ("Structured outputs") lists what each accepts and refuses.
#pragma once
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "structured/grammar.h"

namespace sparrow::structured {

// EBNF as vLLM's `guided_grammar` takes it for xgrammar: llama.cpp's GBNF (grammars/README.md there):
// `name ::= alternatives`, "literals" with escapes (\n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH), classes
// [a-z\u00e9] and [^...], `.` (any character), ( ), |, * + ? {m} {m,} {m,n}, # comments. `root` starts.
Grammar grammar_from_ebnf(std::string_view text);

// A regular expression over the whole output (vLLM's guided_regex): literals, escapes
// (\d \w \s \D \W \S \. \\ \n \t \r \f \v \xHH \uHHHH and escaped metacharacters), classes, `.` (any character
// but newline), groups ( ) (?: ) (?<name> ) (?P<name> ), |, * + ? {m} {m,} {m,n} (lazy and possessive
// forms read as greedy), ^ and $ at the ends only. Backreferences, lookaround and \p{..} are refused.
Grammar grammar_from_regex(std::string_view pattern);
// The same as an expression, for embedding (JSON Schema's `pattern`); `what` names it in errors.
GrammarExpr regex_expr(std::string_view pattern, std::string_view what = "regex");

// Exactly one of the strings (vLLM's guided_choice).
Grammar grammar_from_choices(std::span<const std::string> choices);

struct JsonSchemaOptions {
  // vLLM's default (xgrammar's any_whitespace=True): whitespace is allowed between tokens, at most
  // kMaxJsonWhitespace characters in a row. false (vLLM's disable_any_whitespace): none but the
  // separators ", " and ": ".
  bool any_whitespace = true;
};
inline constexpr int kMaxJsonWhitespace = 16;

// A JSON Schema (its JSON text) as vLLM's xgrammar backend takes it; see json_schema.cpp for the
// keywords and what each becomes.
Grammar grammar_from_json_schema(std::string_view schema_json, const JsonSchemaOptions& options = {});
// Any JSON object (response_format {"type": "json_object"}).
Grammar json_object_grammar(const JsonSchemaOptions& options = {});

}  // namespace sparrow::structured
