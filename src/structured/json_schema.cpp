// JSON Schema -> grammar, the subset vLLM's xgrammar backend accepts (xgrammar's
// json_schema_converter; vLLM calls it with any_whitespace = !disable_any_whitespace and xgrammar's
// default strict_mode = true). What each keyword becomes:
//   type (a name or a list of names: a choice), enum and const (the values' compact JSON text),
//   anyOf / oneOf (a choice: oneOf's "exactly one" is not checked), allOf with one member,
//   $ref to "#", "#/$defs/..." and "#/definitions/..." (any JSON pointer into the document; recursion
//   allowed: each target is one rule);
//   objects: properties in the schema's order, `required` ones present, optional ones may be left out;
//     additionalProperties absent or false: no other properties (xgrammar's strict_mode, vLLM's
//     default), true or a schema: more properties after the listed ones; minProperties / maxProperties
//     ignored;
//   arrays: items, prefixItems, minItems / maxItems (a maxItems above kMaxRepetition is unbounded,
//     a larger minItems refused);
//   strings: minLength / maxLength (the same limits), pattern (a regex, front_ends.h, matched against
//     the whole string, as xgrammar does; characters JSON must escape are left out of its classes),
//     format date, time, date-time, uuid, email, ipv4 (other formats are ignored: any string);
//   integer: JSON's integer syntax within minimum / maximum / exclusiveMinimum / exclusiveMaximum (either
//     form: a number, or draft 4's boolean beside minimum / maximum), digit by digit as xgrammar's
//     GenerateRangeRegex bounds them (integer_range below); bounds beyond +-9e18 count as open;
//   number: JSON's number syntax; with minimum / maximum / exclusiveMinimum / exclusiveMaximum (either form),
//     a plain decimal (no exponent) within them, compared digit by digit with the bounds' shortest decimal
//     forms (bounded_number below); bounds beyond +-9e18 count as open; multipleOf is not enforced.
// Refused (they would need the output checked beyond a grammar): not, if / then / else,
// patternProperties, dependentRequired, dependentSchemas, propertyNames, contains, $dynamicRef, a
// `false` schema, allOf with several members. Annotations (title, description, default, examples, ...)
// and other unknown keywords are ignored.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <unordered_map>

#include "core/error.h"
#include "core/json_input.h"
#include "structured/front_ends.h"

namespace sparrow::structured {
namespace {

using Json = nlohmann::ordered_json;
using E = GrammarExpr;

E lit(std::string_view s) { return E::literal(s); }
E seq(std::vector<E> items) { return E::sequence(std::move(items)); }
E alt(std::vector<E> items) { return E::choice(std::move(items)); }
E opt(E e) { return E::repeat(std::move(e), 0, 1); }
E rule_ref(const std::string& name) { return E::ref(name); }

CharClass json_unescaped_class() {
  // RFC 8259: any character but '"', '\' and the controls U+0000..U+001F.
  CharClass c = CharClass::range(0x20, kMaxCodePoint);
  return c.minus(CharClass::of('"')).minus(CharClass::of('\\'));
}

E json_char() {
  CharClass hex = CharClass::range('0', '9');
  hex.add('a', 'f');
  hex.add('A', 'F');
  CharClass simple_escape;
  for (char c : std::string("\"\\/bfnrt")) simple_escape.add(uint32_t(uint8_t(c)), uint32_t(uint8_t(c)));
  return alt({E::chars_of(json_unescaped_class()),
              seq({lit("\\"), alt({E::chars_of(simple_escape), seq({lit("u"), E::repeat(E::chars_of(hex), 4, 4)})})})});
}

const char* format_regex(const std::string& format) {
  if (format == "date") return R"([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]))";
  if (format == "time") return R"(([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9]))";
  if (format == "date-time")
    return R"([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9]))";
  if (format == "uuid") return R"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})";
  if (format == "email") return R"([a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,63})";
  if (format == "ipv4") return R"(((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9]))";
  return nullptr;
}

// Keeps a pattern's output inside a JSON string without escapes.
void restrict_to_json_string(E& e) {
  if (e.kind == E::Kind::Chars) e.chars = e.chars.minus(json_unescaped_class().complement());
  for (E& item : e.items) restrict_to_json_string(item);
}

class SchemaConverter {
 public:
  SchemaConverter(const Json& root, const JsonSchemaOptions& options) : root_(root), options_(options) {}

  Grammar convert() {
    rules_.push_back({"root", {}});
    rules_.push_back({"json_ws", options_.any_whitespace
                                     ? E::repeat(E::chars_of(whitespace()), 0, kMaxJsonWhitespace)
                                     : E::empty()});
    rules_[0].body = value(root_, "root", 0);
    return lower_rules(rules_);
  }

  Grammar convert_any_object() {
    rules_.push_back({"root", {}});
    rules_.push_back({"json_ws", options_.any_whitespace
                                     ? E::repeat(E::chars_of(whitespace()), 0, kMaxJsonWhitespace)
                                     : E::empty()});
    any_value();
    rules_[0].body = rule_ref("json_object");
    return lower_rules(rules_);
  }

 private:
  static CharClass whitespace() {
    CharClass c = CharClass::of(' ');
    c.add('\n', '\n');
    c.add('\t', '\t');
    return c;
  }
  E ws() { return rule_ref("json_ws"); }
  E comma() { return options_.any_whitespace ? seq({ws(), lit(","), ws()}) : lit(", "); }
  E colon() { return options_.any_whitespace ? seq({ws(), lit(":"), ws()}) : lit(": "); }
  E open(const char* c) { return options_.any_whitespace ? seq({lit(c), ws()}) : lit(c); }
  E close(const char* c) { return options_.any_whitespace ? seq({ws(), lit(c)}) : lit(c); }

  [[noreturn]] static void error(const std::string& path, const std::string& message) {
    fail("json schema: at ", path, ": ", message);
  }

  // The generic rules for any JSON value (added once).
  void any_value() {
    if (have_any_) return;
    have_any_ = true;
    rules_.push_back({"json_string", seq({lit("\""), E::repeat(json_char(), 0, -1), lit("\"")})});
    rules_.push_back({"json_number", number(false)});
    E member = seq({rule_ref("json_string"), colon(), rule_ref("json_value")});
    rules_.push_back({"json_object", seq({open("{"), opt(seq({member, E::repeat(seq({comma(), member}), 0, -1)})), close("}")})});
    rules_.push_back({"json_array", seq({open("["), opt(seq({rule_ref("json_value"), E::repeat(seq({comma(), rule_ref("json_value")}), 0, -1)})),
                                         close("]")})});
    rules_.push_back({"json_value", alt({rule_ref("json_object"), rule_ref("json_array"), rule_ref("json_string"), rule_ref("json_number"),
                                         lit("true"), lit("false"), lit("null")})});
  }

  // Decimal digit strings of one length, as grammars (integer_range's pieces): any digits; those >= s;
  // those <= s; those in [x, y] (x <= y, both of y's length).
  static E any_digits(size_t n) {
    return E::repeat(E::chars_of(CharClass::range('0', '9')), int64_t(n), int64_t(n));
  }
  static E at_least(std::string_view s) {
    if (s.empty()) return E::empty();
    std::vector<E> ways = {seq({lit(s.substr(0, 1)), at_least(s.substr(1))})};
    if (s[0] < '9') ways.push_back(seq({E::chars_of(CharClass::range(char(s[0] + 1), '9')), any_digits(s.size() - 1)}));
    return alt(std::move(ways));
  }
  static E at_most(std::string_view s) {
    if (s.empty()) return E::empty();
    std::vector<E> ways = {seq({lit(s.substr(0, 1)), at_most(s.substr(1))})};
    if (s[0] > '0') ways.push_back(seq({E::chars_of(CharClass::range('0', char(s[0] - 1))), any_digits(s.size() - 1)}));
    return alt(std::move(ways));
  }
  static E between(std::string_view x, std::string_view y) {
    if (x.empty()) return E::empty();
    if (x[0] == y[0]) return seq({lit(x.substr(0, 1)), between(x.substr(1), y.substr(1))});
    std::vector<E> ways = {seq({lit(x.substr(0, 1)), at_least(x.substr(1))})};
    if (x[0] + 1 <= y[0] - 1)
      ways.push_back(seq({E::chars_of(CharClass::range(char(x[0] + 1), char(y[0] - 1))), any_digits(x.size() - 1)}));
    ways.push_back(seq({lit(y.substr(0, 1)), at_most(y.substr(1))}));
    return alt(std::move(ways));
  }
  // Non-negative integers in [a, b] without leading zeros; b < 0: no upper bound.
  static E magnitudes(int64_t a, int64_t b) {
    const std::string lo = std::to_string(a);
    std::vector<E> ways;
    if (b < 0) {  // lo's length from lo up, then every longer number
      ways.push_back(lo.size() == 1 ? E::chars_of(CharClass::range(lo[0], '9')) : at_least(lo));
      ways.push_back(seq({E::chars_of(CharClass::range('1', '9')),
                          E::repeat(E::chars_of(CharClass::range('0', '9')), int64_t(lo.size()), -1)}));
      return alt(std::move(ways));
    }
    const std::string hi = std::to_string(b);
    for (size_t length = lo.size(); length <= hi.size(); ++length) {
      const std::string from = length == lo.size() ? lo : "1" + std::string(length - 1, '0');
      const std::string to = length == hi.size() ? hi : std::string(length, '9');
      ways.push_back(between(from, to));
    }
    return alt(std::move(ways));
  }
  // Integers in [lo, hi] as JSON writes them (no leading zeros, no "-0"); an open end is nullopt.
  static E integer_range(std::optional<int64_t> lo, std::optional<int64_t> hi, const std::string& path) {
    if (lo && hi && *lo > *hi) error(path, "no integer lies between its minimum and maximum");
    std::vector<E> ways;
    if (!lo || *lo < 0) {  // negatives: "-" and a magnitude in [max(1, -hi), -lo]
      const int64_t smallest = hi && *hi < 0 ? -*hi : 1;
      ways.push_back(seq({lit("-"), magnitudes(smallest, lo ? -*lo : -1)}));
    }
    if (!hi || *hi >= 0) ways.push_back(magnitudes(lo ? std::max<int64_t>(*lo, 0) : 0, hi ? *hi : -1));
    return alt(std::move(ways));
  }
  // An integer's bounds from minimum / maximum and their exclusive forms; beyond +-9e18: open.
  static E bounded_integer(const Json& schema, const std::string& path) {
    constexpr double kOpen = 9e18;
    std::optional<int64_t> lo, hi;
    auto bound = [&](const char* key, const char* exclusive_key, bool lower) {
      auto it = schema.find(key);
      if (it == schema.end()) return;
      if (!it->is_number()) error(path, std::string(key) + " must be a number");
      const double v = it->get<double>();
      if (std::abs(v) >= kOpen) return;
      // Draft 4: "exclusiveMinimum": true beside "minimum".
      auto ex = schema.find(exclusive_key);
      const bool exclusive = ex != schema.end() && ex->is_boolean() && ex->get<bool>();
      int64_t n = int64_t(lower ? std::ceil(v) : std::floor(v));
      if (exclusive && double(n) == v) n += lower ? 1 : -1;
      std::optional<int64_t>& slot = lower ? lo : hi;
      slot = slot ? (lower ? std::max(*slot, n) : std::min(*slot, n)) : n;
    };
    bound("minimum", "exclusiveMinimum", true);
    bound("maximum", "exclusiveMaximum", false);
    // Draft 6 and later: the exclusive bounds as numbers of their own.
    for (const auto& [key, lower] : {std::pair{"exclusiveMinimum", true}, std::pair{"exclusiveMaximum", false}}) {
      auto it = schema.find(key);
      if (it == schema.end() || it->is_boolean()) continue;
      if (!it->is_number()) error(path, std::string(key) + " must be a number or a boolean");
      const double v = it->get<double>();
      if (std::abs(v) >= kOpen) continue;
      int64_t n = int64_t(lower ? std::floor(v) + 1 : std::ceil(v) - 1);
      std::optional<int64_t>& slot = lower ? lo : hi;
      slot = slot ? (lower ? std::max(*slot, n) : std::min(*slot, n)) : n;
    }
    return integer_range(lo, hi, path);
  }

  // A bound of a number as decimal digits: its shortest round-trip form, split at the point (the fraction
  // without trailing zeros). Magnitudes from 9e18 on count as open, as for integers.
  struct Decimal {
    int64_t whole = 0;
    std::string fraction;
    bool exclusive = false;
  };
  static std::optional<Decimal> decimal(double magnitude, bool exclusive) {
    if (!(magnitude < 9e18)) return std::nullopt;
    // The fewest fraction digits that read back as the same double: 0.1 is "0.1", not its binary expansion.
    char text[80];
    for (int digits = 0; digits <= 40; ++digits) {
      std::snprintf(text, sizeof text, "%.*f", digits, magnitude);
      if (std::strtod(text, nullptr) == magnitude) break;
    }
    const std::string fixed = text;
    const size_t point = fixed.find('.');
    Decimal d;
    d.whole = std::strtoll(fixed.substr(0, point).c_str(), nullptr, 10);
    d.fraction = point == std::string::npos ? "" : fixed.substr(point + 1);
    while (!d.fraction.empty() && d.fraction.back() == '0') d.fraction.pop_back();
    d.exclusive = exclusive;
    return d;
  }
  // The fraction digits F from digit i on such that 0.F lies above lo's fraction and below hi's (inclusive or
  // not, as each says) while the digits so far equal the bound's (`lo_tight`, `hi_tight`; a bound's fraction
  // is read with zeros after its last digit); nullopt when no digits do. `need`: at least one digit.
  static std::optional<E> fraction_digits(const Decimal* lo, bool lo_tight, const Decimal* hi, bool hi_tight, size_t i,
                                          bool need) {
    const int64_t min = need ? 1 : 0;
    if (!lo_tight && !hi_tight) return any_digits_from(min);
    const bool lo_past = lo_tight && i >= lo->fraction.size(), hi_past = hi_tight && i >= hi->fraction.size();
    // Past a bound's digits, 0.F equals it while only zeros follow; the tails in closed form.
    if (lo_past && !hi_tight)  // any digits; exclusive: some digit must not be 0
      return lo->exclusive ? seq({E::repeat(lit("0"), 0, -1), E::chars_of(CharClass::range('1', '9')), any_digits_from(0)})
                           : any_digits_from(min);
    if (hi_past && (!lo_tight || lo_past)) {  // only zeros, which keep 0.F equal to hi (and lo, when tight)
      if (hi->exclusive || (lo_past && lo->exclusive)) return std::nullopt;
      return E::repeat(lit("0"), min, -1);
    }
    // Ending here: below lo while its digits remain (its last is not 0), equal to it when past them.
    const bool may_end = !need && (!lo_tight || (lo_past && !lo->exclusive)) && (!hi_tight || !(hi_past && hi->exclusive));
    const char lo_digit = lo_tight && !lo_past ? lo->fraction[i] : '0';
    const char hi_digit = !hi_tight ? '9' : hi_past ? '0' : hi->fraction[i];
    std::vector<E> ways;
    if (may_end) ways.push_back(E::empty());
    auto next = [&](char c, bool lo_next, bool hi_next) {
      if (std::optional<E> rest = fraction_digits(lo, lo_next, hi, hi_next, i + 1, false))
        ways.push_back(seq({lit(std::string(1, c)), *rest}));
    };
    if (lo_digit == hi_digit) {
      next(lo_digit, lo_tight, hi_tight);
    } else if (lo_digit < hi_digit) {
      next(lo_digit, lo_tight, false);
      if (lo_digit + 1 <= hi_digit - 1)
        ways.push_back(seq({E::chars_of(CharClass::range(char(lo_digit + 1), char(hi_digit - 1))), any_digits_from(0)}));
      next(hi_digit, false, hi_tight);
    }
    if (ways.empty()) return std::nullopt;
    return alt(std::move(ways));
  }
  static E any_digits_from(int64_t min) { return E::repeat(E::chars_of(CharClass::range('0', '9')), min, -1); }
  // What follows a number's whole digits: nothing, or a point and digits, within the bounds' fractions (a
  // null bound: open).
  static std::optional<E> fraction_part(const Decimal* lo, const Decimal* hi) {
    std::vector<E> ways;
    const bool bare = (!lo || (lo->fraction.empty() && !lo->exclusive)) && (!hi || !(hi->fraction.empty() && hi->exclusive));
    if (bare) ways.push_back(E::empty());
    if (std::optional<E> digits = fraction_digits(lo, lo != nullptr, hi, hi != nullptr, 0, true))
      ways.push_back(seq({lit("."), *digits}));
    if (ways.empty()) return std::nullopt;
    return alt(std::move(ways));
  }
  // Non-negative magnitudes m (digits, a point, digits: no exponent) with lo < m < hi or <= as each says; a
  // missing bound is open. nullopt when none lies between.
  static std::optional<E> bounded_magnitude(const Decimal& lo, const std::optional<Decimal>& hi) {
    std::vector<E> ways;
    auto add = [&](E whole, std::optional<E> fraction) {
      if (fraction) ways.push_back(seq({std::move(whole), std::move(*fraction)}));
    };
    const Decimal* upper = hi ? &*hi : nullptr;
    if (upper && upper->whole < lo.whole) return std::nullopt;
    if (upper && upper->whole == lo.whole) {
      add(lit(std::to_string(lo.whole)), fraction_part(&lo, upper));
    } else {
      add(lit(std::to_string(lo.whole)), fraction_part(&lo, nullptr));
      if (!upper) add(magnitudes(lo.whole + 1, -1), fraction_part(nullptr, nullptr));
      else if (lo.whole + 1 <= upper->whole - 1) add(magnitudes(lo.whole + 1, upper->whole - 1), fraction_part(nullptr, nullptr));
      if (upper) add(lit(std::to_string(upper->whole)), fraction_part(nullptr, upper));
    }
    if (ways.empty()) return std::nullopt;
    return alt(std::move(ways));
  }
  // A number within minimum / maximum / exclusiveMinimum / exclusiveMaximum (draft 4's boolean forms too),
  // compared digit by digit on plain decimals (no exponent); beyond +-9e18: open.
  static E bounded_number(const Json& schema, const std::string& path) {
    std::optional<double> lo, hi;
    bool lo_exclusive = false, hi_exclusive = false;
    auto tighten = [&](const char* key, bool lower, bool exclusive) {
      auto it = schema.find(key);
      if (it == schema.end() || it->is_boolean()) return;
      if (!it->is_number()) error(path, std::string(key) + " must be a number");
      const double v = it->get<double>();
      if (std::abs(v) >= 9e18) return;
      std::optional<double>& bound = lower ? lo : hi;
      bool& ex = lower ? lo_exclusive : hi_exclusive;
      if (!bound || (lower ? v > *bound : v < *bound) || (v == *bound && exclusive)) {
        bound = v;
        ex = exclusive;
      }
    };
    auto draft4 = [&](const char* key) {
      auto it = schema.find(key);
      return it != schema.end() && it->is_boolean() && it->get<bool>();
    };
    tighten("minimum", true, draft4("exclusiveMinimum"));
    tighten("maximum", false, draft4("exclusiveMaximum"));
    tighten("exclusiveMinimum", true, true);
    tighten("exclusiveMaximum", false, true);
    std::vector<E> ways;
    // x >= 0: magnitudes from max(lo, 0) up to hi.
    if (!hi || *hi > 0 || (*hi == 0 && !hi_exclusive)) {
      const Decimal from = lo && *lo >= 0 ? *decimal(*lo, lo_exclusive) : Decimal{};
      if (std::optional<E> m = bounded_magnitude(from, hi ? decimal(*hi, hi_exclusive) : std::nullopt)) ways.push_back(*m);
    }
    // x < 0: "-" and a magnitude above max(-hi, 0) (above 0 strictly: no "-0") up to -lo.
    if (!lo || *lo < 0) {
      const Decimal from = hi && *hi < 0 ? *decimal(-*hi, hi_exclusive) : Decimal{0, "", true};
      if (std::optional<E> m = bounded_magnitude(from, lo ? decimal(-*lo, lo_exclusive) : std::nullopt))
        ways.push_back(seq({lit("-"), *m}));
    }
    if (ways.empty()) error(path, "no number lies between its minimum and maximum");
    return alt(std::move(ways));
  }

  static E number(bool integer) {
    E digits = E::repeat(E::chars_of(CharClass::range('0', '9')), 0, -1);
    E whole = alt({lit("0"), seq({E::chars_of(CharClass::range('1', '9')), digits})});
    std::vector<E> parts;
    parts.push_back(opt(lit("-")));
    parts.push_back(whole);
    if (!integer) {
      E some_digits = E::repeat(E::chars_of(CharClass::range('0', '9')), 1, -1);
      CharClass e = CharClass::of('e');
      e.add('E', 'E');
      CharClass sign = CharClass::of('+');
      sign.add('-', '-');
      parts.push_back(opt(seq({lit("."), some_digits})));
      parts.push_back(opt(seq({E::chars_of(e), opt(E::chars_of(sign)), some_digits})));
    }
    return seq(std::move(parts));
  }

  const Json& resolve(const std::string& pointer, const std::string& path) {
    if (!pointer.starts_with("#")) error(path, "$ref '" + pointer + "' is not supported (only references into this schema, \"#...\")");
    const Json* at = &root_;
    std::string rest = pointer.substr(1);
    if (!rest.empty() && rest[0] != '/') error(path, "$ref '" + pointer + "' is not a JSON pointer");
    size_t i = 0;
    while (i < rest.size()) {
      size_t next = rest.find('/', i + 1);
      std::string token = rest.substr(i + 1, next == std::string::npos ? std::string::npos : next - i - 1);
      std::string key;
      for (size_t k = 0; k < token.size(); ++k) {
        if (token[k] == '~' && k + 1 < token.size()) {
          key += token[k + 1] == '1' ? '/' : '~';
          ++k;
        } else {
          key += token[k];
        }
      }
      if (at->is_object() && at->contains(key)) {
        at = &(*at)[key];
      } else if (at->is_array() && !key.empty() && key.find_first_not_of("0123456789") == std::string::npos &&
                 std::stoull(key) < at->size()) {
        at = &(*at)[std::stoull(key)];
      } else {
        error(path, "$ref '" + pointer + "' points at nothing");
      }
      if (next == std::string::npos) break;
      i = next;
    }
    return *at;
  }

  E reference(const std::string& pointer, const std::string& path, int depth) {
    auto it = ref_rules_.find(pointer);
    if (it != ref_rules_.end()) return rule_ref(it->second);
    const std::string name = "ref" + std::to_string(ref_rules_.size()) + ":" + pointer;
    ref_rules_[pointer] = name;
    const size_t index = rules_.size();
    rules_.push_back({name, {}});
    E body = value(resolve(pointer, path), pointer, depth + 1);
    rules_[index].body = std::move(body);
    return rule_ref(name);
  }

  E value(const Json& schema, const std::string& path, int depth) {
    if (depth > kMaxNesting) error(path, "the schema nests deeper than " + std::to_string(kMaxNesting) + " levels");
    if (schema.is_boolean()) {
      if (!schema.get<bool>()) error(path, "the schema `false` matches nothing");
      any_value();
      return rule_ref("json_value");
    }
    if (!schema.is_object()) error(path, "a schema must be an object or a boolean, not " + std::string(schema.type_name()));
    for (const char* refused : {"not", "if", "then", "else", "patternProperties", "dependentRequired",
                                "dependentSchemas", "propertyNames", "contains", "$dynamicRef"})
      if (schema.contains(refused)) error(path, std::string("the keyword '") + refused + "' is not supported");
    if (auto it = schema.find("$ref"); it != schema.end()) {
      if (!it->is_string()) error(path, "$ref must be a string");
      return reference(it->get<std::string>(), path, depth);
    }
    if (auto it = schema.find("const"); it != schema.end()) return lit(it->dump());
    if (auto it = schema.find("enum"); it != schema.end()) {
      if (!it->is_array() || it->empty()) error(path, "enum must be a non-empty array");
      std::vector<E> alts;
      for (const Json& v : *it) alts.push_back(lit(v.dump()));
      return alt(std::move(alts));
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (auto it = schema.find(key); it != schema.end()) {
        if (!it->is_array() || it->empty()) error(path, std::string(key) + " must be a non-empty array");
        std::vector<E> alts;
        for (size_t i = 0; i < it->size(); ++i)
          alts.push_back(value((*it)[i], path + "/" + key + "/" + std::to_string(i), depth + 1));
        return alt(std::move(alts));
      }
    if (auto it = schema.find("allOf"); it != schema.end()) {
      if (!it->is_array() || it->size() != 1)
        error(path, "allOf is supported with exactly one member (merging schemas is not)");
      return value((*it)[0], path + "/allOf/0", depth + 1);
    }
    if (auto it = schema.find("type"); it != schema.end()) {
      if (it->is_string()) return typed(schema, it->get<std::string>(), path, depth);
      if (!it->is_array() || it->empty()) error(path, "type must be a string or a non-empty array of strings");
      std::vector<E> alts;
      for (const Json& t : *it) {
        if (!t.is_string()) error(path, "type must be a string or a non-empty array of strings");
        alts.push_back(typed(schema, t.get<std::string>(), path, depth));
      }
      return alt(std::move(alts));
    }
    // No type: inferred from the keywords present, else any value.
    for (const char* key : {"properties", "required", "additionalProperties"})
      if (schema.contains(key)) return typed(schema, "object", path, depth);
    for (const char* key : {"items", "prefixItems", "minItems", "maxItems"})
      if (schema.contains(key)) return typed(schema, "array", path, depth);
    for (const char* key : {"pattern", "format", "minLength", "maxLength"})
      if (schema.contains(key)) return typed(schema, "string", path, depth);
    any_value();
    return rule_ref("json_value");
  }

  static int64_t count(const Json& schema, const char* key, int64_t def, const std::string& path) {
    auto it = schema.find(key);
    if (it == schema.end()) return def;
    if (!it->is_number_integer() || it->get<int64_t>() < 0) error(path, std::string(key) + " must be a non-negative integer");
    return it->get<int64_t>();
  }

  // {min, max} with a max beyond the limit read as unbounded and a min beyond it refused.
  static std::pair<int64_t, int64_t> bounds(const Json& schema, const char* min_key, const char* max_key,
                                            const std::string& path) {
    int64_t min = count(schema, min_key, 0, path), max = count(schema, max_key, -1, path);
    if (min > kMaxRepetition) error(path, std::string(min_key) + " above " + std::to_string(kMaxRepetition) + " is not supported");
    if (max > kMaxRepetition) max = -1;
    if (max != -1 && max < min) error(path, std::string(max_key) + " is below " + min_key);
    return {min, max};
  }


  E typed(const Json& schema, const std::string& type, const std::string& path, int depth) {
    if (type == "string") return string(schema, path);
    if (type == "integer") {
      for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        if (schema.contains(key)) return bounded_integer(schema, path);
      return number(true);
    }
    if (type == "number") {
      for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        if (schema.contains(key)) return bounded_number(schema, path);
      return number(false);
    }
    if (type == "boolean") return alt({lit("true"), lit("false")});
    if (type == "null") return lit("null");
    if (type == "object") return object(schema, path, depth);
    if (type == "array") return array(schema, path, depth);
    error(path, "unknown type '" + type + "'");
  }

  E string(const Json& schema, const std::string& path) {
    if (auto it = schema.find("pattern"); it != schema.end()) {
      if (!it->is_string()) error(path, "pattern must be a string");
      E body = regex_expr(it->get<std::string>(), "json schema: at " + path + ": pattern");
      restrict_to_json_string(body);
      return seq({lit("\""), std::move(body), lit("\"")});
    }
    if (auto it = schema.find("format"); it != schema.end() && it->is_string())
      if (const char* regex = format_regex(it->get<std::string>())) return seq({lit("\""), regex_expr(regex), lit("\"")});
    auto [min, max] = bounds(schema, "minLength", "maxLength", path);
    if (min == 0 && max == -1) {
      any_value();
      return rule_ref("json_string");
    }
    return seq({lit("\""), E::repeat(json_char(), min, max), lit("\"")});
  }

  E object(const Json& schema, const std::string& path, int depth) {
    struct Property {
      std::string key;
      const Json* schema;
      bool required;
    };
    std::vector<Property> props;
    static const Json kAny = true;
    if (auto it = schema.find("properties"); it != schema.end()) {
      if (!it->is_object()) error(path, "properties must be an object");
      for (auto p = it->begin(); p != it->end(); ++p) props.push_back({p.key(), &p.value(), false});
    }
    const Json* additional = nullptr;  // absent or false: none (xgrammar's strict mode)
    if (auto it = schema.find("additionalProperties"); it != schema.end()) {
      if (!(it->is_boolean() || it->is_object())) error(path, "additionalProperties must be a boolean or a schema");
      if (!(it->is_boolean() && !it->get<bool>())) additional = &*it;
    }
    if (auto it = schema.find("required"); it != schema.end()) {
      if (!it->is_array()) error(path, "required must be an array of names");
      for (const Json& name : *it) {
        if (!name.is_string()) error(path, "required must be an array of names");
        bool found = false;
        for (Property& p : props)
          if (p.key == name.get<std::string>()) found = p.required = true;
        // A required property the schema does not describe: any value (or additionalProperties' schema).
        if (!found) props.push_back({name.get<std::string>(), additional ? additional : &kAny, true});
      }
    }
    std::vector<E> members;
    for (const Property& p : props)
      members.push_back(seq({lit(Json(p.key).dump()), colon(),
                             value(*p.schema, path + "/properties/" + p.key, depth + 1)}));
    std::optional<E> extra;
    if (additional) {
      any_value();
      extra = seq({rule_ref("json_string"), colon(), value(*additional, path + "/additionalProperties", depth + 1)});
    }
    // first[k]: properties k.. when none was written yet; more[k]: the same after one (a comma first).
    // Rules, since an optional property makes both continuations possible.
    const std::string base = "object" + std::to_string(objects_++) + ":" + path;
    auto name = [&](const char* kind, size_t k) { return base + "/" + kind + std::to_string(k); };
    const size_t n = props.size();
    rules_.push_back({name("more", n), extra ? E::repeat(seq({comma(), *extra}), 0, -1) : E::empty()});
    rules_.push_back({name("first", n), extra ? opt(seq({*extra, E::repeat(seq({comma(), *extra}), 0, -1)})) : E::empty()});
    for (size_t k = n; k-- > 0;) {
      E more_k = seq({comma(), members[k], rule_ref(name("more", k + 1))});
      E first_k = seq({members[k], rule_ref(name("more", k + 1))});
      if (!props[k].required) {
        more_k = alt({std::move(more_k), rule_ref(name("more", k + 1))});
        first_k = alt({std::move(first_k), rule_ref(name("first", k + 1))});
      }
      rules_.push_back({name("more", k), std::move(more_k)});
      rules_.push_back({name("first", k), std::move(first_k)});
    }
    return seq({open("{"), rule_ref(name("first", 0)), close("}")});
  }

  E array(const Json& schema, const std::string& path, int depth) {
    std::vector<E> prefix;
    if (auto it = schema.find("prefixItems"); it != schema.end()) {
      if (!it->is_array()) error(path, "prefixItems must be an array of schemas");
      for (size_t i = 0; i < it->size(); ++i)
        prefix.push_back(value((*it)[i], path + "/prefixItems/" + std::to_string(i), depth + 1));
    }
    std::optional<E> item;
    if (auto it = schema.find("items"); it != schema.end()) {
      if (!(it->is_boolean() && !it->get<bool>())) item = value(*it, path + "/items", depth + 1);
    } else {
      any_value();
      item = rule_ref("json_value");
    }
    auto [min, max] = bounds(schema, "minItems", "maxItems", path);
    const int64_t p = int64_t(prefix.size());
    const int64_t min_extra = std::max<int64_t>(0, min - p);
    const int64_t max_extra = !item ? 0 : max == -1 ? -1 : std::max<int64_t>(0, max - p);
    if (!item && min > p) error(path, "minItems is more than the prefixItems allowed when items is false");
    // Items after the prefix; `after` when at least one item came before (a comma first).
    auto extras = [&](bool after) -> E {
      if (max_extra == 0) return E::empty();
      if (after) return E::repeat(seq({comma(), *item}), min_extra, max_extra);
      E rest = E::repeat(seq({comma(), *item}), std::max<int64_t>(0, min_extra - 1), max_extra == -1 ? -1 : max_extra - 1);
      E some = seq({*item, std::move(rest)});
      return min_extra > 0 ? some : opt(std::move(some));
    };
    E tail = extras(p > 0);
    for (int64_t i = p; i-- > 0;) {
      E part = i > 0 ? seq({comma(), prefix[size_t(i)], std::move(tail)}) : seq({prefix[size_t(i)], std::move(tail)});
      tail = i < std::min(min, p) ? std::move(part) : opt(std::move(part));
    }
    return seq({open("["), std::move(tail), close("]")});
  }

  const Json& root_;
  JsonSchemaOptions options_;
  std::vector<NamedRule> rules_;
  std::unordered_map<std::string, std::string> ref_rules_;
  bool have_any_ = false;
  int64_t objects_ = 0;
};

}  // namespace

Grammar grammar_from_json_schema(std::string_view schema_json, const JsonSchemaOptions& options) {
  SPARROW_CHECK(int64_t(schema_json.size()) <= kMaxSpecBytes, "json schema: longer than ", kMaxSpecBytes, " bytes");
  JsonInput<Json> parsed = parse_json_input<Json>(schema_json);
  SPARROW_CHECK(parsed.ok(), "json schema: not valid JSON",
                parsed.status == JsonInput<Json>::Status::TooDeep ? " (nested too deeply)" : "");
  try {
    return SchemaConverter(parsed.value, options).convert();
  } catch (const Error& e) {
    const std::string message = e.what();
    if (message.starts_with("json schema:")) throw;
    fail("json schema: ", message);
  }
}

Grammar json_object_grammar(const JsonSchemaOptions& options) {
  static const Json kEmpty = Json::object();
  return SchemaConverter(kEmpty, options).convert_any_object();
}

}  // namespace sparrow::structured
