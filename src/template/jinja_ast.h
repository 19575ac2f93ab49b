// The syntax tree of a Jinja template, as jinja2's parser builds it (jinja2/nodes.py), reduced to
// the nodes chat templates use. Every node keeps its template line for error messages.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "template/jinja_value.h"

namespace sparrow::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// The arguments written at a call site: f(a, b, key=c, *rest, **more).
struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
  ExprPtr star_args;    // *expr, or null
  ExprPtr star_kwargs;  // **expr, or null
};

struct Literal {
  Value value;
};
struct NameRef {
  std::string name;
};
struct ListLiteral {  // [a, b] or (a, b)
  std::vector<ExprPtr> items;
  bool is_tuple = false;
};
struct DictLiteral {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};
struct GetAttr {  // object.attr
  ExprPtr object;
  std::string attr;
};
struct GetItem {  // object[key]
  ExprPtr object;
  ExprPtr key;
};
struct SliceExpr {  // object[start:stop:step]; absent parts are null
  ExprPtr object, start, stop, step;
};
struct CallExpr {
  ExprPtr callee;
  CallArgs args;
};
struct FilterExpr {  // input | name(args); input is null for the filter of a {% filter %} block
  ExprPtr input;
  std::string name;
  CallArgs args;
};
struct TestExpr {  // input is name(args)
  ExprPtr input;
  std::string name;
  CallArgs args;
};
struct UnaryExpr {  // -x, +x, not x
  enum class Op { Negate, Plus, Not } op;
  ExprPtr operand;
};
struct BinaryExpr {  // arithmetic (+ - * / // % **) and the short-circuit `and` / `or`
  std::string op;
  ExprPtr left, right;
};
struct CompareExpr {  // a < b <= c ...: ops are == != < <= > >= in notin
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;
};
struct ConcatExpr {  // a ~ b ~ c
  std::vector<ExprPtr> parts;
};
struct CondExpr {  // then if test else otherwise (otherwise may be null: undefined)
  ExprPtr test, then, otherwise;
};

struct Expr {
  int line = 0;
  int depth = 1;  // 1 + the depth of its deepest operand (at most kMaxSyntaxDepth, jinja_limits.h)
  std::variant<Literal, NameRef, ListLiteral, DictLiteral, GetAttr, GetItem, SliceExpr, CallExpr, FilterExpr, TestExpr,
               UnaryExpr, BinaryExpr, CompareExpr, ConcatExpr, CondExpr>
      node;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

// What `set`, `for` and `with` assign to: a name, several names unpacked from a sequence, or a
// namespace attribute (`ns.attr`).
struct Target {
  std::vector<std::string> names;
  bool unpack = false;    // `a, b`: unpack a sequence into names
  std::string attribute;  // non-empty: assign names[0].attribute
};

struct TextStmt {
  std::string text;
};
struct OutputStmt {  // {{ value }}
  ExprPtr value;
};
struct IfStmt {
  std::vector<std::pair<ExprPtr, Body>> branches;  // if / elif
  Body otherwise;
};
struct ForStmt {
  Target target;
  ExprPtr iterable;
  ExprPtr filter;  // `for x in xs if cond`, or null
  bool recursive = false;
  Body body;
  Body otherwise;  // {% else %}: runs when nothing was iterated
};
struct SetStmt {
  Target target;
  ExprPtr value;
};
struct SetBlockStmt {  // {% set x | filter %}...{% endset %}
  Target target;
  ExprPtr filter;  // FilterExpr chain with a null innermost input, or null
  Body body;
};
struct MacroStmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  bool uses_varargs = false;      // the body reads `varargs` / `kwargs`, so extra arguments are kept
  bool uses_kwargs = false;
  Body body;
};
struct FilterBlockStmt {  // {% filter upper %}...{% endfilter %}
  ExprPtr filter;
  Body body;
};
struct WithStmt {
  std::vector<Target> targets;
  std::vector<ExprPtr> values;
  Body body;
};
struct LoopControlStmt {  // {% break %} / {% continue %}
  bool is_break = false;
};
struct GenerationStmt {  // transformers' {% generation %} (AssistantTracker): renders its body
  Body body;
};

struct Stmt {
  int line = 0;
  std::variant<TextStmt, OutputStmt, IfStmt, ForStmt, SetStmt, SetBlockStmt, MacroStmt, FilterBlockStmt, WithStmt,
               LoopControlStmt, GenerationStmt>
      node;
};

}  // namespace sparrow::jinja
