#include "template/jinja_value.h"

#include <algorithm>
#include <cmath>

#include "template/jinja_limits.h"
#include "template/py_text.h"
#include "template/unicode.h"

namespace sparrow::jinja {

void check_string_size(int64_t bytes) {
  if (bytes > kMaxStringBytes)
    template_fail("a string of ", bytes, " bytes exceeds the template limit of ", kMaxStringBytes, " bytes");
}

void check_list_size(int64_t items) {
  if (items > kMaxListItems)
    template_fail("a list of ", items, " items exceeds the template limit of ", kMaxListItems, " items");
}

namespace {

// The depth of a container holding values of these depths.
int container_depth(int deepest_item) {
  if (deepest_item + 1 > kMaxValueDepth)
    template_fail("a value nested more than ", kMaxValueDepth, " levels deep (the template limit)");
  return deepest_item + 1;
}

int container_depth(const ValueList& items) {
  int deepest = 0;
  for (const Value& item : items) deepest = std::max(deepest, item.depth());
  return container_depth(deepest);
}

int container_depth(const Dict& entries) {
  int deepest = 0;
  for (const auto& [key, value] : entries.entries()) deepest = std::max({deepest, key.depth(), value.depth()});
  return container_depth(deepest);
}

// Frees objects one after another: an object freed while another is being freed waits in `pending`
// until that one is done, so a chain of a million namespaces takes a loop, not a million nested calls.
struct ObjectDeleter {
  void operator()(Object* object) const {
    thread_local std::vector<Object*>* pending = nullptr;
    if (pending) {
      pending->push_back(object);
      return;
    }
    std::vector<Object*> queue = {object};
    pending = &queue;
    while (!queue.empty()) {
      Object* next = queue.back();
      queue.pop_back();
      delete next;  // may queue the objects only it held
    }
    pending = nullptr;
  }
};

}  // namespace

std::shared_ptr<Object> new_object(std::string type_name, bool assignable) {
  auto object = std::shared_ptr<Object>(new Object, ObjectDeleter());
  object->type_name = std::move(type_name);
  object->assignable = assignable;
  return object;
}

Value Value::undefined(std::string message) { return Value(Kind::Undefined, std::move(message)); }
Value Value::none() { return Value(Kind::None, std::monostate{}); }
Value Value::list(ValueList items) {
  int depth = container_depth(items);
  return Value(Kind::List, std::make_shared<const ValueList>(std::move(items)), depth);
}
Value Value::tuple(ValueList items) {
  int depth = container_depth(items);
  return Value(Kind::Tuple, std::make_shared<const ValueList>(std::move(items)), depth);
}
Value Value::dict(Dict entries) {
  int depth = container_depth(entries);
  return Value(Kind::Dict, std::make_shared<const Dict>(std::move(entries)), depth);
}
Value Value::object(std::shared_ptr<Object> object) {
  int depth = object->assignable ? 1 : container_depth(object->attributes);
  return Value(Kind::Object, std::move(object), depth);
}
Value Value::object(std::shared_ptr<Object> object, int deepest_attribute) {
  return Value(Kind::Object, std::move(object), container_depth(deepest_attribute));
}
Value Value::function(std::string name, std::function<Value(const Args&)> call) {
  return Value(Kind::Function, std::make_shared<const Function>(Function{std::move(name), std::move(call)}));
}

int64_t Value::as_int() const {
  if (kind_ == Kind::Bool) return int64_t{as_bool()};
  expect_kind(kind_ == Kind::Int, "an int");
  return std::get<int64_t>(data_);
}

double Value::as_float() const {
  if (kind_ == Kind::Float) return std::get<double>(data_);
  expect_kind(kind_ == Kind::Int || kind_ == Kind::Bool, "a number");
  return static_cast<double>(as_int());
}

void Value::fail_kind(const char* expected) const {
  if (is_undefined()) fail_undefined();
  template_fail("expected ", expected, ", got '", type_name(*this), "'");
}

const void* Value::identity() const {
  switch (kind_) {
    case Kind::List:
    case Kind::Tuple:
      return std::get<std::shared_ptr<const ValueList>>(data_).get();
    case Kind::Dict:
      return std::get<std::shared_ptr<const Dict>>(data_).get();
    case Kind::Object:
      return std::get<std::shared_ptr<Object>>(data_).get();
    case Kind::Function:
      return std::get<std::shared_ptr<const Function>>(data_).get();
    default:
      return nullptr;
  }
}

void Value::fail_undefined() const { throw TemplateError(undefined_message()); }

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(key.as_string());
  for (const auto& [k, v] : entries_)
    if (equals(k, key)) return &v;
  return nullptr;
}

const Value* Dict::find(const std::string& key) const { return const_cast<Dict*>(this)->find_string(key); }

Value* Dict::find_string(const std::string& key) {
  if (!string_keys_.empty()) {
    auto it = string_keys_.find(key);
    return it == string_keys_.end() ? nullptr : &entries_[it->second].second;
  }
  for (auto& [k, v] : entries_)
    if (k.is_string() && k.as_string() == key) return &v;
  return nullptr;
}

void Dict::set(Value key, Value value) {
  Value* existing = nullptr;
  if (key.is_string()) {
    existing = find_string(key.as_string());
  } else {
    for (auto it = entries_.begin(); it != entries_.end() && !existing; ++it)
      if (equals(it->first, key)) existing = &it->second;
  }
  if (existing) {
    *existing = std::move(value);
    return;
  }
  entries_.emplace_back(std::move(key), std::move(value));
  if (entries_.size() == kIndexedSize) {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].first.is_string()) string_keys_.emplace(entries_[i].first.as_string(), i);
  } else if (entries_.size() > kIndexedSize && entries_.back().first.is_string()) {
    string_keys_.emplace(entries_.back().first.as_string(), entries_.size() - 1);
  }
}

ValueList bind_args(const Args& args, const std::string& callee, const std::vector<Param>& params) {
  if (args.positional.size() > params.size())
    template_fail(callee, " takes at most ", params.size(), " argument(s) (", args.positional.size(), " given)");
  ValueList bound(params.size());
  std::vector<bool> given(params.size(), false);
  for (size_t i = 0; i < args.positional.size(); ++i) bound[i] = args.positional[i], given[i] = true;
  for (const auto& [name, value] : args.keyword) {
    // An init-capture: clang before 16 cannot capture a structured binding (the sanitizer build uses clang).
    auto it = std::find_if(params.begin(), params.end(), [&name = name](const Param& p) { return name == p.name; });
    if (it == params.end()) template_fail(callee, " got an unexpected keyword argument '", name, "'");
    size_t i = it - params.begin();
    if (given[i]) template_fail(callee, " got multiple values for argument '", name, "'");
    bound[i] = value, given[i] = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (given[i]) continue;
    if (params[i].required) template_fail(callee, " is missing the required argument '", params[i].name, "'");
    bound[i] = params[i].default_value;
  }
  return bound;
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return false;
    case Value::Kind::Bool:
      return v.as_bool();
    case Value::Kind::Int:
      return v.as_int() != 0;
    case Value::Kind::Float:
      return v.as_float() != 0;
    case Value::Kind::String:
      return !v.as_string().empty();
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return !v.items().empty();
    case Value::Kind::Dict:
      return !v.as_dict().empty();
    case Value::Kind::Object:
    case Value::Kind::Function:
      return true;
  }
  return false;
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return "";
    case Value::Kind::String:
      return v.as_string();
    default:
      return repr(v);
  }
}

namespace {

std::string repr_at(const Value& v, int level);

std::string join_repr(const ValueList& items, int level) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    out += repr_at(items[i], level);
    check_string_size(int64_t(out.size()));
  }
  return out;
}

std::string dict_repr(const Dict& d, int level) {
  std::string out = "{";
  bool first = true;
  for (const auto& [k, val] : d.entries()) {
    if (!first) out += ", ";
    first = false;
    out += repr_at(k, level) + ": " + repr_at(val, level);
    check_string_size(int64_t(out.size()));
  }
  return out + "}";
}

// repr(v) for a value inside `level` others. Only namespaces nest deeper than their depth() says
// (they may even hold themselves), hence the count.
std::string repr_at(const Value& v, int level) {
  if (level > kMaxValueDepth)
    template_fail("repr: a value nested more than ", kMaxValueDepth, " levels deep (the template limit)");
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return "Undefined";
    case Value::Kind::None:
      return "None";
    case Value::Kind::Bool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::Int:
      return std::to_string(v.as_int());
    case Value::Kind::Float:
      return float_repr(v.as_float());
    case Value::Kind::String:
      return string_repr(v.as_string());
    case Value::Kind::List:
      return "[" + join_repr(v.items(), level + 1) + "]";
    case Value::Kind::Tuple:
      return "(" + join_repr(v.items(), level + 1) + (v.items().size() == 1 ? ",)" : ")");
    case Value::Kind::Dict:
      return dict_repr(v.as_dict(), level + 1);
    case Value::Kind::Object: {
      const Object& o = v.as_object();
      if (o.type_name == "LoopContext")  // jinja2's LoopContext.__repr__
        return "<LoopContext " + to_str(*o.attributes.find(std::string("index"))) + "/" +
               to_str(*o.attributes.find(std::string("length"))) + ">";
      return "<" + o.type_name + " " + dict_repr(o.attributes, level + 1) + ">";
    }
    case Value::Kind::Function:
      return "<function " + v.as_function().name + ">";
  }
  return "";
}

}  // namespace

std::string repr(const Value& v) { return repr_at(v, 0); }

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return "Undefined";
    case Value::Kind::None:
      return "NoneType";
    case Value::Kind::Bool:
      return "bool";
    case Value::Kind::Int:
      return "int";
    case Value::Kind::Float:
      return "float";
    case Value::Kind::String:
      return "str";
    case Value::Kind::List:
      return "list";
    case Value::Kind::Tuple:
      return "tuple";
    case Value::Kind::Dict:
      return "dict";
    case Value::Kind::Object:
      return v.as_object().type_name;
    case Value::Kind::Function:
      return "function";
  }
  return "";
}

bool equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::Float && b.kind() != K::Float) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::Undefined:
    case K::None:
      return true;
    case K::String:
      return a.as_string() == b.as_string();
    case K::List:
    case K::Tuple: {
      const ValueList &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case K::Dict: {
      const Dict &x = a.as_dict(), &y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [key, value] : x.entries()) {
        const Value* other = y.find(key);
        if (!other || !equals(value, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

bool less_than(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::Float && b.kind() != K::Float) return a.as_int() < b.as_int();
    return a.as_float() < b.as_float();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // UTF-8 order = code point order
  if (a.kind() == b.kind() && a.is_sequence()) {
    const ValueList &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return less_than(x[i], y[i]);
    return x.size() < y.size();
  }
  template_fail("'<' not supported between instances of '", type_name(a), "' and '", type_name(b), "'");
}

Value length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return 0;
    case Value::Kind::String:
      return static_cast<int64_t>(utf8_length(v.as_string()));
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return static_cast<int64_t>(v.items().size());
    case Value::Kind::Dict:
      return static_cast<int64_t>(v.as_dict().size());
    default:
      template_fail("object of type '", type_name(v), "' has no len()");
  }
}

ValueList iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return {};
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return v.items();
    case Value::Kind::Dict: {
      ValueList keys;
      for (const auto& entry : v.as_dict().entries()) keys.push_back(entry.first);
      return keys;
    }
    case Value::Kind::String: {
      check_list_size(int64_t(utf8_length(v.as_string())));  // a 32 MiB message would take 1.5 GiB
      ValueList chars;
      for (char32_t c : utf8_decode(v.as_string())) chars.emplace_back(utf8_encode(std::u32string(1, c)));
      return chars;
    }
    default:
      template_fail("'", type_name(v), "' object is not iterable");
  }
}

bool contains(const Value& haystack, const Value& needle) {
  switch (haystack.kind()) {
    case Value::Kind::String:
      if (!needle.is_string()) template_fail("'in <string>' requires string as left operand, not ", type_name(needle));
      return haystack.as_string().find(needle.as_string()) != std::string::npos;
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return std::any_of(haystack.items().begin(), haystack.items().end(),
                         [&](const Value& item) { return equals(item, needle); });
    case Value::Kind::Dict:
      return haystack.as_dict().find(needle) != nullptr;
    case Value::Kind::Undefined:
      return false;  // jinja2's Undefined iterates as empty
    default:
      template_fail("argument of type '", type_name(haystack), "' is not iterable");
  }
}

namespace {

// json.dumps turns dict keys into strings this way (json.encoder's _make_iterencode).
std::string json_key(const Value& key) {
  switch (key.kind()) {
    case Value::Kind::String:
      return key.as_string();
    case Value::Kind::Bool:
      return key.as_bool() ? "true" : "false";
    case Value::Kind::None:
      return "null";
    case Value::Kind::Int:
      return std::to_string(key.as_int());
    case Value::Kind::Float:
      return float_repr(key.as_float());
    default:
      template_fail("keys must be str, int, float, bool or None, not ", type_name(key));
  }
}

void dump(std::string& out, const Value& v, const JsonOptions& o, const std::string& item_separator, int depth) {
  auto newline = [&](int level) {
    check_string_size(int64_t(out.size()));  // a wide indent multiplies the text
    if (!o.indent) return;
    check_string_size(int64_t(out.size() + 1 + level * o.indent->size()));
    out += '\n';
    for (int i = 0; i < level; ++i) out += *o.indent;
  };
  switch (v.kind()) {
    case Value::Kind::None:
      out += "null";
      return;
    case Value::Kind::Bool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::Int:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::Float: {
      double x = v.as_float();
      out += std::isnan(x) ? "NaN" : std::isinf(x) ? (x > 0 ? "Infinity" : "-Infinity") : float_repr(x);
      return;
    }
    case Value::Kind::String:
      json_quote(out, v.as_string(), o.ensure_ascii);
      return;
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      const ValueList& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_separator;
        newline(depth + 1);
        dump(out, items[i], o, item_separator, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::Dict: {
      std::vector<const Dict::Entry*> entries;
      for (const auto& entry : v.as_dict().entries()) entries.push_back(&entry);
      if (entries.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(),
                         [](const Dict::Entry* a, const Dict::Entry* b) { return less_than(a->first, b->first); });
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_separator;
        newline(depth + 1);
        json_quote(out, json_key(entries[i]->first), o.ensure_ascii);
        out += o.key_separator;
        dump(out, entries[i]->second, o, item_separator, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      template_fail("Object of type ", type_name(v), " is not JSON serializable");
  }
}

}  // namespace

std::string json_dumps(const Value& v, const JsonOptions& options) {
  std::string item_separator = options.item_separator.value_or(options.indent ? "," : ", ");
  std::string out;
  dump(out, v, options, item_separator, 0);
  return out;
}

}  // namespace sparrow::jinja
