// Splits a Jinja template into tokens exactly as jinja2's Lexer does for transformers' environment
// (trim_blocks=True, lstrip_blocks=True, default delimiters). Whitespace control happens here:
//   {%- / {{- / {#-   strip all whitespace before the tag;  -%} / -}} / -#}  all whitespace after;
//   trim_blocks       drop the first newline after a block or comment tag;
//   lstrip_blocks     drop spaces and tabs between the start of a line and a block or comment tag;
//   {%+ / +%}         opt a tag out of lstrip_blocks / trim_blocks.
// Comments vanish and {% raw %}...{% endraw %} becomes plain text.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::jinja {

struct Token {
  enum class Type {
    Text,           // template text between tags
    VariableBegin,  // {{
    VariableEnd,    // }}
    BlockBegin,     // {%
    BlockEnd,       // %}
    Name,           // identifiers and keywords (if, in, not, true, ...)
    String,         // a string literal, escapes already decoded
    Integer,
    Float,
    Operator,  // + - * / // % ** ~ == != < <= > >= = . , : | ( ) [ ] { }
    End,       // end of the template
  };
  Type type;
  std::string text;  // Text, Name, String (decoded), Operator
  int64_t integer = 0;
  double number = 0;
  int line = 1;
};

// Throws TemplateError (with the line) on malformed input: an unclosed comment, an unexpected
// character, unbalanced brackets inside a tag, a bad string escape.
std::vector<Token> tokenize(std::string_view source);

}  // namespace sparrow::jinja
