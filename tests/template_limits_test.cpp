// The limits of a template render (template/jinja_limits.h): a hostile request or template gets an
// error naming the limit, never a stack overflow, a hang or an exhausted memory, while everything real
// chat templates do stays well inside them.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/json_input.h"
#include "template/chat_template.h"
#include "template/jinja_limits.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using sparrow::ChatTemplate;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;
using namespace sparrow::jinja;

namespace {

std::string render(const std::string& source, const json& variables = json::object()) {
  json request = {{"messages", json::array()}, {"add_generation_prompt", false}, {"chat_template_kwargs", variables}};
  return ChatTemplate({{"default", source}}, {}).render(request);
}

std::string repeated(const std::string& piece, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += piece;
  return out;
}

// [[[ ... 1 ... ]]] nested `depth` deep, as JSON.
json nested_list(int depth) { return json::parse(repeated("[", depth) + "1" + repeated("]", depth)); }

}  // namespace

// ---- request values ----

TEST(TemplateLimits, RequestValuesNestedTooDeepAreRefused) {
  // The server refuses such bodies before parsing (kMaxJsonDepth); the renderer does not rely on it.
  const int too_deep = kMaxValueDepth + 10;
  json request = {{"messages", json::array({{{"role", "user"}, {"content", nested_list(too_deep)}}})}};
  EXPECT_TRUE(mentions(error_message([&] {
                         ChatTemplate({{"default", "{{ messages }}"}}, {}).render(request);
                       }),
                       {"nested more than 256 levels"}));
  // Whatever a request may hold renders: a value as deep as kMaxJsonDepth allows, inside messages.
  request["messages"][0]["content"] = nested_list(sparrow::kMaxJsonDepth);
  std::string rendered = ChatTemplate({{"default", "{{ messages[0].content|tojson }}"}}, {}).render(request);
  EXPECT_EQ(rendered, repeated("[", sparrow::kMaxJsonDepth) + "1" + repeated("]", sparrow::kMaxJsonDepth));
}

TEST(TemplateLimits, ToolCallArgumentsNestedTooDeepAreRefused) {
  json request = {
      {"messages",
       json::array({{{"role", "assistant"},
                     {"tool_calls", json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}})}}})}};
  request["messages"][0]["tool_calls"][0]["function"]["arguments"] =
      "{\"a\": " + repeated("[", 30000) + repeated("]", 30000) + "}";  // never parsed whole by the test itself
  EXPECT_TRUE(mentions(error_message([&] {
                         ChatTemplate({{"default", "x"}}, {}).render(request);
                       }),
                       {"messages[0].tool_calls[0].function.arguments nests", "128 levels"}));
}

// A real template recursing over a call's arguments (MiniMax-M3's to_xml macro, one call per level)
// renders the deepest arguments a request may carry.
TEST(TemplateLimits, RealTemplateRecursesAsDeepAsRequestsNest) {
  const fs::path data = fs::path(SPARROW_SOURCE_DIR) / "tests/data/templates";
  std::ifstream in(data / "minimax-m3.jinja");
  std::stringstream source;
  source << in.rdbuf();
  json arguments = {{"v", 1}};
  for (int i = 0; i < sparrow::kMaxJsonDepth - 8; ++i) arguments = {{"k", arguments}};
  json request = {
      {"messages",
       json::array({{{"role", "user"}, {"content", "hi"}},
                    {{"role", "assistant"},
                     {"content", ""},
                     {"tool_calls",
                      json::array({{{"type", "function"}, {"function", {{"name", "f"}, {"arguments", arguments}}}}})}},
                    {{"role", "tool"}, {"content", "ok"}}})}};
  std::string prompt;
  ASSERT_EQ(error_message([&] { prompt = ChatTemplate({{"default", source.str()}}, {}).render(request); }), "");
  EXPECT_NE(prompt.find("<v>1"), std::string::npos);
}

// Every real template renders the deepest request the server accepts (tools[].function.parameters and
// a tool call's arguments nested up to kMaxJsonDepth in the body): the template limits leave room for
// whatever a client may send.
TEST(TemplateLimits, RealTemplatesRenderTheDeepestRequests) {
  const fs::path data = fs::path(SPARROW_SOURCE_DIR) / "tests/data/templates";
  auto load = [&](const std::string& name) {
    std::ifstream in(data / name);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  json models = json::parse(load("models.json"));
  json request;
  for (const json& conversation : json::parse(load("conversations.json")))
    if (conversation["name"] == "tool_call_string_arguments") request = conversation["request"];
  ASSERT_TRUE(request.is_object());
  // The body, tools, [0], function, parameters and properties take 6 levels; each schema level 2 more.
  json schema = {{"type", "string"}};
  for (int level = 7; level + 2 <= sparrow::kMaxJsonDepth; level += 2)
    schema = {{"type", "object"}, {"properties", {{"x", schema}}}};
  request["tools"][0]["function"]["parameters"]["properties"]["deep"] = schema;
  // The body, messages, [1], tool_calls, [0], function and arguments take 7 levels.
  json arguments = {{"city", "Paris"}};
  for (int level = 7; level < sparrow::kMaxJsonDepth; ++level) arguments = {{"x", arguments}};
  request["messages"][1]["tool_calls"][0]["function"]["arguments"] = arguments;
  ASSERT_EQ(sparrow::parse_json_input<json>(request.dump()).status, sparrow::JsonInput<json>::Status::Ok);
  for (const auto& [name, spec] : models.items()) {
    TempDir dir;
    dir.write("tokenizer_config.json", spec["tokenizer_config"].dump());
    dir.write("chat_template.jinja", load(spec["template"].get<std::string>()));
    std::string prompt;
    EXPECT_EQ(error_message([&] { prompt = ChatTemplate::load(dir.path()).render(request); }), "") << name;
    EXPECT_NE(prompt.find("Paris"), std::string::npos) << name;
  }
}

// A dict of 200,000 keys (a request may send one) is built and read in linear time.
TEST(TemplateLimits, LargeDictsAreIndexed) {
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? ", \"k" : "\"k") + std::to_string(i) + "\": " + std::to_string(i);
  json big = sparrow::parse_json_input<json>(text + "}").value;  // json's own insertion is quadratic too
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(render("{{ big.k199999 }} {{ big|length }} {{ big['k7'] }}", {{"big", big}}), "199999 200000 7");
  // Quadratic work would take minutes; linear takes well under a second even on a slow machine.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// ---- template syntax ----

TEST(TemplateLimits, SyntaxNestedTooDeepIsAnError) {
  const std::vector<std::string> too_deep = {
      "{{ " + repeated("(", 50000) + "1" + repeated(")", 50000) + " }}",
      "{{ " + repeated("[", 150) + "1" + repeated("]", 150) + " }}",
      "{{ " + repeated("{'a': ", 150) + "1" + repeated("}", 150) + " }}",
      "{{ " + repeated("-", 150) + "1 }}",
      "{{ " + repeated("not ", 150) + "1 }}",
      "{{ 1" + repeated(" + 1", 200000) + " }}",
      "{{ x" + repeated(".a", 150) + " }}",
      "{{ x" + repeated("|string", 150) + " }}",
      "{{ 1" + repeated(" if x else 1", 150) + " }}",
      "{{ f" + repeated("(f", 150) + repeated(")", 150) + " }}",
      repeated("{% if x %}", 150) + repeated("{% endif %}", 150),
  };
  for (const std::string& source : too_deep)
    EXPECT_TRUE(mentions(error_message([&] { render(source); }), {"syntax error", "100 levels"}))
        << source.substr(0, 40);
  // Real templates nest far less; 60 levels of each kind still parse and render.
  EXPECT_EQ(render("{{ " + repeated("(", 60) + "1" + repeated(")", 60) + " }}"), "1");
  EXPECT_EQ(render("{{ 1" + repeated(" + 1", 60) + " }}"), "61");
  EXPECT_EQ(render(repeated("{% if true %}", 60) + "in" + repeated("{% endif %}", 60)), "in");
}

// ---- recursion ----

TEST(TemplateLimits, MacroRecursionIsBounded) {
  const std::string countdown =
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% else %}bottom{% endif %}{% endmacro %}{{ f(depth) }}";
  EXPECT_EQ(render(countdown, {{"depth", kMaxCallDepth - 1}}), "bottom");
  EXPECT_TRUE(mentions(error_message([&] {
                         render(countdown, {{"depth", kMaxCallDepth}});
                       }),
                       {"maximum recursion depth exceeded", "256"}));
  // Recursive loops count as calls too.
  EXPECT_TRUE(mentions(error_message([&] { render("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}"); }),
                       {"maximum recursion depth exceeded"}));
}

// Deep recursion through deep expressions: every level within its own limit, the product past what the
// stack can hold, and caught by kMaxEvalDepth.
TEST(TemplateLimits, EvaluationDepthIsBounded) {
  const std::string deep_call = "f(n - 1)" + repeated(" + ''", 90);  // ((f(n - 1) + '') + '') + ...
  const std::string source =
      "{% macro f(n) %}{% if n > 0 %}{{ " + deep_call + " }}{% endif %}{% endmacro %}{{ f(200) }}";
  EXPECT_TRUE(mentions(error_message([&] { render(source); }), {"nested too deeply", "2048"}));
}

// ---- loops and sizes ----

// The inner list is built once, so the iterations are nearly all the work: a million of them must end
// on the loop limit well inside the render time, even in the sanitized build.
TEST(TemplateLimits, LoopIterationsAreBounded) {
  EXPECT_TRUE(mentions(error_message([] {
                         render("{% set xs = range(100000) %}{% for i in xs %}{% for j in xs %}{% endfor %}{% endfor %}");
                       }),
                       {"more than 1000000 loop iterations"}));
  EXPECT_EQ(render("{% set xs = range(999) %}{% for i in range(1000) %}{% for j in xs %}{% endfor %}{% endfor %}ok"),
            "ok");
}

// A template quadratic in the request (Kimi K3's gathers a run of tool messages this way) on a request
// made to exploit it: 300,000 items concatenated one by one would copy 4.5e10 items, hours of work.
TEST(TemplateLimits, RenderTimeIsBounded) {
  json items = json::array();
  for (int i = 0; i < 300000; ++i) items.push_back(i);
  // The limit counts the rendering thread's CPU time (so does this check: a loaded machine stretches
  // the wall-clock time, not the work).
  auto thread_cpu_time = [] {
    timespec now{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
    return std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec);
  };
  const auto start = thread_cpu_time();
  EXPECT_TRUE(mentions(error_message([&] {
                         render(
                             "{% set ns = namespace(l=[]) %}{% for x in items %}{% set ns.l = ns.l + [x] %}"
                             "{% endfor %}{{ ns.l|length }}",
                             {{"items", items}});
                       }),
                       {"the render took more than 10 seconds"}));
  EXPECT_LT(thread_cpu_time() - start, kMaxRenderTime + std::chrono::seconds(5));
}

TEST(TemplateLimits, RangeIsCappedLikeTheSandbox) {
  EXPECT_EQ(render("{{ range(100000)|length }}"), "100000");
  EXPECT_TRUE(mentions(error_message([] { render("{{ range(100001)|length }}"); }), {"MAX_RANGE (100000)"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ range(0, 9223372036854775807, 1)|length }}"); }), {"MAX_RANGE"}));
  // A step past the end of int64 ends the range rather than wrapping around.
  EXPECT_EQ(render("{{ range(0, 9223372036854775807, 9223372036854775000)|list }}"), "[0, 9223372036854775000]");
}

TEST(TemplateLimits, StringsAndListsCannotExplode) {
  const std::vector<std::string> string_blowups = {
      "{{ 'a' * 1000000000000 }}",
      "{{ 'ab' * 40000000 }}",
      "{{ 'x'|center(1000000000000) }}",
      "{{ 'x'.center(1000000000000) }}",
      "{{ 'x'.ljust(100000000) }}",
      "{{ 'x'.zfill(1000000000000) }}",
      "{{ 'a\nb'|indent(1000000000000) }}",
      "{{ '%1000000000000s' % 'x' }}",
      "{{ '%.100000000f' % 1.0 }}",
      "{{ '%99999999999999999999999d' % 1 }}",
      "{{ [1, [2]]|tojson(indent=1000000000000) }}",
      "{% set s = 'x' * 1000000 %}{{ s|replace('x', s) }}",
      "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
      "{% set s = 'x' * 1000000 %}{{ (range(100)|map('string')|list)|join(s) }}",
      "{% set s = 'x' * 1000000 %}{{ s.join(range(100)|map('string')|list) }}",
      "{% set s = 'x' * 1000000 %}{{ ('{0}' * 100).format(s) }}",
      "{% set s = 'x' * 1000000 %}{{ ('%(a)s' * 100)|format(a=s) }}",
      "{% set s = 'x' * 10000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s }}",
      "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
  };
  for (const std::string& source : string_blowups)
    EXPECT_TRUE(mentions(error_message([&] { render(source); }), {"exceeds the template limit of 67108864 bytes"}))
        << source.substr(0, 60);
  for (const std::string& source :
       {"{{ [1] * 1000000000000 }}", "{{ ([1, 2] * 600000)|length }}", "{{ [1]|batch(1000000000000, fill_with=0) }}",
        "{% set l = [1] * 1000000 %}{{ (l + l)|length }}",
                                    "{{ ('a' * 2000000)|list|length }}", "{{ ('a,' * 1100000).split(',')|length }}",
                                    "{{ ('a,' * 1100000).rsplit(',')|length }}", "{{ ('a ' * 1100000).split()|length }}",
                                    "{{ ('a\\n' * 1100000).splitlines()|length }}"})
    EXPECT_TRUE(mentions(error_message([&] { render(source); }), {"exceeds the template limit of 1048576 items"}))
        << source;
  // Near the limits everything still works.
  EXPECT_EQ(render("{{ ('ab' * 1000000)|length }} {{ ([1, 2] * 500000)|length }}"), "2000000 1000000");
}

TEST(TemplateLimits, OutputIsBounded) {
  EXPECT_TRUE(mentions(error_message([] { render("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"); }),
                       {"exceeds the template limit of 67108864 bytes"}));
  EXPECT_TRUE(
      mentions(error_message([] { render("{% for i in range(100000) %}" + repeated("y", 1000) + "{% endfor %}"); }),
               {"exceeds the template limit"}));
}

// ---- values a template builds ----

TEST(TemplateLimits, ValuesBuiltTooDeepAreAnError) {
  EXPECT_TRUE(mentions(error_message([] {
                         render(
                             "{% set ns = namespace(v=1) %}{% for i in range(100000) %}{% set ns.v = [ns.v] %}"
                             "{% endfor %}");
                       }),
                       {"nested more than 256 levels"}));
  EXPECT_TRUE(mentions(error_message([] {
                         render(
                             "{% set ns = namespace(v=1) %}{% for i in range(300) %}{% set ns.v = {'a': ns.v} %}"
                             "{% endfor %}");
                       }),
                       {"nested more than 256 levels"}));
}

// Namespaces change after they are built: a chain of 100,000 of them is freed without recursing, and
// printing one that holds itself is an error, not an endless recursion.
TEST(TemplateLimits, NamespaceChainsAndCycles) {
  const std::string chain =
      "{% set st = namespace(tail=namespace(), count=0) %}{% set head = st.tail %}"
      "{% for i in range(100000) %}{% set t = namespace() %}{% set cur = st.tail %}{% set cur.next = t %}"
      "{% set st.tail = t %}{% set st.count = st.count + 1 %}{% endfor %}";
  EXPECT_EQ(render(chain + "{{ st.count }}"), "100000");
  EXPECT_TRUE(mentions(error_message([&] { render(chain + "{{ head }}"); }), {"nested more than 256 levels"}));
  EXPECT_TRUE(mentions(error_message([] { render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}"); }),
                       {"nested more than 256 levels"}));
}
