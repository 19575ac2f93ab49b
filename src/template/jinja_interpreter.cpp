// Renders a parsed template: statements write text, expressions compute Values with Python's
// semantics, and names resolve through a chain of scopes that follows jinja2's rules:
//   - the render variables and the global functions form the outermost scope;
//   - `set` (and macro definitions) bind in the current scope; `if` opens no scope;
//   - every iteration of a `for` body, every macro call and every `with` block gets a fresh scope,
//     so their `set`s do not leak out (which is why templates use namespace() to carry state);
//   - a macro resolves free names in the scope where it was defined, at call time, so it sees a
//     top-level `set` made after its definition.
// A render stays inside the limits of jinja_limits.h: nesting of evaluation and calls, loop
// iterations, and the size of every string and list it builds.
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "template/jinja_builtins.h"
#include "template/jinja_limits.h"
#include "template/jinja_parser.h"
#include "template/jinja_template.h"
#include "template/unicode.h"

namespace sparrow::jinja {
namespace {

class Scope {
 public:
  explicit Scope(std::shared_ptr<Scope> parent = nullptr) : parent_(std::move(parent)) {}
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent_.get()) {
      size_t i = s->position(name);
      if (i < s->vars_.size()) return &s->vars_[i].second;
    }
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    size_t i = position(name);
    if (i < vars_.size()) {
      vars_[i].second = std::move(value);
      return;
    }
    vars_.emplace_back(name, std::move(value));
    if (vars_.size() == kIndexedSize) {
      for (size_t j = 0; j < vars_.size(); ++j) index_.emplace(vars_[j].first, j);
    } else if (vars_.size() > kIndexedSize) {
      index_.emplace(name, i);
    }
  }

 private:
  // Most scopes (a loop iteration, a macro call) hold a name or two and are made by the million, so the
  // names sit in a vector; a scope holding many (the render variables) also indexes them.
  static constexpr size_t kIndexedSize = 16;
  // Where `name` is in vars_, or vars_.size() when this scope does not hold it.
  size_t position(const std::string& name) const {
    if (vars_.size() >= kIndexedSize) {
      auto it = index_.find(name);
      return it == index_.end() ? vars_.size() : it->second;
    }
    size_t i = 0;
    while (i < vars_.size() && vars_[i].first != name) ++i;
    return i;
  }

  std::vector<std::pair<std::string, Value>> vars_;
  std::unordered_map<std::string, size_t> index_;  // name -> its entry; empty below kIndexedSize names
  std::shared_ptr<Scope> parent_;
};
using ScopePtr = std::shared_ptr<Scope>;

// Python ints are unbounded; ours are 64-bit and refuse to wrap.
template <typename Op>
int64_t checked(Op op, int64_t a, int64_t b) {
  int64_t result;
  if (op(a, b, &result)) template_fail("integer result too large (Python would switch to a big integer)");
  return result;
}
bool add_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); }
bool sub_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); }
bool mul_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

// CPython's float_divmod, which floor division and modulo of floats follow.
std::pair<double, double> float_divmod(double x, double y) {
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, x / y);
  }
  return {floordiv, mod};
}

// The size of `times` copies of `size` units, checked first: 'a' * 10**12 must not try to allocate.
int64_t repeated_size(int64_t size, int64_t times) {
  int64_t total = 0;
  if (times > 0 && __builtin_mul_overflow(size, times, &total)) total = INT64_MAX;
  return total;
}

Value repeat(const Value& sequence, int64_t times) {
  if (sequence.is_string()) {
    check_string_size(repeated_size(int64_t(sequence.as_string().size()), times));
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += sequence.as_string();
    return out;
  }
  check_list_size(repeated_size(int64_t(sequence.items().size()), times));
  ValueList out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), sequence.items().begin(), sequence.items().end());
  return sequence.kind() == Value::Kind::Tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

// The arithmetic operators with Python's rules (int/float promotion, str and list + and *, floor
// division and modulo rounding toward negative infinity, str % args formatting).
Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  bool numbers = a.is_number() && b.is_number();
  bool ints = numbers && a.kind() != K::Float && b.kind() != K::Float;
  if (op == "+") {
    if (ints) return checked(add_overflows, a.as_int(), b.as_int());
    if (numbers) return a.as_float() + b.as_float();
    if (a.is_string() && b.is_string()) return a.as_string() + b.as_string();
    if (a.is_sequence() && a.kind() == b.kind()) {
      check_list_size(int64_t(a.items().size() + b.items().size()));
      ValueList items = a.items();
      items.insert(items.end(), b.items().begin(), b.items().end());
      return a.kind() == K::Tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
    }
    if (a.is_string() || a.is_sequence())
      template_fail("can only concatenate ", type_name(a), " (not \"", type_name(b), "\") to ", type_name(a));
  } else if (op == "-") {
    if (ints) return checked(sub_overflows, a.as_int(), b.as_int());
    if (numbers) return a.as_float() - b.as_float();
  } else if (op == "*") {
    if (ints) return checked(mul_overflows, a.as_int(), b.as_int());
    if (numbers) return a.as_float() * b.as_float();
    bool b_int = b.kind() == K::Int || b.kind() == K::Bool, a_int = a.kind() == K::Int || a.kind() == K::Bool;
    if ((a.is_string() || a.is_sequence()) && b_int) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && a_int) return repeat(b, a.as_int());
  } else if (op == "/") {
    if (numbers) {
      if (b.as_float() == 0) template_fail("division by zero");
      return a.as_float() / b.as_float();
    }
  } else if (op == "//" || op == "%") {
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) template_fail("integer division or modulo by zero");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) q -= 1, m += y;
      return op == "//" ? q : m;
    }
    if (numbers) {
      if (b.as_float() == 0) template_fail(op == "//" ? "float floor division by zero" : "float modulo");
      auto [q, m] = float_divmod(a.as_float(), b.as_float());
      return op == "//" ? q : m;
    }
    if (op == "%" && a.is_string()) return percent_format(a.as_string(), b);
  } else if (op == "**") {
    if (ints && b.as_int() >= 0) {
      int64_t result = 1, base = a.as_int();
      for (int64_t e = b.as_int(); e > 0; e >>= 1) {  // square-and-multiply
        if (e & 1) result = checked(mul_overflows, result, base);
        if (e > 1) base = checked(mul_overflows, base, base);
      }
      return result;
    }
    if (numbers) {
      double result = std::pow(a.as_float(), b.as_float());
      if (std::isinf(result) && std::isfinite(a.as_float()) && std::isfinite(b.as_float()))
        template_fail("(34, 'Numerical result out of range')");  // Python's OverflowError
      return result;
    }
  }
  template_fail("unsupported operand type(s) for ", op, ": '", type_name(a), "' and '", type_name(b), "'");
}

bool compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  if (a.is_number() && b.is_number() && (a.kind() == Value::Kind::Float || b.kind() == Value::Kind::Float)) {
    double x = a.as_float(), y = b.as_float();  // NaN compares false every way, as in Python
    return op == "<" ? x < y : op == "<=" ? x <= y : op == ">" ? x > y : x >= y;
  }
  if (op == "<") return less_than(a, b);
  if (op == ">") return less_than(b, a);
  if (op == "<=") return !less_than(b, a);
  return !less_than(a, b);
}

class Interpreter {
 public:
  // Namespaces still alive when the render ends hold themselves ({% set ns.me = ns %}), which
  // reference counting never frees: emptying them breaks the cycles.
  ~Interpreter() {
    for (const std::weak_ptr<Object>& made : namespaces_)
      if (std::shared_ptr<Object> ns = made.lock()) {
        Dict held = std::move(ns->attributes);  // freed at the end of this block
        ns->attributes = Dict();
      }
  }

  std::string render(const Body& body, const Dict& variables) {
    deadline_ = thread_cpu_time() + kMaxRenderTime;
    auto globals = std::make_shared<Scope>();
    static const Dict functions = global_functions();
    for (const auto& [name, value] : functions.entries()) globals->set(name.as_string(), value);
    globals->set("namespace", Value::function("namespace", [this](const Args& args) {
                   std::shared_ptr<Object> ns = make_namespace(args);
                   remember(ns);
                   return Value::object(ns);
                 }));
    for (const auto& [name, value] : variables.entries()) globals->set(to_str(name), value);
    auto top = std::make_shared<Scope>(globals);
    std::string out;
    exec(body, top, out);
    return out;
  }

 private:
  enum class Flow { Normal, Break, Continue };

  // Counts one level of nesting for as long as it lives; past `limit` levels it throws instead.
  struct NestingGuard {
    NestingGuard(int& depth, int limit, const char* what) : depth(depth) {
      if (depth >= limit) template_fail(what, " (the template limit is ", limit, ")");
      ++depth;
    }
    ~NestingGuard() { --depth; }
    int& depth;
  };

  // Appends to a render's text (the output, or a block captured by set / filter / a macro call).
  static void write(std::string& out, const std::string& text) {
    check_string_size(int64_t(out.size() + text.size()));
    out += text;
  }

  // ---- statements ----

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow = exec(*stmt, scope, out);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

  // The processor time this thread has used: a render runs on one thread, and counting its own time
  // rather than the wall clock's gives it the same budget on a busy server as on an idle one.
  static std::chrono::nanoseconds thread_cpu_time() {
    timespec now{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
    return std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec);
  }

  // Every 64 steps (statements and expressions) the clock is read (a system call of well under a
  // microsecond); past kMaxRenderTime the render stops. One step may walk a whole request list (a
  // slice, `in`), so the clock is read often.
  void step() {
    if ((++steps_ & 63) == 0 && thread_cpu_time() > deadline_)
      template_fail("the render took more than ", kMaxRenderTime.count(), " seconds (the template limit)");
  }

  Flow exec(const Stmt& stmt, const ScopePtr& scope, std::string& out) {
    try {
      step();
      NestingGuard guard(eval_depth_, kMaxEvalDepth, "template evaluation nested too deeply");
      return std::visit([&](const auto& node) { return run(node, scope, out); }, stmt.node);
    } catch (TemplateError& e) {
      if (e.line == 0) e.line = stmt.line;
      throw;
    }
  }

  Flow run(const TextStmt& s, const ScopePtr&, std::string& out) {
    write(out, s.text);
    return Flow::Normal;
  }

  Flow run(const OutputStmt& s, const ScopePtr& scope, std::string& out) {
    write(out, to_str(eval(*s.value, scope)));
    return Flow::Normal;
  }

  Flow run(const IfStmt& s, const ScopePtr& scope, std::string& out) {
    for (const auto& [test, body] : s.branches)
      if (truthy(eval(*test, scope))) return exec(body, scope, out);
    return exec(s.otherwise, scope, out);
  }

  Flow run(const ForStmt& s, const ScopePtr& scope, std::string& out) {
    loop_over(s, eval(*s.iterable, scope), scope, out, 1);
    return Flow::Normal;
  }

  Flow run(const SetStmt& s, const ScopePtr& scope, std::string&) {
    assign(s.target, eval(*s.value, scope), *scope);
    return Flow::Normal;
  }

  Flow run(const SetBlockStmt& s, const ScopePtr& scope, std::string&) {
    std::string text;
    exec(s.body, scope, text);
    assign(s.target, s.filter ? apply_filter_chain(*s.filter, text, scope) : Value(text), *scope);
    return Flow::Normal;
  }

  Flow run(const MacroStmt& s, const ScopePtr& scope, std::string&) {
    // A weak reference: the scope holds the macro, so a strong one would keep both alive forever.
    std::weak_ptr<Scope> defined_in = scope;
    scope->set(s.name, Value::function(s.name, [this, &s, defined_in](const Args& args) {
                 return call_macro(s, defined_in, args);
               }));
    return Flow::Normal;
  }

  Flow run(const FilterBlockStmt& s, const ScopePtr& scope, std::string& out) {
    std::string text;
    exec(s.body, scope, text);
    write(out, to_str(apply_filter_chain(*s.filter, text, scope)));
    return Flow::Normal;
  }

  Flow run(const WithStmt& s, const ScopePtr& scope, std::string& out) {
    auto inner = std::make_shared<Scope>(scope);
    for (size_t i = 0; i < s.targets.size(); ++i) assign(s.targets[i], eval(*s.values[i], scope), *inner);
    return exec(s.body, inner, out);
  }

  Flow run(const LoopControlStmt& s, const ScopePtr&, std::string&) {
    return s.is_break ? Flow::Break : Flow::Continue;
  }

  Flow run(const GenerationStmt& s, const ScopePtr& scope, std::string& out) { return exec(s.body, scope, out); }

  void assign(const Target& target, const Value& value, Scope& scope) {
    if (!target.attribute.empty()) {
      const Value* ns = scope.find(target.names[0]);
      if (!ns || ns->kind() != Value::Kind::Object || !ns->as_object().assignable)
        template_fail("cannot assign attribute on non-namespace object");
      ns->as_object().attributes.set(Value(target.attribute), value);
      return;
    }
    if (!target.unpack) {
      scope.set(target.names[0], value);
      return;
    }
    ValueList parts = iterate(value);
    size_t n = target.names.size();
    if (parts.size() > n) template_fail("too many values to unpack (expected ", n, ")");
    if (parts.size() < n) template_fail("not enough values to unpack (expected ", n, ", got ", parts.size(), ")");
    for (size_t i = 0; i < n; ++i) scope.set(target.names[i], parts[i]);
  }

  // Counts one loop iteration against kMaxLoopIterations.
  void count_iteration() {
    if (++loop_iterations_ > kMaxLoopIterations)
      template_fail("more than ", kMaxLoopIterations, " loop iterations (the template limit)");
  }

  // Runs a for loop over `iterable`; recursive loops call this again through `loop(children)`.
  void loop_over(const ForStmt& s, const Value& iterable, const ScopePtr& scope, std::string& out, int depth) {
    ValueList items = iterate(iterable);
    if (s.filter) {  // `for x in xs if cond`: filtered first, so loop.length counts what is kept
      ValueList kept;
      for (const Value& item : items) {
        count_iteration();
        auto probe = std::make_shared<Scope>(scope);
        assign(s.target, item, *probe);
        if (truthy(eval(*s.filter, probe))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(s.otherwise, scope, out);
      return;
    }
    // One LoopContext for the whole loop, its attributes moved on each iteration: jinja2's
    // runtime.LoopContext is one object too, so a `loop` kept past its iteration reads the current one.
    // Building a fresh one per iteration made an empty loop body cost microseconds.
    auto index = std::make_shared<int64_t>(0);
    auto loop = loop_context(s, items, index, depth, scope);
    // Its previtem / nextitem are items of `iterable`, so they nest no deeper than the iterable's own items.
    Value loop_value = Value::object(loop, std::max(iterable.depth() - 1, 0));
    for (size_t i = 0; i < items.size(); ++i) {
      count_iteration();
      *index = static_cast<int64_t>(i);
      move_loop_context(loop->attributes, items, i);
      auto iteration = std::make_shared<Scope>(scope);
      assign(s.target, items[i], *iteration);
      iteration->set("loop", loop_value);
      if (exec(s.body, iteration, out) == Flow::Break) break;
    }
  }

  // The attributes of a LoopContext that change from one iteration to the next, in the order
  // move_loop_context sets them.
  static constexpr const char* kLoopAttributes[] = {"index", "index0",   "revindex", "revindex0",
                                                    "first", "last",     "previtem", "nextitem"};

  // jinja2's LoopContext over `items`; *index is the iteration it describes (move_loop_context sets the
  // attributes that follow it).
  std::shared_ptr<Object> loop_context(const ForStmt& s, const ValueList& items, std::shared_ptr<const int64_t> index,
                                       int depth, const ScopePtr& scope) {
    auto loop = new_object("LoopContext", /*assignable=*/false);
    Dict& a = loop->attributes;
    for (const char* name : kLoopAttributes) a.set(Value(name), Value());
    a.set("length", static_cast<int64_t>(items.size()));
    a.set("depth", depth);
    a.set("depth0", depth - 1);
    a.set("cycle", Value::function("loop.cycle", [index](const Args& args) {
            if (args.positional.empty()) template_fail("no items for cycling given");
            return args.positional[*index % static_cast<int64_t>(args.positional.size())];
          }));
    if (s.recursive) {
      std::weak_ptr<Scope> outer = scope;
      loop->call = [this, &s, outer, depth](const Args& args) {
        if (args.positional.size() != 1 || !args.keyword.empty()) template_fail("loop() takes one argument");
        ScopePtr parent = outer.lock();
        if (!parent) template_fail("a recursive loop was called after it ended");
        NestingGuard guard(call_depth_, kMaxCallDepth, "maximum recursion depth exceeded");
        std::string text;
        loop_over(s, args.positional[0], parent, text, depth + 1);
        return Value(text);
      };
    }
    return loop;
  }

  // Sets the attributes of a LoopContext that follow the iteration (the first eight, kLoopAttributes)
  // to item i's, by position: a loop of a million empty iterations takes well under a second.
  static void move_loop_context(Dict& a, const ValueList& items, size_t i) {
    int64_t n = static_cast<int64_t>(items.size()), index = static_cast<int64_t>(i);
    a.value_at(0) = index + 1;
    a.value_at(1) = index;
    a.value_at(2) = n - index;
    a.value_at(3) = n - index - 1;
    a.value_at(4) = index == 0;
    a.value_at(5) = index == n - 1;
    a.value_at(6) = i > 0 ? items[i - 1] : Value::undefined("there is no previous item");
    a.value_at(7) = index + 1 < n ? items[i + 1] : Value::undefined("there is no next item");
  }

  Value call_macro(const MacroStmt& m, const std::weak_ptr<Scope>& defined_in, const Args& args) {
    ScopePtr parent = defined_in.lock();
    if (!parent) template_fail("macro '", m.name, "' was called after the scope defining it ended");
    NestingGuard guard(call_depth_, kMaxCallDepth, "maximum recursion depth exceeded");
    auto scope = std::make_shared<Scope>(parent);
    size_t n = m.params.size();
    if (args.positional.size() > n && !m.uses_varargs)
      template_fail("macro '", m.name, "' takes not more than ", n, " argument(s)");
    std::vector<bool> given(n, false);
    for (size_t i = 0; i < n && i < args.positional.size(); ++i) {
      scope->set(m.params[i], args.positional[i]);
      given[i] = true;
    }
    Dict extra_keywords;
    for (const auto& [name, value] : args.keyword) {
      auto it = std::find(m.params.begin(), m.params.end(), name);
      if (it == m.params.end()) {
        if (!m.uses_kwargs) template_fail("macro '", m.name, "' takes no keyword argument '", name, "'");
        extra_keywords.set(Value(name), value);
        continue;
      }
      size_t i = it - m.params.begin();
      if (given[i]) template_fail("macro '", m.name, "' got multiple values for argument '", name, "'");
      scope->set(name, value);
      given[i] = true;
    }
    // Defaults are evaluated at call time in the macro's scope, so they may use earlier parameters.
    size_t first_default = n - m.defaults.size();
    for (size_t i = 0; i < n; ++i) {
      if (given[i]) continue;
      scope->set(m.params[i], i >= first_default
                                  ? eval(*m.defaults[i - first_default], scope)
                                  : Value::undefined(cat("parameter '", m.params[i], "' was not provided")));
    }
    if (m.uses_varargs) {
      ValueList extra;
      for (size_t i = n; i < args.positional.size(); ++i) extra.push_back(args.positional[i]);
      scope->set("varargs", Value::tuple(std::move(extra)));
    }
    if (m.uses_kwargs) scope->set("kwargs", Value::dict(std::move(extra_keywords)));
    std::string out;
    exec(m.body, scope, out);
    return out;
  }

  // ---- expressions ----

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      step();
      NestingGuard guard(eval_depth_, kMaxEvalDepth, "template evaluation nested too deeply");
      Value v = std::visit([&](const auto& node) { return evaluate(node, scope, e.line); }, e.node);
      // Growth beyond the checks at the source (repeat, padding, ...): concatenation and the like.
      if (v.is_string()) check_string_size(int64_t(v.as_string().size()));
      return v;
    } catch (TemplateError& err) {
      if (err.line == 0) err.line = e.line;
      throw;
    }
  }

  Value evaluate(const Literal& e, const ScopePtr&, int) { return e.value; }

  Value evaluate(const NameRef& e, const ScopePtr& scope, int) {
    if (const Value* v = scope->find(e.name)) return *v;
    return Value::undefined(cat("'", e.name, "' is undefined"));
  }

  Value evaluate(const ListLiteral& e, const ScopePtr& scope, int) {
    ValueList items;
    for (const auto& item : e.items) items.push_back(eval(*item, scope));
    return e.is_tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
  }

  Value evaluate(const DictLiteral& e, const ScopePtr& scope, int) {
    Dict d;
    for (const auto& [key_expr, value_expr] : e.items) {
      Value key = eval(*key_expr, scope);
      if (key.kind() == Value::Kind::List || key.kind() == Value::Kind::Dict)
        template_fail("unhashable type: '", type_name(key), "'");
      d.set(std::move(key), eval(*value_expr, scope));
    }
    return Value::dict(std::move(d));
  }

  Value evaluate(const GetAttr& e, const ScopePtr& scope, int) { return get_attribute(eval(*e.object, scope), e.attr); }

  Value evaluate(const GetItem& e, const ScopePtr& scope, int) {
    Value object = eval(*e.object, scope);
    return get_item(object, eval(*e.key, scope));
  }

  Value evaluate(const SliceExpr& e, const ScopePtr& scope, int) {
    Value object = eval(*e.object, scope);
    auto part = [&](const ExprPtr& p) { return p ? eval(*p, scope) : Value::none(); };
    Value start = part(e.start), stop = part(e.stop), step = part(e.step);
    return slice(object, start, stop, step);
  }

  Value evaluate(const CallExpr& e, const ScopePtr& scope, int) {
    Value callee = eval(*e.callee, scope);
    Args args = eval_args(e.args, scope);
    if (callee.kind() == Value::Kind::Function) return callee.as_function().call(args);
    if (callee.kind() == Value::Kind::Object && callee.as_object().call) return callee.as_object().call(args);
    if (callee.is_undefined()) callee.fail_undefined();
    template_fail("'", type_name(callee), "' object is not callable");
  }

  Value evaluate(const FilterExpr& e, const ScopePtr& scope, int) {
    return apply_filter(e, e.input ? eval(*e.input, scope) : Value(), scope);
  }

  Value evaluate(const TestExpr& e, const ScopePtr& scope, int) {
    TestFunction test = find_test(e.name);
    if (!test) template_fail("unknown test '", e.name, "'");
    Value input = eval(*e.input, scope);
    return test(input, eval_args(e.args, scope));
  }

  Value evaluate(const UnaryExpr& e, const ScopePtr& scope, int) {
    Value v = eval(*e.operand, scope);
    if (e.op == UnaryExpr::Op::Not) return !truthy(v);
    if (v.is_undefined()) v.fail_undefined();
    if (!v.is_number())
      template_fail("bad operand type for unary ", e.op == UnaryExpr::Op::Negate ? "-" : "+", ": '", type_name(v), "'");
    if (e.op == UnaryExpr::Op::Plus) return v.kind() == Value::Kind::Float ? v : Value(v.as_int());
    if (v.kind() == Value::Kind::Float) return -v.as_float();
    return checked(sub_overflows, 0, v.as_int());
  }

  Value evaluate(const BinaryExpr& e, const ScopePtr& scope, int) {
    Value left = eval(*e.left, scope);
    if (e.op == "and") return truthy(left) ? eval(*e.right, scope) : left;
    if (e.op == "or") return truthy(left) ? left : eval(*e.right, scope);
    return arithmetic(e.op, left, eval(*e.right, scope));
  }

  Value evaluate(const CompareExpr& e, const ScopePtr& scope, int) {
    Value left = eval(*e.first, scope);
    for (const auto& [op, operand] : e.rest) {
      Value right = eval(*operand, scope);
      if (!compare(op, left, right)) return false;
      left = std::move(right);
    }
    return true;
  }

  Value evaluate(const ConcatExpr& e, const ScopePtr& scope, int) {
    std::string out;
    for (const auto& part : e.parts) write(out, to_str(eval(*part, scope)));
    return out;
  }

  Value evaluate(const CondExpr& e, const ScopePtr& scope, int line) {
    if (truthy(eval(*e.test, scope))) return eval(*e.then, scope);
    if (e.otherwise) return eval(*e.otherwise, scope);
    return Value::undefined(
        cat("the inline if-expression on line ", line, " evaluated to false and no else section was defined."));
  }

  Args eval_args(const CallArgs& call, const ScopePtr& scope) {
    Args args;
    for (const auto& e : call.positional) args.positional.push_back(eval(*e, scope));
    if (call.star_args)
      for (Value& v : iterate(eval(*call.star_args, scope))) args.positional.push_back(std::move(v));
    for (const auto& [name, e] : call.keyword) args.keyword.emplace_back(name, eval(*e, scope));
    if (call.star_kwargs) {
      Value extra = eval(*call.star_kwargs, scope);
      if (extra.kind() != Value::Kind::Dict)
        template_fail("argument after ** must be a mapping, not ", type_name(extra));
      for (const auto& [k, v] : extra.as_dict().entries()) {
        if (!k.is_string()) template_fail("keywords must be strings");
        args.keyword.emplace_back(k.as_string(), v);
      }
    }
    return args;
  }

  Value apply_filter(const FilterExpr& f, const Value& input, const ScopePtr& scope) {
    FilterFunction filter = find_filter(f.name);
    if (!filter) template_fail("unknown filter '", f.name, "'");
    return filter(input, eval_args(f.args, scope));
  }

  // The filters of `{% filter a | b %}` / `{% set x | a %}` applied to the block's text.
  Value apply_filter_chain(const Expr& chain, const Value& text, const ScopePtr& scope) {
    try {
      const auto& f = std::get<FilterExpr>(chain.node);
      Value input = f.input ? apply_filter_chain(*f.input, text, scope) : text;
      return apply_filter(f, input, scope);
    } catch (TemplateError& err) {
      if (err.line == 0) err.line = chain.line;
      throw;
    }
  }

  // Keeps a weak reference to a namespace for ~Interpreter, dropping those already freed whenever the
  // list doubles, so a loop making a namespace per message keeps the list short.
  void remember(const std::shared_ptr<Object>& ns) {
    if (namespaces_.size() == namespaces_.capacity())
      std::erase_if(namespaces_, [](const std::weak_ptr<Object>& made) { return made.expired(); });
    namespaces_.push_back(ns);
  }

  std::vector<std::weak_ptr<Object>> namespaces_;  // made by this render
  int call_depth_ = 0;        // macro and recursive-loop calls in progress (kMaxCallDepth)
  int eval_depth_ = 0;        // statements and expressions in progress (kMaxEvalDepth)
  int64_t loop_iterations_ = 0;  // so far in this render (kMaxLoopIterations)
  uint64_t steps_ = 0;           // statements and expressions evaluated so far
  std::chrono::nanoseconds deadline_{};  // thread_cpu_time() at which the render has used kMaxRenderTime
};

}  // namespace

Template::Template(std::string_view source, std::string name) : name_(std::move(name)) {
  if (!utf8::is_valid(source)) fail(name_, " is not valid UTF-8");
  try {
    body_ = std::make_shared<const Body>(parse_template(source));
  } catch (const TemplateError& e) {
    fail(name_, " line ", e.line, ": syntax error: ", e.what());
  }
}

std::string Template::render(const Dict& variables) const {
  try {
    return Interpreter().render(*body_, variables);
  } catch (const TemplateError& e) {
    std::string message = e.what();
    for (char& c : message)  // errors are one line; template-supplied messages may hold newlines
      if (c == '\n') c = ' ';
    fail(name_, " line ", e.line, ": ", message);
  }
}

}  // namespace sparrow::jinja
