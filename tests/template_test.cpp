// Chat templates: sparrow's Jinja interpreter against renders made by Python jinja2 the way
// transformers' apply_chat_template makes them (tools/render_reference.py wrote the expectations;
// tests/template_live_test.py re-checks them live when jinja2 is installed).
//   - every real template of tests/data/templates on every conversation of conversations.json;
//   - one small template per interpreter feature (snippets.json);
//   - the pieces jinja2 does not see: Python number formatting, model-folder loading, request
//     handling, error lines, and the `sparrow render` command.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "template/chat_template.h"
#include "template/jinja_template.h"
#include "template/py_text.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using sparrow::ChatTemplate;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace {

const fs::path kData = fs::path(SPARROW_SOURCE_DIR) / "tests/data/templates";

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

json load_json(const fs::path& path) { return json::parse(slurp(path)); }

// A model folder as transformers reads it: tokenizer_config.json plus chat_template.jinja.
void write_model(const TempDir& dir, const json& tokenizer_config, const std::string& template_source) {
  dir.write("tokenizer_config.json", tokenizer_config.dump());
  dir.write("chat_template.jinja", template_source);
}

// Renders `request` and returns {"prompt": ...} or {"error": ...}, the shape of the expectations.
json outcome(const ChatTemplate& chat_template, const json& request) {
  try {
    return json{{"prompt", chat_template.render(request)}};
  } catch (const sparrow::Error& e) {
    return json{{"error", e.what()}};
  }
}

// Compares an outcome with an expectation; an expected error must be reported with jinja2's message
// (or the snippet's "sparrow_error" wording) on one line.
::testing::AssertionResult same_outcome(const json& got, const json& expected) {
  if (expected.contains("prompt")) {
    if (!got.contains("prompt"))
      return ::testing::AssertionFailure() << "expected a prompt, got the error: " << got["error"].get<std::string>();
    std::string a = got["prompt"], b = expected["prompt"];
    if (a == b) return ::testing::AssertionSuccess();
    size_t at = std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
    return ::testing::AssertionFailure() << "prompts differ at byte " << at
                                         << ":\n  expected: " << json(b.substr(at > 40 ? at - 40 : 0, 80)).dump()
                                         << "\n  sparrow:  " << json(a.substr(at > 40 ? at - 40 : 0, 80)).dump();
  }
  if (!got.contains("error"))
    return ::testing::AssertionFailure() << "expected the error '" << expected["error"].get<std::string>()
                                         << "', got a prompt";
  std::string wording = expected.value("sparrow_error", expected["error"].get<std::string>());
  return mentions(got["error"], {wording});
}

json request_with(const std::string& variables_json) {
  return json{{"messages", json::array()},
              {"add_generation_prompt", false},
              {"chat_template_kwargs", json::parse(variables_json)}};
}

std::string render(const std::string& source, const json& request = request_with("{}")) {
  return ChatTemplate({{"default", source}}, {}).render(request);
}

}  // namespace

// ---- the real templates on the committed conversations ----

class ModelTemplate : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelTemplate, RendersEveryConversationLikeJinja2) {
  const std::string model = GetParam();
  json spec = load_json(kData / "models.json")[model];
  TempDir dir;
  write_model(dir, spec["tokenizer_config"], slurp(kData / spec["template"].get<std::string>()));
  ChatTemplate chat_template = ChatTemplate::load(dir.path());
  json expected = load_json(kData / "expected" / (model + ".json"));
  json conversations = load_json(kData / "conversations.json");
  ASSERT_EQ(expected.size(), conversations.size()) << "run tools/render_reference.py";
  for (const json& c : conversations) {
    const std::string name = c["name"];
    ASSERT_TRUE(expected.contains(name)) << name << ": run tools/render_reference.py";
    EXPECT_TRUE(same_outcome(outcome(chat_template, c["request"]), expected[name])) << model << " / " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Templates, ModelTemplate,
                         ::testing::Values("deepseek-v3.2", "kimi-k2", "kimi-k2-thinking", "kimi-k3", "minimax-m2",
                                           "minimax-m3"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

TEST(TemplateData, CoversEveryTemplateFileAndEnoughConversations) {
  json models = load_json(kData / "models.json");
  size_t templates = 0;
  for (const auto& entry : fs::directory_iterator(kData))
    if (entry.path().extension() == ".jinja") ++templates;
  EXPECT_EQ(models.size(), templates);
  EXPECT_GE(load_json(kData / "conversations.json").size(), 30u);
}

// ---- interpreter features, one small template each ----

TEST(TemplateSnippets, RenderLikeJinja2) {
  json snippets = load_json(kData / "snippets.json");
  ASSERT_GT(snippets.size(), 100u);
  for (const json& s : snippets) {
    json request = s.contains("request") ? s["request"] : json{{"messages", json::array()}};
    json got;
    try {
      got = outcome(ChatTemplate({{"default", s["template"]}}, {}), request);
    } catch (const sparrow::Error& e) {  // syntax errors surface when the template is parsed
      got = json{{"error", e.what()}};
    }
    EXPECT_TRUE(same_outcome(got, s)) << "snippet " << s["name"].get<std::string>() << ": "
                                      << s["template"].get<std::string>();
  }
}

// ---- Python formatting the templates print through ----

TEST(PythonText, FloatReprIsShortestRoundTrip) {
  const std::pair<double, const char*> cases[] = {
      {0.1, "0.1"},
      {1.0, "1.0"},
      {-2.5, "-2.5"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {123456789012345678.0, "1.2345678901234568e+17"},
      {0.0001, "0.0001"},
      {0.00001, "1e-05"},
      {1e-7, "1e-07"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {0.1 + 0.2, "0.30000000000000004"},
      {2.5e21, "2.5e+21"},
      {100.0, "100.0"},
      {-0.0, "-0.0"},
      {9007199254740993.0, "9007199254740992.0"},
      {INFINITY, "inf"},
      {NAN, "nan"},
  };
  for (const auto& [value, text] : cases) EXPECT_EQ(sparrow::jinja::float_repr(value), text) << value;
}

TEST(PythonText, StringRepr) {
  using sparrow::jinja::string_repr;
  EXPECT_EQ(string_repr("it's"), "\"it's\"");
  EXPECT_EQ(string_repr("say \"hi\" it's"), "'say \"hi\" it\\'s'");
  EXPECT_EQ(string_repr("a\nb\t\\"), "'a\\nb\\t\\\\'");
  EXPECT_EQ(string_repr("\x01\x7f\xC2\xA0\xE2\x80\xA8\xC3\xA9"), "'\\x01\\x7f\\xa0\\u2028\xC3\xA9'");
}

// ---- errors name the template line ----

TEST(TemplateErrors, NameTheLine) {
  EXPECT_TRUE(mentions(error_message([] { render("a\n{{ 'x' }}\n{{ 'y' | foo }}"); }),
                       {"chat template line 3: unknown filter 'foo'"}));
  EXPECT_TRUE(mentions(error_message([] {
                         render(
                             "{% for m in messages %}\n{% if m.role == 'user' %}\n"
                             "{{ raise_exception('Conversation roles must alternate') }}\n{% endif %}{% endfor %}",
                             json{{"messages", {{{"role", "user"}, {"content", "x"}}}}});
                       }),
                       {"chat template line 3: raise_exception: Conversation roles must alternate"}));
  EXPECT_TRUE(mentions(error_message([] { render("ok\n\n{% if x %}never closed"); }),
                       {"chat template line 3: syntax error:", "never closed"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ x.y }}"); }), {"chat template line 1: 'x' is undefined"}));
  // A multi-line message from the template still makes a one-line error.
  EXPECT_TRUE(mentions(error_message([] { render("{{ raise_exception('two\\nlines') }}"); }), {"two lines"}));
}

// A builtin handed an argument of the wrong kind (found by tests/fuzz/fuzz_template_source): a
// one-line template error, as Python's TypeError, never a C++ exception escaping the renderer.
TEST(TemplateErrors, ArgumentsOfTheWrongKindAreErrors) {
  EXPECT_TRUE(mentions(error_message([] { render("{{ 'aaa' | replace('a', 'b', 'x') }}"); }),
                       {"chat template line 1: expected an int, got 'str'"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ 'aaa' | replace('a', 'b', nothing) }}"); }),
                       {"chat template line 1: 'nothing' is undefined"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ 'a' | indent([]) }}"); }), {"expected an int, got 'list'"}));
}

// Python's ints are unbounded and ours are int64: a float past that range (found by the fuzzer as
// '4777...772'|int) is a one-line error, not undefined behaviour; in range it truncates as Python does.
TEST(TemplateErrors, IntOfAHugeFloatIsAnError) {
  EXPECT_TRUE(mentions(error_message([] { render("{{ '47777777777777777777777777777777777777'|int }}"); }),
                       {"chat template line 1: int: ", "too large for a 64-bit integer"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ 1e300|int }}"); }), {"too large for a 64-bit integer"}));
  EXPECT_TRUE(mentions(error_message([] { render("{{ '%d' % 1e300 }}"); }), {"too large for a 64-bit integer"}));
  EXPECT_EQ(render("{{ -3.9e15|int }} {{ '-2.5'|int }} {{ '%d' % 7.9 }}"), "-3900000000000000 -2 7");
}

TEST(TemplateErrors, DeepRecursionIsAnErrorNotACrash) {
  EXPECT_TRUE(mentions(error_message([] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); }),
                       {"maximum recursion depth exceeded"}));
}

// ---- model folders ----

TEST(ChatTemplateLoad, TemplateInTokenizerConfigAndSpecialTokens) {
  TempDir dir;
  dir.write("tokenizer_config.json", json{{"chat_template",
                                           "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ "
                                           "image_token }}|{{ unk_token is defined }}"},
                                          {"bos_token", "<s>"},
                                          {"eos_token", {{"__type", "AddedToken"}, {"content", "</s>"}}},
                                          {"pad_token", nullptr},
                                          {"add_bos_token", true},
                                          {"extra_special_tokens", {{"image_token", "<img>"}}}}
                                         .dump());
  EXPECT_EQ(ChatTemplate::load(dir.path()).render(json{{"messages", json::array()}}), "<s>|</s>||<img>|False");
}

TEST(ChatTemplateLoad, JinjaFileWinsOverTokenizerConfig) {
  TempDir dir;
  write_model(dir, json{{"chat_template", "from config"}}, "from file\n");
  EXPECT_EQ(ChatTemplate::load(dir.path()).render(json{{"messages", json::array()}}), "from file");
}

TEST(ChatTemplateLoad, NamedTemplatesPickToolUseWhenToolsAreGiven) {
  TempDir dir;
  dir.write("tokenizer_config.json",
            json{{"chat_template",
                  {{{"name", "default"}, {"template", "plain"}}, {{"name", "tool_use"}, {"template", "tools"}}}}}
                .dump());
  ChatTemplate t = ChatTemplate::load(dir.path());
  EXPECT_EQ(t.render(json{{"messages", json::array()}}), "plain");
  EXPECT_EQ(t.render(json{{"messages", json::array()}, {"tools", json::array()}}), "tools");
}

TEST(ChatTemplateLoad, ProblemsAreOneLineErrors) {
  TempDir empty;
  EXPECT_TRUE(mentions(error_message([&] { ChatTemplate::load(empty.path()); }), {"no chat template"}));
  TempDir bad_json;
  bad_json.write("tokenizer_config.json", "{not json");
  EXPECT_TRUE(mentions(error_message([&] { ChatTemplate::load(bad_json.path()); }), {"tokenizer_config.json"}));
  TempDir bad_syntax;
  write_model(bad_syntax, json::object(), "{% for x in y %}");
  EXPECT_TRUE(mentions(error_message([&] { ChatTemplate::load(bad_syntax.path()); }), {"chat template line 1"}));
}

// ---- requests ----

TEST(ChatRequest, ToolCallArgumentsSentAsJsonTextAreParsed) {
  const std::string source =
      "{% for c in messages[0].tool_calls %}{{ c.function.arguments is mapping }}:{{ c.function.arguments|tojson }};"
      "{% endfor %}";
  json request = json::parse(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "{\"b\": [1, 2.0], \"a\": \"\\u00e9\"}"}},
      {"type": "function", "function": {"name": "g", "arguments": ""}},
      {"type": "function", "function": {"name": "h", "arguments": {"k": null}}}]}]})");
  EXPECT_EQ(render(source, request), "True:{\"b\": [1, 2.0], \"a\": \"\xC3\xA9\"};True:{};True:{\"k\": null};");
  request["messages"][0]["tool_calls"][0]["function"]["arguments"] = "{oops";
  EXPECT_TRUE(mentions(error_message([&] { render(source, request); }),
                       {"messages[0].tool_calls[0].function.arguments is not valid JSON"}));
}

TEST(ChatRequest, GenerationPromptDefaultsToTrueAndKwargsOverride) {
  const std::string source = "{{ add_generation_prompt }} {{ tools }} {{ thinking }}";
  EXPECT_EQ(render(source, json{{"messages", json::array()}}), "True None ");
  EXPECT_EQ(render(source, json::parse(R"({"messages": [], "add_generation_prompt": false, "tools": [],
                                           "chat_template_kwargs": {"thinking": false}})")),
            "False [] False");
  EXPECT_EQ(
      render(source, json::parse(R"({"messages": [], "chat_template_kwargs": {"add_generation_prompt": false}})")),
      "False None ");
}

TEST(ChatRequest, ContinueFinalMessageStopsAfterItsContent) {
  const std::string source =
      "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}";
  json request = json::parse(R"({"messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Once upon"}], "add_generation_prompt": false, "continue_final_message": true})");
  EXPECT_EQ(render(source, request), "<user>Hi</user>\n<assistant>Once upon");
  // Trailing whitespace the template strips is dropped, as transformers does.
  request["messages"][1]["content"] = "Once upon ";
  EXPECT_EQ(render("{% for m in messages %}{{ m.content|trim }}|{% endfor %}", request), "Hi|Once upon");
  // vLLM refuses continue_final_message together with the (default) generation prompt.
  request.erase("add_generation_prompt");
  EXPECT_TRUE(
      mentions(error_message([&] { render(source, request); }), {"continue_final_message and add_generation_prompt"}));
}

TEST(ChatRequest, MalformedRequestsAreOneLineErrors) {
  EXPECT_TRUE(mentions(error_message([] { render("x", json::parse("[]")); }), {"request"}));
  EXPECT_TRUE(mentions(error_message([] { render("x", json::parse(R"({"messages": {}})")); }), {"messages"}));
  EXPECT_TRUE(mentions(error_message([] { render("x", json::parse(R"({"messages": [], "tools": 3})")); }), {"tools"}));
  EXPECT_TRUE(
      mentions(error_message([] { render("x", json::parse(R"({"messages": [], "add_generation_prompt": "yes"})")); }),
               {"add_generation_prompt"}));
}

TEST(ChatRequest, ValuesKeepJsonKeyOrderAndNumberKinds) {
  EXPECT_EQ(render("{{ v }} {{ v|tojson }}", request_with(R"({"v": {"z": 1, "a": [1.0, 2, 1e-7, true, null]}})")),
            "{'z': 1, 'a': [1.0, 2, 1e-07, True, None]} {\"z\": 1, \"a\": [1.0, 2, 1e-07, true, null]}");
}

// ---- sparrow render ----

namespace {

struct CommandResult {
  int status = -1;
  std::string out, err;
};

CommandResult run_sparrow(const std::string& args, const TempDir& scratch) {
  std::string cmd = std::string(SPARROW_BINARY) + " " + args + " >" + scratch.file("out") + " 2>" + scratch.file("err");
  int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(scratch.file("out")), slurp(scratch.file("err"))};
}

}  // namespace

TEST(RenderCommand, PrintsThePromptExactly) {
  TempDir dir;
  json spec = load_json(kData / "models.json")["kimi-k2"];
  write_model(dir, spec["tokenizer_config"], slurp(kData / "kimi-k2.jinja"));
  json conversations = load_json(kData / "conversations.json");
  std::string request_path = dir.write("request.json", conversations[2]["request"].dump());
  CommandResult r = run_sparrow("render --model " + dir.path() + " --request " + request_path, dir);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, load_json(kData / "expected/kimi-k2.json")[conversations[2]["name"].get<std::string>()]["prompt"]);
  EXPECT_EQ(r.err, "");
}

TEST(RenderCommand, BadInputIsOneLineErrorAndStatus1) {
  TempDir dir;
  write_model(dir, json::object(), "{{ raise_exception('no way') }}");
  std::string bad_json = dir.write("bad.json", "{\"messages\": [");
  std::string good = dir.write("good.json", "{\"messages\": []}");
  for (const auto& [args, expected] : std::vector<std::pair<std::string, std::string>>{
           {"render --model " + dir.path() + " --request " + bad_json, "not valid JSON"},
           {"render --model " + dir.path() + " --request " + dir.file("missing.json"), "cannot open"},
           {"render --model " + dir.path() + " --request " + good, "raise_exception: no way"},
           {"render --model /nonexistent --request " + good, "no chat template"}}) {
    CommandResult r = run_sparrow(args, dir);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_EQ(r.out, "") << args;
    EXPECT_TRUE(mentions(r.err.substr(0, r.err.size() - 1), {"error: ", expected})) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}
