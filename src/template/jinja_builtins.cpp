// jinja2's builtin tests (jinja2/tests.py), the global functions of transformers' chat-template
// environment, and Python slicing.
#include "template/jinja_builtins.h"

#include <cmath>
#include <ctime>
#include <memory>
#include <unordered_map>

#include "template/jinja_limits.h"
#include "template/py_text.h"
#include "template/unicode.h"

namespace sparrow::jinja {
namespace {

const Value& one_arg(const Args& args, const char* test) {
  if (args.positional.size() != 1 || !args.keyword.empty()) template_fail("test '", test, "' takes one argument");
  return args.positional[0];
}

void no_args(const Args& args, const char* test) {
  if (!args.positional.empty() || !args.keyword.empty()) template_fail("test '", test, "' takes no arguments");
}

// Python's value % divisor == 0 / == 1 for the odd, even and divisibleby tests (ints or floats).
bool python_mod_is(const Value& value, const Value& divisor, int64_t expected) {
  for (const Value* v : {&value, &divisor}) {
    if (v->is_undefined()) v->fail_undefined();
    if (!v->is_number())
      template_fail("unsupported operand type(s) for %: '", type_name(value), "' and '", type_name(divisor), "'");
  }
  if (value.kind() == Value::Kind::Float || divisor.kind() == Value::Kind::Float) {
    double d = divisor.as_float();
    if (d == 0) template_fail("float modulo");
    double r = std::fmod(value.as_float(), d);
    if (r != 0 && ((r < 0) != (d < 0))) r += d;
    return r == static_cast<double>(expected);
  }
  int64_t d = divisor.as_int();
  if (d == 0) template_fail("integer division or modulo by zero");
  int64_t r = value.as_int() % d;
  if (r != 0 && ((r < 0) != (d < 0))) r += d;
  return r == expected;
}

bool compare_test(const Value& a, const Value& b, const char* op) {
  std::string o = op;
  if (o == "==") return equals(a, b);
  if (o == "!=") return !equals(a, b);
  if (o == "<") return less_than(a, b);
  if (o == ">") return less_than(b, a);
  if (o == "<=") return less_than(a, b) || equals(a, b);
  return less_than(b, a) || equals(a, b);
}

const std::unordered_map<std::string, TestFunction>& tests() {
  using K = Value::Kind;
  static const std::unordered_map<std::string, TestFunction> table = {
      {"defined",
       [](const Value& v, const Args& a) {
         no_args(a, "defined");
         return !v.is_undefined();
       }},
      {"undefined",
       [](const Value& v, const Args& a) {
         no_args(a, "undefined");
         return v.is_undefined();
       }},
      {"none",
       [](const Value& v, const Args& a) {
         no_args(a, "none");
         return v.is_none();
       }},
      {"boolean",
       [](const Value& v, const Args& a) {
         no_args(a, "boolean");
         return v.kind() == K::Bool;
       }},
      {"true",
       [](const Value& v, const Args& a) {
         no_args(a, "true");
         return v.kind() == K::Bool && v.as_bool();
       }},
      {"false",
       [](const Value& v, const Args& a) {
         no_args(a, "false");
         return v.kind() == K::Bool && !v.as_bool();
       }},
      {"integer",
       [](const Value& v, const Args& a) {
         no_args(a, "integer");
         return v.kind() == K::Int;
       }},
      {"float",
       [](const Value& v, const Args& a) {
         no_args(a, "float");
         return v.kind() == K::Float;
       }},
      // Python's bool is a Number, so `true is number` holds.
      {"number",
       [](const Value& v, const Args& a) {
         no_args(a, "number");
         return v.is_number();
       }},
      {"string",
       [](const Value& v, const Args& a) {
         no_args(a, "string");
         return v.is_string();
       }},
      {"mapping",
       [](const Value& v, const Args& a) {
         no_args(a, "mapping");
         return v.kind() == K::Dict;
       }},
      // iter() works on str, list, tuple, dict, a loop, and jinja2's Undefined (empty).
      {"iterable",
       [](const Value& v, const Args& a) {
         no_args(a, "iterable");
         return v.is_string() || v.is_sequence() || v.kind() == K::Dict || v.is_undefined() ||
                (v.kind() == K::Object && v.as_object().type_name == "LoopContext");
       }},
      // len() and [] work: str, list, tuple, dict, and Undefined (which defines both).
      {"sequence",
       [](const Value& v, const Args& a) {
         no_args(a, "sequence");
         return v.is_string() || v.is_sequence() || v.kind() == K::Dict || v.is_undefined();
       }},
      // jinja2's Undefined defines __call__ (to raise), so it counts as callable.
      {"callable",
       [](const Value& v, const Args& a) {
         no_args(a, "callable");
         return v.kind() == K::Function || v.is_undefined() || (v.kind() == K::Object && v.as_object().call);
       }},
      {"odd",
       [](const Value& v, const Args& a) {
         no_args(a, "odd");
         return python_mod_is(v, 2, 1);
       }},
      {"even",
       [](const Value& v, const Args& a) {
         no_args(a, "even");
         return python_mod_is(v, 2, 0);
       }},
      {"divisibleby", [](const Value& v, const Args& a) { return python_mod_is(v, one_arg(a, "divisibleby"), 0); }},
      {"lower",
       [](const Value& v, const Args& a) {
         no_args(a, "lower");
         std::string s = to_str(v);
         return lower(s) == s && upper(s) != s;
       }},
      {"upper",
       [](const Value& v, const Args& a) {
         no_args(a, "upper");
         std::string s = to_str(v);
         return upper(s) == s && lower(s) != s;
       }},
      {"escaped",
       [](const Value&, const Args& a) {
         no_args(a, "escaped");
         return false;
       }},
      {"in", [](const Value& v, const Args& a) { return contains(one_arg(a, "in"), v); }},
      {"sameas",
       [](const Value& v, const Args& a) {
         const Value& other = one_arg(a, "sameas");
         if (v.kind() != other.kind()) return false;
         if (v.is_none() || v.kind() == K::Bool) return equals(v, other);
         return v.identity() != nullptr && v.identity() == other.identity();
       }},
      {"filter",
       [](const Value& v, const Args& a) {
         no_args(a, "filter");
         return v.is_string() && find_filter(v.as_string()) != nullptr;
       }},
      {"test",
       [](const Value& v, const Args& a) {
         no_args(a, "test");
         return v.is_string() && find_test(v.as_string());
       }},
      {"eq", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "eq"), "=="); }},
      {"equalto", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "equalto"), "=="); }},
      {"==", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "=="), "=="); }},
      {"ne", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "ne"), "!="); }},
      {"!=", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "!="), "!="); }},
      {"lt", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "lt"), "<"); }},
      {"lessthan", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "lessthan"), "<"); }},
      {"<", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "<"), "<"); }},
      {"le", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "le"), "<="); }},
      {"<=", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "<="), "<="); }},
      {"gt", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "gt"), ">"); }},
      {"greaterthan", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "greaterthan"), ">"); }},
      {">", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, ">"), ">"); }},
      {"ge", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, "ge"), ">="); }},
      {">=", [](const Value& v, const Args& a) { return compare_test(v, one_arg(a, ">="), ">="); }},
  };
  return table;
}

// ---- global functions ----

// range(stop) / range(start, stop[, step]), capped like jinja2.sandbox (MAX_RANGE).
Value range_function(const Args& args) {
  if (!args.keyword.empty()) template_fail("range() takes no keyword arguments");
  const ValueList& p = args.positional;
  if (p.empty() || p.size() > 3) template_fail("range expected 1 to 3 arguments, got ", p.size());
  for (const Value& v : p)
    if (v.kind() != Value::Kind::Int && v.kind() != Value::Kind::Bool)
      template_fail("'", type_name(v), "' object cannot be interpreted as an integer");
  int64_t start = p.size() == 1 ? 0 : p[0].as_int();
  int64_t stop = p.size() == 1 ? p[0].as_int() : p[1].as_int();
  int64_t step = p.size() == 3 ? p[2].as_int() : 1;
  if (step == 0) template_fail("range() arg 3 must not be zero");
  ValueList items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    if (int64_t(items.size()) >= kMaxRangeItems)
      template_fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (", kMaxRangeItems, ").");
    items.emplace_back(i);
    if (__builtin_add_overflow(i, step, &i)) break;  // the next one is past any int64 stop
  }
  return Value::list(std::move(items));
}

// dict(...) and namespace(...) take a mapping or pairs positionally, then keyword arguments.
Dict dict_from_args(const Args& args, const char* callee) {
  if (args.positional.size() > 1) template_fail(callee, " expected at most 1 positional argument");
  Dict d;
  if (!args.positional.empty()) {
    const Value& source = args.positional[0];
    if (source.kind() == Value::Kind::Dict) {
      d = source.as_dict();
    } else {
      for (const Value& pair : iterate(source)) {
        ValueList kv = iterate(pair);
        if (kv.size() != 2) template_fail(callee, ": each element must be a key/value pair");
        d.set(kv[0], kv[1]);
      }
    }
  }
  for (const auto& [k, v] : args.keyword) d.set(Value(k), v);
  return d;
}

// jinja2's joiner(sep): returns "" the first time it is called and `sep` afterwards.
Value joiner_function(const Args& args) {
  ValueList p = bind_args(args, "joiner()", {optional("sep", ", ")});
  auto used = std::make_shared<bool>(false);
  std::string sep = to_str(p[0]);
  return Value::function("joiner", [used, sep](const Args&) -> Value {
    if (!*used) {
      *used = true;
      return Value("");
    }
    return Value(sep);
  });
}

}  // namespace

std::shared_ptr<Object> make_namespace(const Args& args) {
  auto ns = new_object("Namespace", /*assignable=*/true);
  ns->attributes = dict_from_args(args, "namespace()");
  return ns;
}

TestFunction find_test(const std::string& name) {
  auto it = tests().find(name);
  return it == tests().end() ? nullptr : it->second;
}

Dict global_functions() {
  Dict globals;
  globals.set("range", Value::function("range", range_function));
  globals.set("dict", Value::function("dict", [](const Args& a) { return Value::dict(dict_from_args(a, "dict()")); }));
  globals.set("namespace", Value::function("namespace", [](const Args& a) { return Value::object(make_namespace(a)); }));
  globals.set("joiner", Value::function("joiner", joiner_function));
  // transformers' chat-template globals (chat_template_utils._cached_compile_jinja_template).
  globals.set("raise_exception", Value::function("raise_exception", [](const Args& a) -> Value {
                ValueList p = bind_args(a, "raise_exception()", {required("message")});
                template_fail("raise_exception: ", to_str(p[0]));
              }));
  globals.set("strftime_now", Value::function("strftime_now", [](const Args& a) {
                ValueList p = bind_args(a, "strftime_now()", {required("format")});
                std::time_t now = std::time(nullptr);
                std::tm local{};
                localtime_r(&now, &local);
                char buf[512];
                size_t n = std::strftime(buf, sizeof buf, to_str(p[0]).c_str(), &local);
                return Value(std::string(buf, n));
              }));
  return globals;
}

Value slice(const Value& sequence, const Value& start, const Value& stop, const Value& step) {
  if (sequence.is_undefined()) sequence.fail_undefined();
  // jinja2 compiles x[a:b] to Python's own subscript (no getitem fallback), so errors are Python's.
  if (sequence.kind() == Value::Kind::Dict) template_fail("unhashable type: 'slice'");
  if (!sequence.is_string() && !sequence.is_sequence())
    template_fail("'", type_name(sequence), "' object is not subscriptable");
  for (const Value* v : {&start, &stop, &step}) {
    if (!v->is_none() && v->kind() != Value::Kind::Int && v->kind() != Value::Kind::Bool)
      template_fail("slice indices must be integers or None or have an __index__ method");
  }
  int64_t s = step.is_none() ? 1 : step.as_int();
  if (s == 0) template_fail("slice step cannot be zero");
  std::u32string text = sequence.is_string() ? utf8_decode(sequence.as_string()) : std::u32string();
  int64_t n = sequence.is_string() ? static_cast<int64_t>(text.size()) : static_cast<int64_t>(sequence.items().size());
  // CPython's PySlice_AdjustIndices.
  auto adjust = [&](const Value& v, int64_t if_none) {
    if (v.is_none()) return if_none;
    int64_t i = v.as_int();
    if (i < 0) {
      i += n;
      if (i < 0) i = s < 0 ? -1 : 0;
    } else if (i >= n) {
      i = s < 0 ? n - 1 : n;
    }
    return i;
  };
  int64_t first = adjust(start, s < 0 ? n - 1 : 0);
  int64_t last = adjust(stop, s < 0 ? -1 : n);
  std::vector<int64_t> picked;
  for (int64_t i = first; s > 0 ? i < last : i > last; i += s) picked.push_back(i);
  if (sequence.is_string()) {
    std::u32string out;
    for (int64_t i : picked) out += text[i];
    return utf8_encode(out);
  }
  ValueList out;
  for (int64_t i : picked) out.push_back(sequence.items()[i]);
  return sequence.kind() == Value::Kind::Tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

}  // namespace sparrow::jinja
