// What a template can call besides its own macros, as transformers' environment offers it:
//   filters  (jinja2's builtin filters, with transformers' own tojson)      jinja_filters.cpp
//   tests    (jinja2's builtin tests: defined, string, mapping, ...)        jinja_builtins.cpp
//   globals  (range, dict, namespace, raise_exception, strftime_now)         jinja_builtins.cpp
//   methods  (the Python str / dict / list methods reachable as x.name(),    jinja_methods.cpp
//             minus the ones ImmutableSandboxedEnvironment refuses)
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "template/jinja_value.h"

namespace sparrow::jinja {

using FilterFunction = Value (*)(const Value& input, const Args& args);
using TestFunction = bool (*)(const Value& input, const Args& args);

// nullptr when jinja2 has no filter / test of that name.
FilterFunction find_filter(const std::string& name);
TestFunction find_test(const std::string& name);

// The global functions every template sees; template variables of the same name hide them.
Dict global_functions();
// namespace(...): a new assignable object holding the given attributes (a mapping or pairs, then
// keyword arguments).
std::shared_ptr<Object> make_namespace(const Args& args);

// `receiver.name` where `name` is a Python method of the receiver's type: a bound method, or, for
// methods that would mutate (list.append, dict.update, ...), an undefined value whose use raises the
// sandbox's "access to attribute ... is unsafe" error. nullopt when the type has no such method.
std::optional<Value> find_method(const Value& receiver, const std::string& name);

// jinja2's sandboxed attribute and item lookup (SandboxedEnvironment.getattr / getitem):
//   obj.name   a method of obj's type, else (dicts) the key, else an undefined value;
//   obj[key]   the key or index, else (string keys) a method, else an undefined value.
// Names starting with '_' are refused. Looking into an undefined value raises its error.
Value get_attribute(const Value& object, const std::string& name);
Value get_item(const Value& object, const Value& key);

// Python's "%" string formatting (str % args), used by the `format` filter and the % operator.
std::string percent_format(const std::string& format, const Value& args);

// Python's slicing: sequence[start:stop:step] on a list, tuple or str (None parts are absent).
Value slice(const Value& sequence, const Value& start, const Value& stop, const Value& step);

}  // namespace sparrow::jinja
