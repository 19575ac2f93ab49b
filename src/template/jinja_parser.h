// Builds the syntax tree from tokens, following jinja2's Parser (jinja2/parser.py) rule for rule so
// that operator precedence and the odd corners (tests taking one bare argument, `a if b` without
// else, left-associative **) come out the same.
//
// Tags: if/elif/else, for/else (with `if` filter and `recursive`), set (also block form), macro,
// filter, with, print, break/continue (jinja2.ext.loopcontrols) and transformers' generation.
// Template inheritance and includes (extends, block, include, import, call) are rejected: chat
// templates are rendered alone, with no loader.
#pragma once
#include <string_view>

#include "template/jinja_ast.h"

namespace sparrow::jinja {

// Throws TemplateError with the line on a syntax error.
Body parse_template(std::string_view source);

}  // namespace sparrow::jinja
