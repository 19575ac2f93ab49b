// The Python methods a template reaches through `value.name(...)`: str, dict, list and tuple
// methods, with the arguments and results CPython gives them. Mutating methods (list.append,
// dict.update, ...) exist but are refused, as in transformers' ImmutableSandboxedEnvironment
// (jinja2.sandbox.modifies_known_mutable).
#include <unordered_map>

#include "template/jinja_builtins.h"
#include "template/jinja_limits.h"
#include "template/py_text.h"
#include "template/unicode.h"

namespace sparrow::jinja {
namespace {

using Method = Value (*)(const Value& self, const Args& args);
using MethodTable = std::unordered_map<std::string, Method>;

ValueList bind(const Args& args, const char* method, const std::vector<Param>& params) {
  return bind_args(args, std::string(method) + "()", params);
}

const std::string& expect_string(const Value& v, const char* method, const char* what) {
  if (!v.is_string()) template_fail(method, "() argument '", what, "' must be str, not ", type_name(v));
  return v.as_string();
}

std::optional<std::string> optional_string(const Value& v, const char* method, const char* what) {
  if (v.is_none()) return std::nullopt;
  return expect_string(v, method, what);
}

int64_t expect_int(const Value& v, const char* method, const char* what) {
  if (v.kind() != Value::Kind::Int && v.kind() != Value::Kind::Bool)
    template_fail(method, "() argument '", what, "' must be int, not ", type_name(v));
  return v.as_int();
}

Value string_list(const std::vector<std::string>& parts) {
  ValueList items(parts.begin(), parts.end());
  return Value::list(std::move(items));
}

// The part of `s` between code-point positions start and end (Python's s[start:end]) for the
// optional start/end arguments of find, count, startswith, ...
std::string sub_range(const std::string& s, const Value& start, const Value& end) {
  if (start.is_none() && end.is_none()) return s;
  return slice(Value(s), start, end, Value::none()).as_string();
}

// ---- str ----

Value str_affix(const Value& self, const Args& args, bool prefix) {
  const char* name = prefix ? "startswith" : "endswith";
  ValueList a = bind(args, name, {required(prefix ? "prefix" : "suffix"), optional("start"), optional("end")});
  std::string s = sub_range(self.as_string(), a[1], a[2]);
  auto matches = [&](const Value& affix) {
    const std::string& t = expect_string(affix, name, prefix ? "prefix" : "suffix");
    if (t.size() > s.size()) return false;
    return prefix ? s.compare(0, t.size(), t) == 0 : s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  if (a[0].kind() == Value::Kind::Tuple) {
    for (const Value& affix : a[0].items())
      if (matches(affix)) return true;
    return false;
  }
  return matches(a[0]);
}

Value str_split(const Value& self, const Args& args, bool from_right) {
  const char* name = from_right ? "rsplit" : "split";
  ValueList a = bind(args, name, {optional("sep"), optional("maxsplit", -1)});
  auto sep = optional_string(a[0], name, "sep");
  if (sep && sep->empty()) template_fail("empty separator");
  int64_t maxsplit = expect_int(a[1], name, "maxsplit");
  return string_list(from_right ? rsplit(self.as_string(), sep, maxsplit) : split(self.as_string(), sep, maxsplit));
}

Value str_strip(const Value& self, const Args& args, bool left, bool right, const char* name) {
  ValueList a = bind(args, name, {optional("chars")});
  return strip(self.as_string(), optional_string(a[0], name, "chars"), left, right);
}

Value str_find(const Value& self, const Args& args, bool from_right, bool must_exist, const char* name) {
  ValueList a = bind(args, name, {required("sub"), optional("start"), optional("end")});
  const std::string& sub = expect_string(a[0], name, "sub");
  std::string s = sub_range(self.as_string(), a[1], a[2]);
  int64_t at = jinja::find(s, sub, from_right);
  if (at < 0 && must_exist) template_fail("substring not found");
  if (at >= 0 && !a[1].is_none()) {  // positions count from the start of the whole string
    int64_t start = a[1].as_int(), n = static_cast<int64_t>(utf8_length(self.as_string()));
    at += start < 0 ? std::max<int64_t>(0, n + start) : std::min(start, n);
  }
  return at;
}

// str.format with automatic ({}), numbered ({0}) and named ({name}) fields and !s / !r conversions.
Value str_format(const Value& self, const Args& args) {
  const std::string& fmt = self.as_string();
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}')
        ++i;
      else
        template_fail("Single '}' encountered in format string");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = fmt.find('}', i);
    if (close == std::string::npos) template_fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    char conversion = 0;
    if (size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos || field.find('.') != std::string::npos ||
        field.find('[') != std::string::npos)
      template_fail("str.format: format specs and attribute access in fields are not supported");
    const Value* value = nullptr;
    if (field.empty()) {
      if (auto_index >= args.positional.size()) template_fail("Replacement index ", auto_index, " out of range");
      value = &args.positional[auto_index++];
    } else if (auto index = parse_int(field, 10)) {
      if (*index < 0 || static_cast<size_t>(*index) >= args.positional.size())
        template_fail("Replacement index ", *index, " out of range");
      value = &args.positional[*index];
    } else {
      for (const auto& [name, v] : args.keyword)
        if (name == field) value = &v;
      if (!value) template_fail("str.format: no argument named '", field, "'");
    }
    out += conversion == 'r' ? repr(*value) : to_str(*value);
    check_string_size(int64_t(out.size()));  // '{0}{0}{0}...' repeats one argument
  }
  return out;
}

Value str_join(const Value& self, const Args& args) {
  ValueList a = bind(args, "join", {required("iterable")});
  std::string out;
  ValueList items = iterate(a[0]);
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string())
      template_fail("sequence item ", i, ": expected str instance, ", type_name(items[i]), " found");
    if (i) out += self.as_string();
    out += items[i].as_string();
    check_string_size(int64_t(out.size()));
  }
  return out;
}

Value str_pad(const Value& self, const Args& args, char align, const char* name) {
  ValueList a = bind(args, name, {required("width"), optional("fillchar", " ")});
  const std::string& fill = expect_string(a[1], name, "fillchar");
  if (utf8_length(fill) != 1) template_fail("The fill character must be exactly one character long");
  return pad(self.as_string(), expect_int(a[0], name, "width"), fill, align);
}

Value str_partition(const Value& self, const Args& args, bool from_right) {
  const char* name = from_right ? "rpartition" : "partition";
  ValueList a = bind(args, name, {required("sep")});
  const std::string& s = self.as_string();
  const std::string& sep = expect_string(a[0], name, "sep");
  if (sep.empty()) template_fail("empty separator");
  size_t at = from_right ? s.rfind(sep) : s.find(sep);
  if (at == std::string::npos) return from_right ? Value::tuple({"", "", s}) : Value::tuple({s, "", ""});
  return Value::tuple({s.substr(0, at), sep, s.substr(at + sep.size())});
}

template <bool (*Predicate)(char32_t)>
Value str_all(const Value& self, const Args& args) {
  if (!args.positional.empty() || !args.keyword.empty()) template_fail("str.is...() takes no arguments");
  std::u32string text = utf8_decode(self.as_string());
  if (text.empty()) return false;
  for (char32_t c : text)
    if (!Predicate(c)) return false;
  return true;
}
bool is_alnum_char(char32_t c) { return is_alpha(c) || is_digit(c); }

// str.islower / str.isupper: at least one cased character, and none of the other case.
Value str_case_check(const Value& self, bool want_lower) {
  bool any_cased = false;
  for (char32_t c : utf8_decode(self.as_string())) {
    if (!is_cased(c)) continue;
    any_cased = true;
    bool is_lower = to_upper(c) != c || c == 0xDF;
    if (is_lower != want_lower) return false;
  }
  return any_cased;
}

const MethodTable& str_methods() {
  static const MethodTable table = {
      {"startswith", [](const Value& s, const Args& a) { return str_affix(s, a, true); }},
      {"endswith", [](const Value& s, const Args& a) { return str_affix(s, a, false); }},
      {"split", [](const Value& s, const Args& a) { return str_split(s, a, false); }},
      {"rsplit", [](const Value& s, const Args& a) { return str_split(s, a, true); }},
      {"strip", [](const Value& s, const Args& a) { return str_strip(s, a, true, true, "strip"); }},
      {"lstrip", [](const Value& s, const Args& a) { return str_strip(s, a, true, false, "lstrip"); }},
      {"rstrip", [](const Value& s, const Args& a) { return str_strip(s, a, false, true, "rstrip"); }},
      {"find", [](const Value& s, const Args& a) { return str_find(s, a, false, false, "find"); }},
      {"rfind", [](const Value& s, const Args& a) { return str_find(s, a, true, false, "rfind"); }},
      {"index", [](const Value& s, const Args& a) { return str_find(s, a, false, true, "index"); }},
      {"rindex", [](const Value& s, const Args& a) { return str_find(s, a, true, true, "rindex"); }},
      {"format", str_format},
      {"join", str_join},
      {"center", [](const Value& s, const Args& a) { return str_pad(s, a, '^', "center"); }},
      {"ljust", [](const Value& s, const Args& a) { return str_pad(s, a, '<', "ljust"); }},
      {"rjust", [](const Value& s, const Args& a) { return str_pad(s, a, '>', "rjust"); }},
      {"partition", [](const Value& s, const Args& a) { return str_partition(s, a, false); }},
      {"rpartition", [](const Value& s, const Args& a) { return str_partition(s, a, true); }},
      {"lower",
       [](const Value& s, const Args& a) {
         bind(a, "lower", {});
         return Value(lower(s.as_string()));
       }},
      {"upper",
       [](const Value& s, const Args& a) {
         bind(a, "upper", {});
         return Value(upper(s.as_string()));
       }},
      {"casefold",
       [](const Value& s, const Args& a) {
         bind(a, "casefold", {});
         return Value(lower(s.as_string()));
       }},
      {"title",
       [](const Value& s, const Args& a) {
         bind(a, "title", {});
         return Value(title(s.as_string()));
       }},
      {"capitalize",
       [](const Value& s, const Args& a) {
         bind(a, "capitalize", {});
         return Value(capitalize(s.as_string()));
       }},
      {"replace",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "replace", {required("old"), required("new"), optional("count", -1)});
         return Value(jinja::replace(s.as_string(), expect_string(p[0], "replace", "old"),
                                     expect_string(p[1], "replace", "new"), expect_int(p[2], "replace", "count")));
       }},
      {"count",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "count", {required("sub"), optional("start"), optional("end")});
         return Value(jinja::count(sub_range(s.as_string(), p[1], p[2]), expect_string(p[0], "count", "sub")));
       }},
      {"splitlines",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "splitlines", {optional("keepends", false)});
         return string_list(splitlines(s.as_string(), truthy(p[0])));
       }},
      {"removeprefix",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "removeprefix", {required("prefix")});
         const std::string &text = s.as_string(), &prefix = expect_string(p[0], "removeprefix", "prefix");
         return Value(text.compare(0, prefix.size(), prefix) == 0 ? text.substr(prefix.size()) : text);
       }},
      {"removesuffix",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "removesuffix", {required("suffix")});
         const std::string &text = s.as_string(), &suffix = expect_string(p[0], "removesuffix", "suffix");
         bool ends = !suffix.empty() && text.size() >= suffix.size() &&
                     text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
         return Value(ends ? text.substr(0, text.size() - suffix.size()) : text);
       }},
      {"zfill",
       [](const Value& s, const Args& a) {
         ValueList p = bind(a, "zfill", {required("width")});
         std::string text = s.as_string();
         int64_t missing = expect_int(p[0], "zfill", "width") - static_cast<int64_t>(utf8_length(text));
         if (missing <= 0) return Value(text);
         check_string_size(int64_t(text.size()) + missing);
         size_t sign = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;
         return Value(text.substr(0, sign) + std::string(missing, '0') + text.substr(sign));
       }},
      {"isalpha", str_all<is_alpha>},
      {"isdigit", str_all<is_digit>},
      {"isdecimal", str_all<is_digit>},
      {"isnumeric", str_all<is_digit>},
      {"isspace", str_all<is_space>},
      {"isalnum", str_all<is_alnum_char>},
      {"islower",
       [](const Value& s, const Args& a) {
         bind(a, "islower", {});
         return str_case_check(s, true);
       }},
      {"isupper",
       [](const Value& s, const Args& a) {
         bind(a, "isupper", {});
         return str_case_check(s, false);
       }},
  };
  return table;
}

// ---- dict, list, tuple ----

Value items_of(const Dict& d) {
  ValueList items;
  for (const auto& [k, v] : d.entries()) items.push_back(Value::tuple({k, v}));
  return Value::list(std::move(items));
}

const MethodTable& dict_methods() {
  static const MethodTable table = {
      {"get",
       [](const Value& self, const Args& a) {
         ValueList p = bind(a, "get", {required("key"), optional("default")});
         const Value* found = self.as_dict().find(p[0]);
         return found ? *found : p[1];
       }},
      {"items",
       [](const Value& self, const Args& a) {
         bind(a, "items", {});
         return items_of(self.as_dict());
       }},
      {"keys",
       [](const Value& self, const Args& a) {
         bind(a, "keys", {});
         return Value::list(iterate(self));
       }},
      {"values",
       [](const Value& self, const Args& a) {
         bind(a, "values", {});
         ValueList values;
         for (const auto& entry : self.as_dict().entries()) values.push_back(entry.second);
         return Value::list(std::move(values));
       }},
      {"copy",
       [](const Value& self, const Args& a) {
         bind(a, "copy", {});
         return self;
       }},
  };
  return table;
}

Value sequence_count(const Value& self, const Args& a) {
  ValueList p = bind(a, "count", {required("value")});
  int64_t n = 0;
  for (const Value& item : self.items()) n += equals(item, p[0]);
  return n;
}

Value sequence_index(const Value& self, const Args& a) {
  ValueList p = bind(a, "index", {required("value")});
  const ValueList& items = self.items();
  for (size_t i = 0; i < items.size(); ++i)
    if (equals(items[i], p[0])) return static_cast<int64_t>(i);
  template_fail(repr(p[0]), " is not in ", type_name(self));
}

const MethodTable& sequence_methods() {
  static const MethodTable table = {
      {"count", sequence_count},
      {"index", sequence_index},
      {"copy",
       [](const Value& self, const Args& a) {
         bind(a, "copy", {});
         return Value::list(self.items());
       }},
  };
  return table;
}

// jinja2.sandbox's _mutable_spec: methods that change a list or dict in place.
bool is_mutating(Value::Kind kind, const std::string& name) {
  static const char* const kList[] = {"append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"};
  static const char* const kDict[] = {"clear", "pop", "popitem", "setdefault", "update"};
  if (kind == Value::Kind::List) {
    for (const char* m : kList)
      if (name == m) return true;
  } else if (kind == Value::Kind::Dict) {
    for (const char* m : kDict)
      if (name == m) return true;
  }
  return false;
}

// Python's other method names on these types: they exist (so dict key lookup is not tried) but
// chat templates do not use them.
bool is_unsupported_method(Value::Kind kind, const std::string& name) {
  static const char* const kStr[] = {"encode",      "expandtabs", "format_map", "isascii",  "isidentifier",
                                     "isprintable", "istitle",    "maketrans",  "swapcase", "translate"};
  if (kind == Value::Kind::String) {
    for (const char* m : kStr)
      if (name == m) return true;
  }
  return kind == Value::Kind::Dict && name == "fromkeys";
}

}  // namespace

std::optional<Value> find_method(const Value& receiver, const std::string& name) {
  const MethodTable* table = nullptr;
  switch (receiver.kind()) {
    case Value::Kind::String:
      table = &str_methods();
      break;
    case Value::Kind::Dict:
      table = &dict_methods();
      break;
    case Value::Kind::List:
      table = &sequence_methods();
      break;
    case Value::Kind::Tuple:
      if (name == "copy") return std::nullopt;  // tuples have only count and index
      table = &sequence_methods();
      break;
    default:
      return std::nullopt;
  }
  if (is_mutating(receiver.kind(), name))
    return Value::undefined(cat("access to attribute '", name, "' of '", type_name(receiver), "' object is unsafe."));
  std::string qualified = type_name(receiver) + "." + name;
  if (is_unsupported_method(receiver.kind(), name))
    return Value::function(qualified, [qualified](const Args&) -> Value {
      template_fail(qualified, "() is not supported in chat templates");
    });
  auto it = table->find(name);
  if (it == table->end()) return std::nullopt;
  Method method = it->second;
  return Value::function(qualified, [receiver, method](const Args& args) { return method(receiver, args); });
}

namespace {

// jinja2.utils.object_type_repr, for undefined-value messages: "'dict object' has no attribute 'x'".
std::string object_type_repr(const Value& v) { return v.is_none() ? "None" : type_name(v) + " object"; }

// Python attributes of the value's type (methods, a namespace's or loop's attributes), or nullopt.
std::optional<Value> python_attribute(const Value& object, const std::string& name) {
  if (name.rfind("__", 0) == 0)  // dunder attributes exist on everything and are refused by the sandbox
    return Value::undefined(cat("access to attribute '", name, "' of '", type_name(object), "' object is unsafe."));
  if (auto method = find_method(object, name)) return method;
  if (object.kind() == Value::Kind::Object)
    if (const Value* v = object.as_object().attributes.find(name)) return *v;
  return std::nullopt;
}

}  // namespace

Value get_attribute(const Value& object, const std::string& name) {
  if (object.is_undefined()) object.fail_undefined();
  if (auto attribute = python_attribute(object, name)) return *attribute;
  if (object.kind() == Value::Kind::Dict)
    if (const Value* v = object.as_dict().find(name)) return *v;
  return Value::undefined(cat("'", object_type_repr(object), "' has no attribute '", name, "'"));
}

Value get_item(const Value& object, const Value& key) {
  if (object.is_undefined()) object.fail_undefined();
  bool integer_key = key.kind() == Value::Kind::Int || key.kind() == Value::Kind::Bool;
  switch (object.kind()) {
    case Value::Kind::Dict:
      if (const Value* v = object.as_dict().find(key)) return *v;
      break;
    case Value::Kind::List:
    case Value::Kind::Tuple:
      if (integer_key) {
        int64_t n = static_cast<int64_t>(object.items().size()), i = key.as_int();
        if (i < 0) i += n;
        if (i >= 0 && i < n) return object.items()[i];
      }
      break;
    case Value::Kind::String:
      if (integer_key) {
        std::u32string text = utf8_decode(object.as_string());
        int64_t n = static_cast<int64_t>(text.size()), i = key.as_int();
        if (i < 0) i += n;
        if (i >= 0 && i < n) return utf8_encode(text.substr(i, 1));
      }
      break;
    default:
      break;
  }
  if (key.is_string()) {  // jinja2 falls back to an attribute for string keys
    if (auto attribute = python_attribute(object, key.as_string())) return *attribute;
    return Value::undefined(cat("'", object_type_repr(object), "' has no attribute '", key.as_string(), "'"));
  }
  return Value::undefined(cat(object_type_repr(object), " has no element ", repr(key)));
}

}  // namespace sparrow::jinja
