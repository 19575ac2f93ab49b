// The values a Jinja template computes with, modelled on the Python objects jinja2 hands around:
// undefined, None, bool, int, float, str, list, tuple, dict (insertion-ordered, as json.loads builds
// it), objects with attributes (namespace(), loop) and callables (macros, builtins, bound methods).
//
// Lists, tuples and dicts are immutable once built (transformers renders in jinja2's
// ImmutableSandboxedEnvironment, where list.append and dict.update are refused), so values share
// them freely. Only a namespace() object changes, through `{% set ns.attr = ... %}`.
//
// The free functions below are Python's semantics for these values: truthiness, str(), repr(),
// ==, <, and json.dumps, each byte-exact with CPython because their text ends up in prompts.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "core/error.h"

namespace sparrow::jinja {

// An error raised while parsing or rendering a template. `line` is the template line it belongs to,
// filled in by the innermost template node the error passes through (0 = not known yet).
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& message, int line = 0) : std::runtime_error(message), line(line) {}
  int line;
};

template <typename... Parts>
[[noreturn]] void template_fail(const Parts&... parts) {
  throw TemplateError(cat(parts...));
}

class Value;
using ValueList = std::vector<Value>;
class Dict;
struct Object;
struct Function;
struct Args;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Object, Function };

  // An undefined value; `message` is the error its misuse raises ("'x' is undefined").
  Value() : kind_(Kind::Undefined) {}
  static Value undefined(std::string message);
  static Value none();
  Value(bool b) : kind_(Kind::Bool), data_(b) {}
  Value(int i) : kind_(Kind::Int), data_(int64_t{i}) {}
  Value(int64_t i) : kind_(Kind::Int), data_(i) {}
  Value(double f) : kind_(Kind::Float), data_(f) {}
  Value(std::string s) : kind_(Kind::String), data_(std::move(s)) {}
  Value(const char* s) : Value(std::string(s)) {}
  // Containers know how deeply they nest (depth()); one nested more than kMaxValueDepth
  // (jinja_limits.h) is a TemplateError, so no value is too deep to walk or to destroy.
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value dict(Dict entries);
  static Value object(std::shared_ptr<Object> object);  // from new_object()
  // An object whose attributes change after it is built (a loop's LoopContext) but never hold a value
  // deeper than `deepest_attribute`.
  static Value object(std::shared_ptr<Object> object, int deepest_attribute);
  static Value function(std::string name, std::function<Value(const Args&)> call);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_sequence() const { return kind_ == Kind::List || kind_ == Kind::Tuple; }  // list or tuple
  // 0 for a scalar; 1 + the deepest item, key or attribute for a container. A namespace counts 1 whatever
  // it holds: its attributes change after it is built (see new_object for why that is safe).
  int depth() const { return depth_; }

  // The accessors check the kind: a template can pass any value where a builtin expects, say, an int
  // (`replace('a', 'b', x)`), and that must be a one-line template error (for an undefined value, its
  // own error), as Python raises a TypeError, not a C++ exception escaping the renderer.
  bool as_bool() const {
    expect_kind(kind_ == Kind::Bool, "a bool");
    return std::get<bool>(data_);
  }
  int64_t as_int() const;   // Int or Bool
  double as_float() const;  // Int, Bool or Float
  const std::string& as_string() const {
    expect_kind(kind_ == Kind::String, "a string");
    return std::get<std::string>(data_);
  }
  const std::string& undefined_message() const { return std::get<std::string>(data_); }
  const ValueList& items() const {
    expect_kind(is_sequence(), "a list");
    return *std::get<std::shared_ptr<const ValueList>>(data_);
  }
  const Dict& as_dict() const {
    expect_kind(kind_ == Kind::Dict, "a dict");
    return *std::get<std::shared_ptr<const Dict>>(data_);
  }
  Object& as_object() const {
    expect_kind(kind_ == Kind::Object, "an object");
    return *std::get<std::shared_ptr<Object>>(data_);
  }
  const Function& as_function() const {
    expect_kind(kind_ == Kind::Function, "a function");
    return *std::get<std::shared_ptr<const Function>>(data_);
  }
  // Identity, for `is sameas` and == on objects and functions.
  const void* identity() const;

  // Raises this undefined value's error (an operation needed a real value).
  [[noreturn]] void fail_undefined() const;

 private:
  // Unless `ok`: the undefined value's error, or "expected <what>, got '<type>'".
  void expect_kind(bool ok, const char* expected) const {
    if (!ok) fail_kind(expected);
  }
  [[noreturn]] void fail_kind(const char* expected) const;

  Value(Kind kind,
        std::variant<std::monostate, bool, int64_t, double, std::string, std::shared_ptr<const ValueList>,
                     std::shared_ptr<const Dict>, std::shared_ptr<Object>, std::shared_ptr<const Function>>
            data,
        int depth = 0)
      : kind_(kind), depth_(depth), data_(std::move(data)) {}

  Kind kind_;
  int depth_ = 0;
  // None: monostate; Undefined: its error message as a string.
  std::variant<std::monostate, bool, int64_t, double, std::string, std::shared_ptr<const ValueList>,
               std::shared_ptr<const Dict>, std::shared_ptr<Object>, std::shared_ptr<const Function>>
      data_;
};

// A Python dict: keys in insertion order; assigning an existing key keeps its position.
class Dict {
 public:
  using Entry = std::pair<Value, Value>;
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  void set(Value key, Value value);
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const std::vector<Entry>& entries() const { return entries_; }
  // The value of entry i (in insertion order), to change it without looking its key up.
  Value& value_at(size_t i) { return entries_[i].second; }

 private:
  // A request may send an object of 100,000 keys: past this size string keys are found through
  // string_keys_, so building and reading such a dict takes linear time, not quadratic.
  static constexpr size_t kIndexedSize = 16;
  Value* find_string(const std::string& key);

  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> string_keys_;  // key -> its entry; empty while the dict is small
};

// An object with named attributes: a namespace() (assignable with `set ns.x = ...`) or a loop
// (callable when the loop is `recursive`).
struct Object {
  std::string type_name;  // "Namespace", "LoopContext"
  bool assignable = false;
  Dict attributes;
  std::function<Value(const Args&)> call;  // empty: not callable
};

// A new object. Namespaces hold values assigned after they are built, so chains of them can grow
// without bound ({% set cur.next = namespace() %} in a loop); their owner pointers free them one after
// another instead of inside one another, so dropping a long chain cannot overflow the stack.
std::shared_ptr<Object> new_object(std::string type_name, bool assignable);

// Arguments of a call: f(a, b, key=c).
struct Args {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Function {
  std::string name;
  std::function<Value(const Args&)> call;
};

// One parameter of a builtin's Python signature, for bind_args.
struct Param {
  const char* name;
  bool required = false;
  Value default_value = Value::none();
};
inline Param required(const char* name) { return Param{name, true, Value()}; }
inline Param optional(const char* name, Value default_value = Value::none()) {
  return Param{name, false, std::move(default_value)};
}
// Binds call arguments to a signature the way Python does (positional first, then by keyword) and
// returns one value per parameter. `callee` names the builtin in errors ("filter 'indent'").
ValueList bind_args(const Args& args, const std::string& callee, const std::vector<Param>& params);

// Python's semantics of the values.
bool truthy(const Value& v);
std::string to_str(const Value& v);     // str(v); undefined prints as ""
std::string repr(const Value& v);       // repr(v), e.g. {'a': [1, 'x', None]}
std::string type_name(const Value& v);  // Python's type name: str, int, dict, NoneType, ...
bool equals(const Value& a, const Value& b);
bool less_than(const Value& a, const Value& b);  // a < b; TypeError for unorderable kinds
Value length(const Value& v);                    // len(v)
// Iterates like Python's iter(): a list's items, a dict's keys, a string's characters; an undefined
// value is empty. Anything else is a TypeError.
ValueList iterate(const Value& v);
// `needle in haystack`.
bool contains(const Value& haystack, const Value& needle);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys), as transformers' tojson filter calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;          // None: one line; else newlines and this text per level
  std::optional<std::string> item_separator;  // None: ", " without indent, "," with
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string json_dumps(const Value& v, const JsonOptions& options);

}  // namespace sparrow::jinja
