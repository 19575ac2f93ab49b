#include "structured/spec.h"

#include "core/error.h"
#include "structured/front_ends.h"

namespace sparrow::structured {

std::string StructuredOutputSpec::cache_key() const {
  std::string key = std::to_string(int(kind)) + (any_whitespace ? "w" : "n") + ":";
  // Length-prefixed lists first: no two specs share a key.
  key += std::to_string(special_tokens.size()) + "s";
  for (const std::string& t : special_tokens) key += std::to_string(t.size()) + ":" + t;
  key += std::to_string(start_after.size()) + "a";
  for (int32_t id : start_after) key += std::to_string(id) + ",";
  key += ":";
  if (kind == Kind::Choice) {
    for (const std::string& c : choices) key += std::to_string(c.size()) + ":" + c;  // length-prefixed: no collisions
    return key;
  }
  return key + text;
}

Grammar build_grammar(const StructuredOutputSpec& spec) {
  using Kind = StructuredOutputSpec::Kind;
  switch (spec.kind) {
    case Kind::JsonSchema: return grammar_from_json_schema(spec.text, {spec.any_whitespace});
    case Kind::JsonObject: return json_object_grammar({spec.any_whitespace});
    case Kind::Regex: return grammar_from_regex(spec.text);
    case Kind::Choice: return grammar_from_choices(spec.choices);
    case Kind::Grammar: return grammar_from_ebnf(spec.text);
    case Kind::None: break;
  }
  fail("no structured output was asked for");
}

}  // namespace sparrow::structured
