// jinja2's builtin filters (jinja2/filters.py) with autoescape off, plus transformers' own tojson
// (json.dumps with ensure_ascii=False by default). Each follows the Python function it is named
// after, including how it treats undefined input and its argument names.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "template/jinja_builtins.h"
#include "template/jinja_limits.h"
#include "template/py_text.h"
#include "template/unicode.h"

namespace sparrow::jinja {
namespace {

ValueList bind(const Args& args, const char* filter, const std::vector<Param>& params) {
  return bind_args(args, std::string("filter '") + filter + "'", params);
}

// Python's str.lower() on strings, other values unchanged: the sort key when case_sensitive=False.
Value ignore_case(const Value& v) { return v.is_string() ? Value(lower(v.as_string())) : v; }

// jinja2's make_attrgetter: item.a.b via getitem for each dotted part (digits index sequences).
Value attribute_of(const Value& item, const Value& attribute) {
  if (attribute.is_none()) return item;
  if (attribute.kind() == Value::Kind::Int) return get_item(item, attribute);
  Value v = item;
  for (const std::string& part : split(to_str(attribute), std::string("."), -1)) {
    auto index = parse_int(part, 10);
    v = get_item(
        v, index && !part.empty() && std::isdigit(static_cast<unsigned char>(part[0])) ? Value(*index) : Value(part));
  }
  return v;
}

ValueList sorted(ValueList items, bool reverse, bool case_sensitive, const Value& attribute) {
  auto key = [&](const Value& v) {
    Value k = attribute_of(v, attribute);
    return case_sensitive ? k : ignore_case(k);
  };
  std::vector<std::pair<Value, Value>> keyed;
  for (Value& item : items) keyed.emplace_back(key(item), std::move(item));
  // Python's sorted(reverse=True) keeps equal items in their original order too.
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? less_than(b.first, a.first) : less_than(a.first, b.first);
  });
  ValueList out;
  for (auto& [k, v] : keyed) out.push_back(std::move(v));
  return out;
}

Value do_tojson(const Value& input, const Args& args) {
  ValueList p =
      bind(args, "tojson",
           {optional("ensure_ascii", false), optional("indent"), optional("separators"), optional("sort_keys", false)});
  JsonOptions options;
  options.ensure_ascii = truthy(p[0]);
  if (p[1].is_string()) {
    options.indent = p[1].as_string();
  } else if (!p[1].is_none()) {
    check_string_size(p[1].as_int());
    options.indent = std::string(std::max<int64_t>(0, p[1].as_int()), ' ');
  }
  if (!p[2].is_none()) {
    ValueList seps = iterate(p[2]);
    if (seps.size() != 2 || !seps[0].is_string() || !seps[1].is_string())
      template_fail("tojson: separators must be an (item_separator, key_separator) pair of strings");
    options.item_separator = seps[0].as_string();
    options.key_separator = seps[1].as_string();
  }
  options.sort_keys = truthy(p[3]);
  return json_dumps(input, options);
}

Value do_default(const Value& input, const Args& args) {
  ValueList p = bind(args, "default", {optional("default_value", ""), optional("boolean", false)});
  if (input.is_undefined() || (truthy(p[1]) && !truthy(input))) return p[0];
  return input;
}

Value do_length(const Value& input, const Args& args) {
  bind(args, "length", {});
  return length(input);
}

Value do_string(const Value& input, const Args& args) {
  bind(args, "string", {});
  return to_str(input);
}

Value do_trim(const Value& input, const Args& args) {
  ValueList p = bind(args, "trim", {optional("chars")});
  std::optional<std::string> chars;
  if (!p[0].is_none()) chars = to_str(p[0]);
  return strip(to_str(input), chars, true, true);
}

Value do_replace(const Value& input, const Args& args) {
  ValueList p = bind(args, "replace", {required("old"), required("new"), optional("count")});
  int64_t n = p[2].is_none() ? -1 : p[2].as_int();
  return jinja::replace(to_str(input), to_str(p[0]), to_str(p[1]), n);
}

Value do_join(const Value& input, const Args& args) {
  ValueList p = bind(args, "join", {optional("d", ""), optional("attribute")});
  std::string out, separator = to_str(p[0]);
  ValueList items = iterate(input);
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += separator;
    out += to_str(attribute_of(items[i], p[1]));
    check_string_size(int64_t(out.size()));
  }
  return out;
}

Value do_items(const Value& input, const Args& args) {
  bind(args, "items", {});
  if (input.is_undefined()) return Value::list({});
  if (input.kind() != Value::Kind::Dict) template_fail("Can only get item pairs from a mapping.");
  ValueList pairs;
  for (const auto& [k, v] : input.as_dict().entries()) pairs.push_back(Value::tuple({k, v}));
  return Value::list(std::move(pairs));
}

Value do_dictsort(const Value& input, const Args& args) {
  ValueList p =
      bind(args, "dictsort", {optional("case_sensitive", false), optional("by", "key"), optional("reverse", false)});
  if (input.is_undefined()) input.fail_undefined();
  if (input.kind() != Value::Kind::Dict) template_fail("dictsort needs a mapping, not ", type_name(input));
  std::string by = to_str(p[1]);
  if (by != "key" && by != "value") template_fail("You can only sort by either \"key\" or \"value\"");
  ValueList pairs = do_items(input, {}).items();
  return Value::list(sorted(std::move(pairs), truthy(p[2]), truthy(p[0]), Value(by == "key" ? 0 : 1)));
}

Value do_sort(const Value& input, const Args& args) {
  ValueList p =
      bind(args, "sort", {optional("reverse", false), optional("case_sensitive", false), optional("attribute")});
  return Value::list(sorted(iterate(input), truthy(p[0]), truthy(p[1]), p[2]));
}

// String keys (the usual ones) are looked up in a hash set, so a request's list of a million items
// takes linear time; other keys are compared one by one, as Python's == would.
Value do_unique(const Value& input, const Args& args) {
  ValueList p = bind(args, "unique", {optional("case_sensitive", false), optional("attribute")});
  std::unordered_set<std::string> seen_strings;
  ValueList seen_others, out;
  for (const Value& item : iterate(input)) {
    Value key = attribute_of(item, p[1]);
    if (!truthy(p[0])) key = ignore_case(key);
    bool first = key.is_string() ? seen_strings.insert(key.as_string()).second
                                 : std::none_of(seen_others.begin(), seen_others.end(),
                                                [&](const Value& s) { return equals(s, key); });
    if (!first) continue;
    if (!key.is_string()) seen_others.push_back(key);
    out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value min_or_max(const Value& input, const Args& args, bool want_max) {
  const char* name = want_max ? "max" : "min";
  ValueList p = bind(args, name, {optional("case_sensitive", false), optional("attribute")});
  ValueList items = iterate(input);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& v) {
    Value k = attribute_of(v, p[1]);
    return truthy(p[0]) ? k : ignore_case(k);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    bool better = want_max ? less_than(key(items[best]), key(items[i])) : less_than(key(items[i]), key(items[best]));
    if (better) best = i;
  }
  return items[best];
}

Value do_first(const Value& input, const Args& args) {
  bind(args, "first", {});
  ValueList items = iterate(input);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value do_last(const Value& input, const Args& args) {
  bind(args, "last", {});
  ValueList items = iterate(input);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value do_reverse(const Value& input, const Args& args) {
  bind(args, "reverse", {});
  if (input.is_string()) {
    std::u32string text = utf8_decode(input.as_string());
    std::reverse(text.begin(), text.end());
    return utf8_encode(text);
  }
  ValueList items = iterate(input);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

// int() of a float: Python's ints are unbounded, ours are int64, so a float past that range is an error
// rather than undefined behaviour.
int64_t whole_part(double x) {
  double whole = std::trunc(x);
  if (!(std::fabs(whole) < 9.2e18)) template_fail("int: ", float_repr(whole), " is too large for a 64-bit integer");
  return static_cast<int64_t>(whole);
}

Value do_int(const Value& input, const Args& args) {
  ValueList p = bind(args, "int", {optional("default", 0), optional("base", 10)});
  switch (input.kind()) {
    case Value::Kind::Undefined:
      input.fail_undefined();
    case Value::Kind::Int:
    case Value::Kind::Bool:
      return input.as_int();
    case Value::Kind::Float: {
      double x = input.as_float();
      if (!std::isfinite(x)) return p[0];
      return whole_part(x);
    }
    case Value::Kind::String: {
      if (auto i = parse_int(input.as_string(), static_cast<int>(p[1].as_int()))) return *i;
      // jinja2: "42.23"|int gives 42 through float().
      if (auto f = parse_float(input.as_string()); f && std::isfinite(*f)) return whole_part(*f);
      return p[0];
    }
    default:
      return p[0];
  }
}

Value do_float(const Value& input, const Args& args) {
  ValueList p = bind(args, "float", {optional("default", 0.0)});
  switch (input.kind()) {
    case Value::Kind::Undefined:
      input.fail_undefined();
    case Value::Kind::Int:
    case Value::Kind::Bool:
    case Value::Kind::Float:
      return input.as_float();
    case Value::Kind::String:
      if (auto f = parse_float(input.as_string())) return *f;
      return p[0];
    default:
      return p[0];
  }
}

Value do_abs(const Value& input, const Args& args) {
  bind(args, "abs", {});
  if (input.kind() == Value::Kind::Float) return std::fabs(input.as_float());
  if (input.kind() == Value::Kind::Int || input.kind() == Value::Kind::Bool) return std::abs(input.as_int());
  if (input.is_undefined()) input.fail_undefined();
  template_fail("bad operand type for abs(): '", type_name(input), "'");
}

// Python's round(x, n) on the exact binary value, ties to even; printf rounds the same way.
double python_round(double x, int64_t digits) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::clamp<int64_t>(digits, 0, 300)), x);
  return std::strtod(buf, nullptr);
}

Value do_round(const Value& input, const Args& args) {
  ValueList p = bind(args, "round", {optional("precision", 0), optional("method", "common")});
  if (!input.is_number()) {
    if (input.is_undefined()) input.fail_undefined();
    template_fail("round needs a number, not ", type_name(input));
  }
  std::string method = to_str(p[1]);
  int64_t precision = p[0].as_int();
  double x = input.as_float();
  if (method == "common" && input.kind() != Value::Kind::Float && precision >= 0)
    return input.as_int();  // round(int) is an int
  if (method == "common") {
    if (precision < 0) template_fail("round: negative precision is not supported");
    return python_round(x, precision);
  }
  if (method != "ceil" && method != "floor") template_fail("method must be common, ceil or floor");
  double scale = std::pow(10.0, static_cast<double>(precision));
  return (method == "ceil" ? std::ceil(x * scale) : std::floor(x * scale)) / scale;
}

Value do_sum(const Value& input, const Args& args) {
  ValueList p = bind(args, "sum", {optional("attribute"), optional("start", 0)});
  Value total = p[1];
  for (const Value& item : iterate(input)) {
    Value v = attribute_of(item, p[0]);
    if (!total.is_number() || !v.is_number())
      template_fail("unsupported operand type(s) for +: '", type_name(total), "' and '", type_name(v), "'");
    if (total.kind() == Value::Kind::Float || v.kind() == Value::Kind::Float)
      total = total.as_float() + v.as_float();
    else
      total = total.as_int() + v.as_int();
  }
  return total;
}

Value do_list(const Value& input, const Args& args) {
  bind(args, "list", {});
  return Value::list(iterate(input));
}

Value do_escape(const Value& input, const Args& args) {
  bind(args, "escape", {});
  std::string out;
  for (char c : to_str(input)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// jinja2's indent: every line but the first (unless first=True) gets `width` spaces (or the text
// given as width); blank lines stay empty unless blank=True.
Value do_indent(const Value& input, const Args& args) {
  ValueList p = bind(args, "indent", {optional("width", 4), optional("first", false), optional("blank", false)});
  if (!p[0].is_string()) check_string_size(p[0].as_int());
  std::string indention = p[0].is_string() ? p[0].as_string() : std::string(std::max<int64_t>(0, p[0].as_int()), ' ');
  if (input.is_undefined()) input.fail_undefined();
  if (!input.is_string()) template_fail("unsupported operand type(s) for +=: '", type_name(input), "' and 'str'");
  std::vector<std::string> lines = splitlines(input.as_string() + "\n", false);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += "\n";
    bool indent_line = i > 0 && (truthy(p[2]) || !lines[i].empty());
    out += (indent_line ? indention : "") + lines[i];
    check_string_size(int64_t(out.size()));
  }
  if (truthy(p[1])) out = indention + out;
  return out;
}

Value do_center(const Value& input, const Args& args) {
  ValueList p = bind(args, "center", {optional("width", 80)});
  return pad(to_str(input), p[0].as_int(), " ", '^');
}

// jinja2's title filter: capitalise the start of each word, words split at whitespace - ( { [ <.
Value do_title(const Value& input, const Args& args) {
  bind(args, "title", {});
  std::u32string text = utf8_decode(to_str(input));
  std::string out;
  bool word_start = true;
  for (char32_t c : text) {
    bool separator = is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    std::string one = utf8_encode(std::u32string(1, c));
    out += separator ? one : word_start ? upper(one) : lower(one);  // Python's item[0].upper() + item[1:].lower()
    word_start = separator;
  }
  return out;
}

Value do_wordcount(const Value& input, const Args& args) {
  bind(args, "wordcount", {});
  int64_t words = 0;
  bool in_word = false;
  for (char32_t c : utf8_decode(to_str(input))) {
    bool word_char = is_alpha(c) || is_digit(c) || c == '_';
    words += word_char && !in_word;
    in_word = word_char;
  }
  return words;
}

Value do_truncate(const Value& input, const Args& args) {
  ValueList p =
      bind(args, "truncate",
           {optional("length", 255), optional("killwords", false), optional("end", "..."), optional("leeway")});
  int64_t limit = p[0].as_int(), leeway = p[3].is_none() ? 5 : p[3].as_int();
  if (length(input).as_int() <= limit + leeway) return input;  // anything with a len() short enough comes back as is
  if (!input.is_string()) template_fail("truncate needs a string, not ", type_name(input));
  std::u32string s = utf8_decode(input.as_string());
  std::u32string end = utf8_decode(to_str(p[2]));
  size_t keep = static_cast<size_t>(std::max<int64_t>(0, limit - static_cast<int64_t>(end.size())));
  std::string head = utf8_encode(s.substr(0, keep));
  if (truthy(p[1])) return head + utf8_encode(end);
  return rsplit(head, std::string(" "), 1)[0] + utf8_encode(end);
}

Value do_batch(const Value& input, const Args& args) {
  ValueList p = bind(args, "batch", {required("linecount"), optional("fill_with")});
  int64_t size = p[0].as_int();
  if (size <= 0) template_fail("batch: linecount must be positive");
  ValueList rows, row;
  for (const Value& item : iterate(input)) {
    row.push_back(item);
    if (static_cast<int64_t>(row.size()) == size) rows.push_back(Value::list(std::exchange(row, {})));
  }
  if (!row.empty()) {
    if (!p[1].is_none()) check_list_size(size);
    if (!p[1].is_none())
      while (static_cast<int64_t>(row.size()) < size) row.push_back(p[1]);
    rows.push_back(Value::list(std::move(row)));
  }
  return Value::list(std::move(rows));
}

Value do_format(const Value& input, const Args& args) {
  if (!args.positional.empty() && !args.keyword.empty())
    template_fail("can't handle positional and keyword arguments at the same time");
  if (!args.keyword.empty()) {
    Dict named;
    for (const auto& [k, v] : args.keyword) named.set(Value(k), v);
    return percent_format(to_str(input), Value::dict(std::move(named)));
  }
  return percent_format(to_str(input), Value::tuple(args.positional));
}

Value do_attr(const Value& input, const Args& args) {
  ValueList p = bind(args, "attr", {required("name")});
  if (input.is_undefined()) input.fail_undefined();
  // Only real attributes: a dict's keys are not attributes (jinja2 calls getattr, not getitem).
  std::string name = to_str(p[0]);
  if (input.kind() == Value::Kind::Dict && !find_method(input, name))
    return Value::undefined(cat("'dict object' has no attribute '", name, "'"));
  return get_attribute(input, name);
}

// map(attribute='x', default=...) or map('filter', args...).
Value do_map(const Value& input, const Args& args) {
  ValueList out;
  if (!truthy(input)) return Value::list({});  // jinja2 iterates only `if value`
  const Value* attribute = nullptr;
  const Value* fallback = nullptr;
  for (const auto& [k, v] : args.keyword) {
    if (k == "attribute")
      attribute = &v;
    else if (k == "default")
      fallback = &v;
  }
  if (attribute) {
    for (const Value& item : iterate(input)) {
      Value v = attribute_of(item, *attribute);
      out.push_back(v.is_undefined() && fallback ? *fallback : v);
    }
    return Value::list(std::move(out));
  }
  if (args.positional.empty()) template_fail("map requires a filter argument");
  std::string name = to_str(args.positional[0]);
  FilterFunction filter = find_filter(name);
  if (!filter) template_fail("unknown filter '", name, "'");
  Args rest{ValueList(args.positional.begin() + 1, args.positional.end()), args.keyword};
  for (const Value& item : iterate(input)) out.push_back(filter(item, rest));
  return Value::list(std::move(out));
}

// select / reject / selectattr / rejectattr: keep the items whose test (or truthiness) is `keep`.
Value select_items(const Value& input, const Args& args, bool by_attribute, bool keep, const char* name) {
  size_t next = 0;
  Value attribute = Value::none();
  if (by_attribute) {
    if (args.positional.empty()) template_fail(name, " needs an attribute name");
    attribute = args.positional[next++];
  }
  TestFunction test = nullptr;
  if (next < args.positional.size()) {
    std::string test_name = to_str(args.positional[next++]);
    test = find_test(test_name);
    if (!test) template_fail("unknown test '", test_name, "'");
  }
  Args test_args{ValueList(args.positional.begin() + next, args.positional.end()), args.keyword};
  ValueList out;
  if (!truthy(input)) return Value::list({});  // jinja2 iterates only `if value`
  for (const Value& item : iterate(input)) {
    Value v = attribute_of(item, attribute);
    bool passed = test ? test(v, test_args) : truthy(v);
    if (passed == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

const std::unordered_map<std::string, FilterFunction>& filters() {
  static const std::unordered_map<std::string, FilterFunction> table = {
      {"tojson", do_tojson},
      {"default", do_default},
      {"d", do_default},
      {"length", do_length},
      {"count", do_length},
      {"string", do_string},
      {"trim", do_trim},
      {"replace", do_replace},
      {"join", do_join},
      {"items", do_items},
      {"dictsort", do_dictsort},
      {"sort", do_sort},
      {"unique", do_unique},
      {"min", [](const Value& v, const Args& a) { return min_or_max(v, a, false); }},
      {"max", [](const Value& v, const Args& a) { return min_or_max(v, a, true); }},
      {"first", do_first},
      {"last", do_last},
      {"reverse", do_reverse},
      {"int", do_int},
      {"float", do_float},
      {"abs", do_abs},
      {"round", do_round},
      {"sum", do_sum},
      {"list", do_list},
      {"lower",
       [](const Value& v, const Args& a) {
         bind(a, "lower", {});
         return Value(lower(to_str(v)));
       }},
      {"upper",
       [](const Value& v, const Args& a) {
         bind(a, "upper", {});
         return Value(upper(to_str(v)));
       }},
      {"capitalize",
       [](const Value& v, const Args& a) {
         bind(a, "capitalize", {});
         return Value(capitalize(to_str(v)));
       }},
      {"title", do_title},
      {"safe",
       [](const Value& v, const Args& a) {
         bind(a, "safe", {});
         return Value(to_str(v));
       }},
      {"escape", do_escape},
      {"e", do_escape},
      {"forceescape", do_escape},
      {"indent", do_indent},
      {"center", do_center},
      {"wordcount", do_wordcount},
      {"truncate", do_truncate},
      {"batch", do_batch},
      {"format", do_format},
      {"attr", do_attr},
      {"map", do_map},
      {"select", [](const Value& v, const Args& a) { return select_items(v, a, false, true, "select"); }},
      {"reject", [](const Value& v, const Args& a) { return select_items(v, a, false, false, "reject"); }},
      {"selectattr", [](const Value& v, const Args& a) { return select_items(v, a, true, true, "selectattr"); }},
      {"rejectattr", [](const Value& v, const Args& a) { return select_items(v, a, true, false, "rejectattr"); }},
  };
  return table;
}

// One "%" conversion of Python's printf-style formatting.
// snprintf into a string of the size it needs (widths and precisions are at most kMaxStringBytes).
template <typename Number>
std::string printf_string(const std::string& spec, Number value) {
  int size = std::snprintf(nullptr, 0, spec.c_str(), value);
  if (size < 0) template_fail("format: cannot format with '", spec, "'");
  check_string_size(size);
  std::string out(size_t(size) + 1, '\0');
  std::snprintf(out.data(), out.size(), spec.c_str(), value);
  out.resize(size_t(size));
  return out;
}

std::string format_one(char conversion, const std::string& flags, int64_t width, int64_t precision, const Value& v) {
  auto pad_to_width = [&](std::string s) {
    int64_t missing = width - static_cast<int64_t>(utf8_length(s));
    if (missing <= 0) return s;
    return flags.find('-') != std::string::npos ? s + std::string(missing, ' ') : std::string(missing, ' ') + s;
  };
  switch (conversion) {
    case 's':
      return pad_to_width(to_str(v));
    case 'r':
    case 'a':
      return pad_to_width(repr(v));
    default:
      break;
  }
  if (!v.is_number()) template_fail("%", conversion, " format: a real number is required, not ", type_name(v));
  std::string spec =
      "%" + flags + (width > 0 ? std::to_string(width) : "") + (precision >= 0 ? "." + std::to_string(precision) : "");
  switch (conversion) {
    case 'd':
    case 'i':
    case 'u': {
      if (v.kind() != Value::Kind::Float) return printf_string(spec + "lld", static_cast<long long>(v.as_int()));
      return printf_string(spec + "lld", static_cast<long long>(whole_part(v.as_float())));
    }
    case 'x':
    case 'X':
    case 'o':
      if (v.kind() == Value::Kind::Float) template_fail("%", conversion, " format: an integer is required, not float");
      return printf_string(spec + "ll" + conversion, static_cast<long long>(v.as_int()));
    case 'f':
    case 'F':
    case 'e':
    case 'E':
    case 'g':
    case 'G':
      return printf_string(spec + conversion, v.as_float());
    default:
      template_fail("unsupported format character '", conversion, "'");
  }
}

}  // namespace

FilterFunction find_filter(const std::string& name) {
  auto it = filters().find(name);
  return it == filters().end() ? nullptr : it->second;
}

std::string percent_format(const std::string& format, const Value& args) {
  ValueList positional = args.kind() == Value::Kind::Tuple ? args.items() : ValueList{args};
  bool named = args.kind() == Value::Kind::Dict;
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out += format[i];
      continue;
    }
    if (++i >= format.size()) template_fail("incomplete format");
    const Value* value = nullptr;
    if (format[i] == '(') {
      size_t close = format.find(')', i);
      if (close == std::string::npos || !named) template_fail("format requires a mapping");
      value = args.as_dict().find(format.substr(i + 1, close - i - 1));
      if (!value) template_fail("KeyError: '", format.substr(i + 1, close - i - 1), "'");
      i = close + 1;
    }
    std::string flags;
    while (i < format.size() && std::string_view("-+ #0").find(format[i]) != std::string_view::npos)
      flags += format[i++];
    // A width or precision is at most what the longest string may hold (checked digit by digit, so
    // neither overflows).
    int64_t width = 0, precision = -1;
    while (i < format.size() && std::isdigit(static_cast<unsigned char>(format[i]))) {
      width = width * 10 + (format[i++] - '0');
      check_string_size(width);
    }
    if (i < format.size() && format[i] == '.') {
      precision = 0;
      while (++i < format.size() && std::isdigit(static_cast<unsigned char>(format[i]))) {
        precision = precision * 10 + (format[i] - '0');
        check_string_size(precision);
      }
    }
    if (i >= format.size()) template_fail("incomplete format");
    char conversion = format[i];
    if (conversion == '%') {
      out += '%';
      continue;
    }
    if (!value) {
      if (named)
        value = &args;
      else if (next < positional.size())
        value = &positional[next++];
      else
        template_fail("not enough arguments for format string");
    }
    out += format_one(conversion, flags, width, precision, *value);
    check_string_size(int64_t(out.size()));  // '%(a)s%(a)s...' repeats one argument
  }
  if (!named && next < positional.size()) template_fail("not all arguments converted during string formatting");
  return out;
}

}  // namespace sparrow::jinja
