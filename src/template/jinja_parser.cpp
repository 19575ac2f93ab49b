#include "template/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "template/jinja_lexer.h"
#include "template/jinja_limits.h"

namespace sparrow::jinja {
namespace {

using T = Token::Type;

// The depth of the deepest operand of each kind of node (0: none).
int deepest(const ExprPtr& e) { return e ? e->depth : 0; }
int deepest(const CallArgs& args) {
  int d = std::max(deepest(args.star_args), deepest(args.star_kwargs));
  for (const auto& e : args.positional) d = std::max(d, deepest(e));
  for (const auto& [name, e] : args.keyword) d = std::max(d, deepest(e));
  return d;
}
int operand_depth(const Literal&) { return 0; }
int operand_depth(const NameRef&) { return 0; }
int operand_depth(const ListLiteral& n) {
  int d = 0;
  for (const auto& e : n.items) d = std::max(d, deepest(e));
  return d;
}
int operand_depth(const DictLiteral& n) {
  int d = 0;
  for (const auto& [key, value] : n.items) d = std::max({d, deepest(key), deepest(value)});
  return d;
}
int operand_depth(const GetAttr& n) { return deepest(n.object); }
int operand_depth(const GetItem& n) { return std::max(deepest(n.object), deepest(n.key)); }
int operand_depth(const SliceExpr& n) {
  return std::max({deepest(n.object), deepest(n.start), deepest(n.stop), deepest(n.step)});
}
int operand_depth(const CallExpr& n) { return std::max(deepest(n.callee), deepest(n.args)); }
int operand_depth(const FilterExpr& n) { return std::max(deepest(n.input), deepest(n.args)); }
int operand_depth(const TestExpr& n) { return std::max(deepest(n.input), deepest(n.args)); }
int operand_depth(const UnaryExpr& n) { return deepest(n.operand); }
int operand_depth(const BinaryExpr& n) { return std::max(deepest(n.left), deepest(n.right)); }
int operand_depth(const CompareExpr& n) {
  int d = deepest(n.first);
  for (const auto& [op, e] : n.rest) d = std::max(d, deepest(e));
  return d;
}
int operand_depth(const ConcatExpr& n) {
  int d = 0;
  for (const auto& e : n.parts) d = std::max(d, deepest(e));
  return d;
}
int operand_depth(const CondExpr& n) { return std::max({deepest(n.test), deepest(n.then), deepest(n.otherwise)}); }

// Expressions nest by operators as well as by brackets: a + b + c is ((a + b) + c), so a long chain is
// as deep as it is long, and the interpreter (and the tree's destructor) recurse that deep.
template <typename Node>
ExprPtr make_expr(int line, Node node) {
  auto e = std::make_unique<Expr>();
  e->line = line;
  e->depth = operand_depth(node) + 1;
  if (e->depth > kMaxSyntaxDepth)
    throw TemplateError(cat("expression nested more than ", kMaxSyntaxDepth, " levels deep (the template limit)"),
                        line);
  e->node = std::move(node);
  return e;
}

template <typename Node>
std::unique_ptr<Stmt> make_stmt(int line, Node node) {
  auto s = std::make_unique<Stmt>();
  s->line = line;
  s->node = std::move(node);
  return s;
}

std::string describe(const Token& t) {
  switch (t.type) {
    case T::Text:
      return "template text";
    case T::VariableBegin:
      return "'{{'";
    case T::VariableEnd:
      return "end of print statement";
    case T::BlockBegin:
      return "'{%'";
    case T::BlockEnd:
      return "end of statement block";
    case T::String:
      return "string";
    case T::Integer:
      return "integer";
    case T::Float:
      return "float";
    case T::End:
      return "end of template";
    default:
      return "'" + t.text + "'";
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse() {
    Body body = subparse({});
    return body;
  }

 private:
  // ---- token stream ----
  const Token& current() const { return tokens_[pos_]; }
  const Token& peek() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool is_name(std::string_view name) const { return current().type == T::Name && current().text == name; }
  bool is_op(std::string_view op) const { return current().type == T::Operator && current().text == op; }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  [[noreturn]] void fail_at(int line, const std::string& message) const { throw TemplateError(message, line); }
  [[noreturn]] void fail(const std::string& message) const { fail_at(current().line, message); }
  const Token& expect(T type, const char* what) {
    if (current().type != type) fail(cat("expected ", what, ", got ", describe(current())));
    return next();
  }
  const Token& expect_op(std::string_view op) {
    if (!is_op(op)) fail(cat("expected '", op, "', got ", describe(current())));
    return next();
  }
  void expect_name(std::string_view name) {
    if (!is_name(name)) fail(cat("expected '", name, "', got ", describe(current())));
    next();
  }

  // One level of the parser's recursion, for as long as it lives: brackets, `not`, unary signs, else
  // branches and blocks inside blocks nest at most kMaxSyntaxDepth deep.
  struct Nested {
    explicit Nested(Parser& parser) : parser(parser) {
      if (parser.nesting_ >= kMaxSyntaxDepth)
        parser.fail(cat("the template nests more than ", kMaxSyntaxDepth, " levels deep (the template limit)"));
      ++parser.nesting_;
    }
    ~Nested() { --parser.nesting_; }
    Parser& parser;
  };

  // ---- statements ----

  // Parses until a block tag whose name is in `end_names` (left as the current token), or the end.
  Body subparse(std::initializer_list<std::string_view> end_names) {
    Body body;
    while (current().type != T::End) {
      const Token& t = current();
      if (t.type == T::Text) {
        body.push_back(make_stmt(t.line, TextStmt{t.text}));
        next();
      } else if (t.type == T::VariableBegin) {
        int line = next().line;
        body.push_back(make_stmt(line, OutputStmt{parse_tuple(false, true, {}, false)}));
        expect(T::VariableEnd, "'}}'");
      } else if (t.type == T::BlockBegin) {
        next();
        for (std::string_view end : end_names)
          if (is_name(end)) return body;
        parse_statement(body);
        expect(T::BlockEnd, "'%}'");
      } else {
        fail("unexpected " + describe(t));
      }
    }
    return body;
  }

  // Skips an optional ':', expects '%}', and parses a body ending at one of `end_names`; with
  // `drop_end` the end tag's name is consumed too.
  Body parse_statements(std::initializer_list<std::string_view> end_names, bool drop_end, int opened_at) {
    skip_op(":");
    expect(T::BlockEnd, "'%}'");
    Body body = subparse(end_names);
    if (current().type == T::End) {
      std::string expected;
      for (std::string_view end : end_names) expected += (expected.empty() ? "'" : " or '") + std::string(end) + "'";
      fail_at(opened_at, cat("unexpected end of template: this tag is never closed (expected ", expected, ")"));
    }
    if (drop_end) next();
    return body;
  }

  void parse_statement(Body& body) {
    Nested nested(*this);
    const Token& t = current();
    if (t.type != T::Name) fail("tag name expected");
    int line = t.line;
    std::string tag = t.text;
    if (tag == "if") return body.push_back(parse_if());
    if (tag == "for") return body.push_back(parse_for());
    if (tag == "set") return body.push_back(parse_set());
    if (tag == "macro") return body.push_back(parse_macro());
    if (tag == "filter") return body.push_back(parse_filter_block());
    if (tag == "with") return body.push_back(parse_with());
    if (tag == "generation") {
      next();
      return body.push_back(make_stmt(line, GenerationStmt{parse_statements({"endgeneration"}, true, line)}));
    }
    if (tag == "print") {
      next();
      for (bool first = true; current().type != T::BlockEnd; first = false) {
        if (!first) expect_op(",");
        body.push_back(make_stmt(line, OutputStmt{parse_expression(true)}));
      }
      return;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(cat("'", tag, "' outside of a for loop"));
      next();
      return body.push_back(make_stmt(line, LoopControlStmt{tag == "break"}));
    }
    if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" || tag == "from" || tag == "call" ||
        tag == "autoescape" || tag == "do")
      fail(cat("the tag '", tag, "' is not supported in chat templates"));
    fail(cat("Encountered unknown tag '", tag, "'."));
  }

  std::unique_ptr<Stmt> parse_if() {
    int line = next().line;
    IfStmt node;
    while (true) {
      ExprPtr test = parse_tuple(false, false, {}, false);
      Body branch = parse_statements({"elif", "else", "endif"}, false, line);
      node.branches.emplace_back(std::move(test), std::move(branch));
      std::string which = next().text;
      if (which == "elif") continue;
      if (which == "else") node.otherwise = parse_statements({"endif"}, true, line);
      break;
    }
    return make_stmt(line, std::move(node));
  }

  std::unique_ptr<Stmt> parse_for() {
    int line = next().line;
    ForStmt node;
    node.target = parse_target(true, false, {"in"});
    expect_name("in");
    node.iterable = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) node.filter = parse_expression(true);
    node.recursive = skip_name("recursive");
    ++loop_depth_;
    node.body = parse_statements({"endfor", "else"}, false, line);
    --loop_depth_;
    if (next().text == "else") node.otherwise = parse_statements({"endfor"}, true, line);
    return make_stmt(line, std::move(node));
  }

  std::unique_ptr<Stmt> parse_set() {
    int line = next().line;
    Target target = parse_target(true, true, {});
    if (skip_op("=")) return make_stmt(line, SetStmt{std::move(target), parse_tuple(false, true, {}, false)});
    SetBlockStmt node;
    node.target = std::move(target);
    if (is_op("|")) node.filter = parse_filter(nullptr, false);
    node.body = parse_statements({"endset"}, true, line);
    return make_stmt(line, std::move(node));
  }

  std::unique_ptr<Stmt> parse_macro() {
    int line = next().line;
    MacroStmt node;
    node.name = expect(T::Name, "a macro name").text;
    expect_op("(");
    while (!is_op(")")) {
      if (!node.params.empty()) expect_op(",");
      node.params.push_back(expect(T::Name, "a parameter name").text);
      if (skip_op("="))
        node.defaults.push_back(parse_expression(true));
      else if (!node.defaults.empty())
        fail("non-default argument follows default argument");
    }
    expect_op(")");
    size_t names_before = names_read_.size();
    int saved_depth = loop_depth_;
    loop_depth_ = 0;  // a loop around the macro definition does not make `break` legal inside it
    node.body = parse_statements({"endmacro"}, true, line);
    loop_depth_ = saved_depth;
    // jinja2 keeps extra call arguments only when the body reads `varargs` / `kwargs`.
    for (size_t i = names_before; i < names_read_.size(); ++i) {
      node.uses_varargs |= names_read_[i] == "varargs";
      node.uses_kwargs |= names_read_[i] == "kwargs";
    }
    return make_stmt(line, std::move(node));
  }

  std::unique_ptr<Stmt> parse_filter_block() {
    int line = next().line;
    FilterBlockStmt node;
    node.filter = parse_filter(nullptr, true);
    node.body = parse_statements({"endfilter"}, true, line);
    return make_stmt(line, std::move(node));
  }

  std::unique_ptr<Stmt> parse_with() {
    int line = next().line;
    WithStmt node;
    while (current().type != T::BlockEnd) {
      if (!node.targets.empty()) expect_op(",");
      node.targets.push_back(parse_target(false, false, {}));
      expect_op("=");
      node.values.push_back(parse_expression(true));
    }
    node.body = parse_statements({"endwith"}, true, line);
    return make_stmt(line, std::move(node));
  }

  // An assignment target: `x`, `a, b` (with_tuple), `(a, b)`, or `ns.attr` (with_namespace).
  Target parse_target(bool with_tuple, bool with_namespace, std::initializer_list<std::string_view> extra_end) {
    Target target;
    bool parenthesized = with_tuple && skip_op("(");
    while (true) {
      const Token& name = expect(T::Name, "a variable name to assign to");
      static const char* const kConstants[] = {"true", "false", "none", "True", "False", "None"};
      for (const char* c : kConstants)
        if (name.text == c) fail_at(name.line, "can't assign to 'const'");
      target.names.push_back(name.text);
      if (with_namespace && target.names.size() == 1 && !parenthesized && skip_op(".")) {
        target.attribute = expect(T::Name, "an attribute name").text;
        return target;
      }
      if (!with_tuple || !is_op(",")) break;
      next();
      target.unpack = true;
      if (is_tuple_end(extra_end) || is_op(")")) break;
    }
    if (parenthesized) {
      expect_op(")");
      target.unpack = true;
    }
    return target;
  }

  // ---- expressions (jinja2's precedence, lowest first) ----

  bool is_tuple_end(std::initializer_list<std::string_view> extra_end) const {
    if (current().type == T::VariableEnd || current().type == T::BlockEnd || is_op(")")) return true;
    for (std::string_view name : extra_end)
      if (is_name(name)) return true;
    return false;
  }

  // Expressions separated by commas become a tuple: `{{ a, b }}`, `{% set x = 1, 2 %}`.
  ExprPtr parse_tuple(bool simplified, bool with_condexpr, std::initializer_list<std::string_view> extra_end,
                      bool explicit_parentheses) {
    int line = current().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (!is_op(",")) break;
      is_tuple = true;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail("expected an expression, got " + describe(current()));
    }
    return make_expr(line, ListLiteral{std::move(items), true});
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    int line = current().line;
    ExprPtr expr = parse_or();
    while (skip_name("if")) {
      ExprPtr test = parse_or();
      ExprPtr otherwise;
      if (skip_name("else")) {
        Nested nested(*this);
        otherwise = parse_condexpr();
      }
      expr = make_expr(line, CondExpr{std::move(test), std::move(expr), std::move(otherwise)});
      line = current().line;
    }
    return expr;
  }

  ExprPtr parse_or() {
    int line = current().line;
    ExprPtr left = parse_and();
    while (skip_name("or")) left = make_expr(line, BinaryExpr{"or", std::move(left), parse_and()});
    return left;
  }

  ExprPtr parse_and() {
    int line = current().line;
    ExprPtr left = parse_not();
    while (skip_name("and")) left = make_expr(line, BinaryExpr{"and", std::move(left), parse_not()});
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      Nested nested(*this);
      int line = next().line;
      return make_expr(line, UnaryExpr{UnaryExpr::Op::Not, parse_not()});
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = current().line;
    ExprPtr first = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> rest;
    while (true) {
      std::string op;
      if (current().type == T::Operator &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = next().text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && peek().type == T::Name && peek().text == "in") {
        next(), next();
        op = "notin";
      } else {
        break;
      }
      rest.emplace_back(op, parse_math1());
    }
    if (rest.empty()) return first;
    return make_expr(line, CompareExpr{std::move(first), std::move(rest)});
  }

  ExprPtr parse_math1() {
    int line = current().line;
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().text;
      left = make_expr(line, BinaryExpr{op, std::move(left), parse_concat()});
    }
    return left;
  }

  ExprPtr parse_concat() {
    int line = current().line;
    std::vector<ExprPtr> parts;
    parts.push_back(parse_math2());
    while (skip_op("~")) parts.push_back(parse_math2());
    if (parts.size() == 1) return std::move(parts[0]);
    return make_expr(line, ConcatExpr{std::move(parts)});
  }

  ExprPtr parse_math2() {
    int line = current().line;
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().text;
      left = make_expr(line, BinaryExpr{op, std::move(left), parse_pow()});
    }
    return left;
  }

  ExprPtr parse_pow() {
    int line = current().line;
    ExprPtr left = parse_unary(true);
    while (skip_op("**")) left = make_expr(line, BinaryExpr{"**", std::move(left), parse_unary(true)});
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    int line = current().line;
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      Nested nested(*this);
      auto op = next().text == "-" ? UnaryExpr::Op::Negate : UnaryExpr::Op::Plus;
      node = make_expr(line, UnaryExpr{op, parse_unary(false)});
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = current();
    int line = t.line;
    switch (t.type) {
      case T::Name: {
        next();
        if (t.text == "true" || t.text == "True") return make_expr(line, Literal{Value(true)});
        if (t.text == "false" || t.text == "False") return make_expr(line, Literal{Value(false)});
        if (t.text == "none" || t.text == "None") return make_expr(line, Literal{Value::none()});
        names_read_.push_back(t.text);
        return make_expr(line, NameRef{t.text});
      }
      case T::String: {
        std::string text;
        while (current().type == T::String) text += next().text;  // adjacent literals join
        return make_expr(line, Literal{Value(std::move(text))});
      }
      case T::Integer:
        next();
        return make_expr(line, Literal{Value(t.integer)});
      case T::Float:
        next();
        return make_expr(line, Literal{Value(t.number)});
      case T::Operator:
        if (t.text == "(") {
          Nested nested(*this);
          next();
          ExprPtr inner = parse_tuple(false, true, {}, true);
          expect_op(")");
          return inner;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    fail("unexpected " + describe(t));
  }

  ExprPtr parse_list() {
    Nested nested(*this);
    int line = next().line;
    std::vector<ExprPtr> items;
    while (!is_op("]")) {
      if (!items.empty()) expect_op(",");
      if (is_op("]")) break;
      items.push_back(parse_expression(true));
    }
    expect_op("]");
    return make_expr(line, ListLiteral{std::move(items), false});
  }

  ExprPtr parse_dict() {
    Nested nested(*this);
    int line = next().line;
    std::vector<std::pair<ExprPtr, ExprPtr>> items;
    while (!is_op("}")) {
      if (!items.empty()) expect_op(",");
      if (is_op("}")) break;
      ExprPtr key = parse_expression(true);
      expect_op(":");
      items.emplace_back(std::move(key), parse_expression(true));
    }
    expect_op("}");
    return make_expr(line, DictLiteral{std::move(items)});
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("["))
        node = parse_subscript(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|"))
        node = parse_filter(std::move(node), false);
      else if (is_name("is"))
        node = parse_test(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    Nested nested(*this);
    const Token& t = next();
    int line = t.line;
    if (t.text == ".") {
      const Token& attr = next();
      if (attr.type == T::Name) return make_expr(line, GetAttr{std::move(node), attr.text});
      if (attr.type != T::Integer) fail_at(attr.line, "expected name or number after '.'");
      return make_expr(line, GetItem{std::move(node), make_expr(attr.line, Literal{Value(attr.integer)})});
    }
    // '[': an index, a slice, or several indices (a tuple key)
    std::vector<ExprPtr> keys;
    while (!is_op("]")) {
      if (!keys.empty()) expect_op(",");
      ExprPtr start;
      if (!is_op(":")) {
        start = parse_expression(true);
        if (!is_op(":")) {
          keys.push_back(std::move(start));
          continue;
        }
      }
      next();  // ':'
      SliceExpr slice;
      slice.object = std::move(node);
      slice.start = std::move(start);
      if (!is_op("]") && !is_op(",") && !is_op(":")) slice.stop = parse_expression(true);
      if (skip_op(":") && !is_op("]") && !is_op(",")) slice.step = parse_expression(true);
      expect_op("]");
      if (!keys.empty()) fail_at(line, "slices inside a tuple subscript are not supported");
      return make_expr(line, std::move(slice));
    }
    expect_op("]");
    if (keys.empty()) fail_at(line, "expected a subscript expression");
    if (keys.size() == 1) return make_expr(line, GetItem{std::move(node), std::move(keys[0])});
    return make_expr(line, GetItem{std::move(node), make_expr(line, ListLiteral{std::move(keys), true})});
  }

  CallArgs parse_call_args() {
    Nested nested(*this);
    int line = expect_op("(").line;
    CallArgs args;
    bool need_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) fail_at(line, "invalid syntax for function call expression");
    };
    while (!is_op(")")) {
      if (need_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (skip_op("*")) {
        ensure(!args.star_args && !args.star_kwargs);
        args.star_args = parse_expression(true);
      } else if (skip_op("**")) {
        ensure(!args.star_kwargs);
        args.star_kwargs = parse_expression(true);
      } else if (current().type == T::Name && peek().type == T::Operator && peek().text == "=") {
        ensure(!args.star_kwargs);
        std::string key = next().text;
        next();
        args.keyword.emplace_back(key, parse_expression(true));
      } else {
        ensure(!args.star_args && !args.star_kwargs && args.keyword.empty());
        args.positional.push_back(parse_expression(true));
      }
      need_comma = true;
    }
    expect_op(")");
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    int line = current().line;
    CallArgs args = parse_call_args();
    return make_expr(line, CallExpr{std::move(callee), std::move(args)});
  }

  std::string parse_dotted_name() {
    std::string name = expect(T::Name, "a filter or test name").text;
    while (skip_op(".")) name += "." + expect(T::Name, "a name").text;
    return name;
  }

  // `| name(args) | other ...`; with start_inline the first '|' is absent ({% filter name %}).
  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      int line = current().line;
      FilterExpr filter;
      filter.input = std::move(node);
      filter.name = parse_dotted_name();
      if (is_op("(")) filter.args = parse_call_args();
      node = make_expr(line, std::move(filter));
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;  // 'is'
    bool negated = skip_name("not");
    TestExpr test;
    test.input = std::move(node);
    test.name = parse_dotted_name();
    if (is_op("(")) {
      test.args = parse_call_args();
    } else {
      // jinja2 lets a test take one bare argument: `x is divisibleby 3`, `x is sameas none`.
      const Token& t = current();
      bool starts_argument = t.type == T::Name || t.type == T::String || t.type == T::Integer || t.type == T::Float ||
                             is_op("(") || is_op("[") || is_op("{");
      if (starts_argument && !is_name("else") && !is_name("or") && !is_name("and")) {
        if (is_name("is")) fail("You cannot chain multiple tests with is");
        test.args.positional.push_back(parse_postfix(parse_primary()));
      }
    }
    ExprPtr result = make_expr(line, std::move(test));
    if (negated) result = make_expr(line, UnaryExpr{UnaryExpr::Op::Not, std::move(result)});
    return result;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;                   // for loops around the current tag (break/continue need one)
  int nesting_ = 0;                      // Nested levels open (kMaxSyntaxDepth)
  std::vector<std::string> names_read_;  // every variable name read so far, for macros' varargs/kwargs
};

}  // namespace

Body parse_template(std::string_view source) { return Parser(tokenize(source)).parse(); }

}  // namespace sparrow::jinja
