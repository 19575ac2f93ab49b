// A parsed Jinja template, rendered the way transformers renders chat templates: jinja2's
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the loop-controls extension,
// transformers' {% generation %} tag, its tojson filter and its raise_exception / strftime_now
// globals, and the default (non-strict) Undefined.
//
//   jinja::Template t(source, "chat template");
//   std::string prompt = t.render(variables);   // variables: a Dict of name -> Value
//
// Errors (syntax, runtime, raise_exception) are one-line sparrow::Errors naming the template line:
//   "chat template line 12: unknown filter 'foo'".
// Parsing and rendering keep to the limits of jinja_limits.h (nesting, recursion, loop iterations,
// string and list sizes); passing one is such an error too.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "template/jinja_ast.h"
#include "template/jinja_value.h"

namespace sparrow::jinja {

class Template {
 public:
  // Parses `source` (UTF-8); `name` starts every error message.
  Template(std::string_view source, std::string name);
  std::string render(const Dict& variables) const;

 private:
  std::shared_ptr<const Body> body_;
  std::string name_;
};

}  // namespace sparrow::jinja
