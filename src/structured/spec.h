// What a request asks its output to be (vLLM's StructuredOutputsParams and the older guided_* fields,
// response_format): one kind and its text. Plain data: SamplingParams carries it into the engine.
#pragma once
#include <cstdint>
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
  // Special tokens the grammar may produce, by their text (a forced tool call's markup, e.g.
  // "<|tool_call_begin|>"). The vocabulary leaves special tokens out of every grammar; these are resolved
  // to their ids when the spec is compiled and then allowed exactly where the grammar allows their text.
  // A text that is no special token of the vocabulary is ignored (the grammar still reads it spelled out).
  std::vector<std::string> special_tokens;
  // The grammar starts after this token sequence (the end of the model's reasoning, e.g. the id of
  // "</think>"): until the output contains it nothing is constrained, from the next token on the grammar
  // is (vLLM's reasoning-aware structured outputs). Empty: the grammar starts at once.
  std::vector<int32_t> start_after;

  bool active() const { return kind != Kind::None; }
  // One string per distinct request: the compiled-grammar cache's key.
  std::string cache_key() const;
};

// The grammar the spec asks for (front_ends.h); sparrow::Error naming the problem on bad input.
Grammar build_grammar(const StructuredOutputSpec& spec);

}  // namespace sparrow::structured
