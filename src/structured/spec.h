// What a request asks its output to be (vLLM's StructuredOutputsParams and the older guided_* fields,
// response_format): one kind and its text. Plain data: SamplingParams carries it into the engine.
#pragma once
#include <string>
#include <vector>

#include "structured/grammar.h"

namespace sparrow::structured {

struct StructuredOutputSpec {
  enum class Kind { None, JsonSchema, JsonObject, Regex, Choice, Grammar };
  Kind kind = Kind::None;
  std::string text;                  // JsonSchema: the schema's JSON text; Regex: the pattern; Grammar: the EBNF
  std::vector<std::string> choices;  // Choice
  bool any_whitespace = true;        // JsonSchema / JsonObject: false = vLLM's disable_any_whitespace

  bool active() const { return kind != Kind::None; }
  // One string per distinct request: the compiled-grammar cache's key.
  std::string cache_key() const;
};

// The grammar the spec asks for (front_ends.h); sparrow::Error naming the problem on bad input.
Grammar build_grammar(const StructuredOutputSpec& spec);

}  // namespace sparrow::structured
