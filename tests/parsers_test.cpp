// The reasoning and tool-call parsers (src/server/parsers). The format vectors live in
// tests/data/parsers/<parser>.json: each case is one model output with the reasoning, content and tool
// calls it must give. Every case is checked whole (the non-streaming result), fed one character at a
// time, and in random chunkings: the joined stream must equal the whole result, no delta may carry
// markup, and the deltas must have the OpenAI streaming shape (a call's id and name once, first).
// Random markup soup checks the same agreement, and that nothing crashes, on malformed output.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"
#include "server/parsers/parser.h"
#include "server/parsers/text_scan.h"
#include "server/parsers/tool_schema.h"

using namespace sparrow;
using namespace sparrow::parsers;
using nlohmann::json;

namespace {

json load_vectors(const std::string& parser) {
  std::ifstream in(std::string(SPARROW_SOURCE_DIR) + "/tests/data/parsers/" + parser + ".json");
  EXPECT_TRUE(in.good()) << parser;
  return json::parse(in);
}

// Where a case's output may be split: between UTF-8 characters (the engine's detokenizer never splits
// one).
std::vector<size_t> char_boundaries(const std::string& text) {
  std::vector<size_t> cuts;
  for (size_t i = 1; i < text.size(); ++i)
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) cuts.push_back(i);
  return cuts;
}

std::vector<std::string> split_at(const std::string& text, const std::vector<size_t>& cuts) {
  std::vector<std::string> pieces;
  size_t start = 0;
  for (size_t cut : cuts) {
    pieces.push_back(text.substr(start, cut - start));
    start = cut;
  }
  pieces.push_back(text.substr(start));
  return pieces;
}

std::vector<std::string> random_chunks(const std::string& text, std::mt19937& random) {
  std::vector<size_t> cuts;
  for (size_t cut : char_boundaries(text))
    if (random() % 4 == 0) cuts.push_back(cut);
  return split_at(text, cuts);
}

// How a case runs: which parsers, with which options.
struct Setup {
  std::string parser;
  bool use_reasoning = true, use_tools = true;
  ReasoningOptions options;
  json tools;
};

Setup case_setup(const json& file, const json& c) {
  Setup setup;
  setup.parser = file["parser"];
  setup.use_reasoning = c.value("reasoning_parser", true);
  setup.use_tools = c.value("tool_parser", true);
  setup.tools = c.contains("tools") ? c["tools"] : file.value("tools", json());
  setup.options = reasoning_options(setup.parser, c.value("chat_template_kwargs", json::object()), c.value("prompt", ""));
  return setup;
}

OutputParser make_parser(const Setup& setup) {
  return OutputParser(setup.use_reasoning ? make_reasoning_parser(setup.parser, setup.options) : nullptr,
                      setup.use_tools ? make_tool_parser(setup.parser, setup.tools, /*id_seed=*/7) : nullptr);
}

// Streams `pieces` through a fresh parser, checking the shape of every delta, and joins the deltas.
ParsedOutput stream(const Setup& setup, const std::vector<std::string>& pieces, const std::string& where) {
  OutputParser parser = make_parser(setup);
  ParsedOutput joined;
  std::set<int> announced;
  auto check = [&](const OutputDelta& delta) {
    int previous = -1;
    for (const ToolCallDelta& piece : delta.tool_calls) {
      EXPECT_GT(piece.index, previous) << where << ": one entry per call index, in order";
      previous = piece.index;
      bool first = announced.insert(piece.index).second;
      EXPECT_EQ(first, !piece.id.empty()) << where << ": the id comes once, in the call's first delta";
      EXPECT_EQ(first, !piece.name.empty()) << where << ": the name comes once, in the call's first delta";
      EXPECT_EQ(piece.index, first ? static_cast<int>(announced.size()) - 1 : piece.index) << where;
    }
    joined.append(delta);
  };
  for (const std::string& piece : pieces) check(parser.feed(piece));
  check(parser.finish());
  return joined;
}

std::string describe(const ParsedOutput& out) {
  json calls = json::array();
  for (const ToolCall& call : out.tool_calls) calls.push_back({{"id", call.id}, {"name", call.name}, {"arguments", call.arguments}});
  return json{{"reasoning", out.reasoning}, {"content", out.content}, {"tool_calls", calls}}.dump();
}

void expect_same(const ParsedOutput& got, const ParsedOutput& want, const std::string& where) {
  EXPECT_EQ(describe(got), describe(want)) << where;
}

void expect_no_markup(const ParsedOutput& out, const json& markup, const std::string& where) {
  for (const std::string marker : markup) {
    EXPECT_EQ(out.content.find(marker), std::string::npos) << where << ": content leaks " << marker;
    EXPECT_EQ(out.reasoning.find(marker), std::string::npos) << where << ": reasoning leaks " << marker;
  }
}

void check_expected(const ParsedOutput& got, const json& want, const std::string& where) {
  EXPECT_EQ(got.reasoning, want.value("reasoning", "")) << where;
  EXPECT_EQ(got.content, want.value("content", "")) << where;
  json calls = want.value("tool_calls", json::array());
  ASSERT_EQ(got.tool_calls.size(), calls.size()) << where << ": " << describe(got);
  std::set<std::string> ids;
  for (size_t i = 0; i < calls.size(); ++i) {
    const ToolCall& call = got.tool_calls[i];
    EXPECT_EQ(call.name, calls[i]["name"]) << where << " call " << i;
    EXPECT_EQ(call.arguments, calls[i]["arguments"]) << where << " call " << i;
    if (calls[i].contains("id"))
      EXPECT_EQ(call.id, calls[i]["id"]) << where << " call " << i;
    else
      EXPECT_TRUE(std::regex_match(call.id, std::regex("call_[0-9a-f]{24}"))) << where << " id " << call.id;
    EXPECT_TRUE(ids.insert(call.id).second) << where << ": ids are distinct";
  }
}

// Runs every case of one vector file whole, character by character and in random chunkings.
void run_vectors(const std::string& parser_name) {
  json file = load_vectors(parser_name);
  std::mt19937 random(1234);
  for (const json& c : file["cases"]) {
    std::string where = parser_name + " / " + c["name"].get<std::string>();
    Setup setup = case_setup(file, c);
    std::string output = c["output"];
    OutputParser whole_parser = make_parser(setup);
    ParsedOutput whole = parse_output(whole_parser, output);
    check_expected(whole, c["expect"], where + " (whole)");
    if (!c.value("markup_allowed", false)) expect_no_markup(whole, file["markup"], where);
    expect_same(stream(setup, split_at(output, char_boundaries(output)), where + " (by character)"), whole,
                where + " (by character)");
    for (int round = 0; round < 20; ++round)
      expect_same(stream(setup, random_chunks(output, random), where + " (random chunks)"), whole,
                  where + " (random chunks " + std::to_string(round) + ")");
  }
}

// Random outputs built from the format's markup, the file's extra pieces and ordinary text: the
// parsers must not crash, and streaming must agree with the whole result however the text is split.
void run_soup(const std::string& parser_name) {
  json file = load_vectors(parser_name);
  std::vector<std::string> pieces = file["markup"].get<std::vector<std::string>>();
  for (const std::string& piece : file.value("soup", std::vector<std::string>{})) pieces.push_back(piece);
  for (const char* text : {"a", "Hello", " ", "\n", "\"", "{", "}", ":", "<", ">", "=", "0", "null", "你好", "true"})
    pieces.push_back(text);
  std::mt19937 random(99);
  for (int round = 0; round < 300; ++round) {
    std::string output;
    size_t length = random() % 30;
    for (size_t i = 0; i < length; ++i) output += pieces[random() % pieces.size()];
    for (bool thinking : {true, false}) {
      Setup setup{parser_name, true, true, {thinking, false}, file.value("tools", json())};
      std::string where = parser_name + " soup: " + json(output).dump();
      OutputParser whole_parser = make_parser(setup);
      ParsedOutput whole = parse_output(whole_parser, output);
      expect_same(stream(setup, split_at(output, char_boundaries(output)), where), whole, where + " (by character)");
      expect_same(stream(setup, random_chunks(output, random), where), whole, where + " (random chunks)");
    }
  }
}

}  // namespace

TEST(ParsersVectors, KimiK2) { run_vectors("kimi_k2"); }
TEST(ParsersVectors, KimiK3) { run_vectors("kimi_k3"); }
TEST(ParsersVectors, MinimaxM2) { run_vectors("minimax_m2"); }
TEST(ParsersVectors, MinimaxM3) { run_vectors("minimax_m3"); }
TEST(ParsersVectors, DeepseekV32) { run_vectors("deepseek_v32"); }

TEST(ParsersSoup, KimiK2) { run_soup("kimi_k2"); }
TEST(ParsersSoup, KimiK3) { run_soup("kimi_k3"); }
TEST(ParsersSoup, MinimaxM2) { run_soup("minimax_m2"); }
TEST(ParsersSoup, MinimaxM3) { run_soup("minimax_m3"); }
TEST(ParsersSoup, DeepseekV32) { run_soup("deepseek_v32"); }

TEST(ParsersFactory, UnknownNamesListTheValidOnes) {
  for (auto make : {+[] { make_reasoning_parser("qwen3"); }, +[] { make_tool_parser("qwen3", json()); }}) {
    try {
      make();
      FAIL() << "no error for an unknown parser";
    } catch (const Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("'qwen3'"), std::string::npos) << message;
      EXPECT_NE(message.find("kimi_k3, kimi_k2, minimax_m3, minimax_m2, deepseek_v32"), std::string::npos) << message;
    }
  }
  for (const std::string& name : parser_names()) {
    EXPECT_NE(make_reasoning_parser(name), nullptr);
    EXPECT_NE(make_tool_parser(name, json()), nullptr);
  }
}

TEST(ParsersFactory, GeneratedIdsDependOnlyOnTheSeed) {
  std::string output = "<minimax:tool_call><invoke name=\"f\"></invoke><invoke name=\"g\"></invoke></minimax:tool_call>";
  auto ids = [&](std::optional<uint64_t> seed) {
    OutputParser parser(nullptr, make_tool_parser("minimax_m2", json(), seed));
    ParsedOutput out = parse_output(parser, output);
    EXPECT_EQ(out.tool_calls.size(), 2u);
    return out.tool_calls.at(0).id + " " + out.tool_calls.at(1).id;
  };
  EXPECT_EQ(ids(5), ids(5));
  EXPECT_NE(ids(5), ids(6));
  EXPECT_NE(ids(std::nullopt), ids(std::nullopt));
}

TEST(ParsersOptions, ThinkingSwitchAndPromptTail) {
  json none = json::object();
  EXPECT_TRUE(reasoning_options("kimi_k2", none, "").thinking);
  EXPECT_FALSE(reasoning_options("kimi_k3", {{"thinking", false}}, "").thinking);
  EXPECT_FALSE(reasoning_options("deepseek_v32", {{"enable_thinking", false}}, "").thinking);
  EXPECT_TRUE(reasoning_options("deepseek_v32", {{"enable_thinking", "no"}}, "").thinking) << "not a boolean: ignored";
  EXPECT_FALSE(reasoning_options("minimax_m3", {{"thinking_mode", "disabled"}}, "").thinking);
  EXPECT_TRUE(reasoning_options("minimax_m3", {{"thinking_mode", "adaptive"}}, "").thinking);
  EXPECT_TRUE(reasoning_options("minimax_m3", json(), "]~b]ai\n<mm:think>").prompt_opens_reasoning);
  EXPECT_FALSE(reasoning_options("minimax_m3", json(), "]~b]ai\n</mm:think>").prompt_opens_reasoning);
  EXPECT_TRUE(reasoning_options("minimax_m2", json(), "]~b]ai\n<think>\n").prompt_opens_reasoning);
  EXPECT_TRUE(reasoning_options("kimi_k3", json(), "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>")
                  .prompt_opens_reasoning);
  EXPECT_THROW(reasoning_options("nope", json(), ""), Error);
}

TEST(ParsersSchema, TypesFromSchemas) {
  using Types = std::set<std::string>;
  EXPECT_EQ(schema_types(json::object()), Types{"string"});
  EXPECT_EQ(schema_types({{"type", "int"}}), Types{"integer"});
  EXPECT_EQ(schema_types({{"type", {"number", "null"}}}), (Types{"number", "null"}));
  EXPECT_EQ(schema_types({{"enum", {1, "a", true, nullptr}}}), (Types{"integer", "string", "boolean", "null"}));
  EXPECT_EQ(schema_types({{"anyOf", {{{"type", "string"}}, {{"oneOf", {{{"type", "array"}}}}}}}}), (Types{"string", "array"}));
}

TEST(ParsersSchema, CoercionFollowsVllm) {
  auto coerce = [](const std::string& text, std::set<std::string> types) { return json_text(coerce_value(text, types)); };
  EXPECT_EQ(coerce("5", {"integer"}), "5");
  EXPECT_EQ(coerce(" -12 ", {"integer"}), "-12");
  EXPECT_EQ(coerce("5.5", {"integer"}), "5.5") << "not an integer: JSON fallback";
  EXPECT_EQ(coerce("3.0", {"number"}), "3") << "integral numbers become integers";
  EXPECT_EQ(coerce("2.5e1", {"number"}), "25");
  EXPECT_EQ(coerce("0.25", {"number"}), "0.25");
  EXPECT_EQ(coerce("inf", {"number"}), "\"inf\"") << "not finite: kept as text";
  EXPECT_EQ(coerce("1e999", {"number"}), "\"1e999\"");
  EXPECT_EQ(coerce("True", {"boolean"}), "true");
  EXPECT_EQ(coerce("0", {"boolean"}), "false");
  EXPECT_EQ(coerce("yes", {"boolean"}), "\"yes\"") << "vLLM's engine accepts only true/1 and false/0";
  EXPECT_EQ(coerce("null", {"string", "null"}), "null");
  EXPECT_EQ(coerce("hello", {"string", "null"}), "\"hello\"");
  EXPECT_EQ(coerce("null", {"string"}), "\"null\"");
  EXPECT_EQ(coerce(" {\"a\": [1, 2]} ", {"object"}), "{\"a\":[1,2]}");
  EXPECT_EQ(coerce("[1, \"x\"]", {"array"}), "[1,\"x\"]");
  EXPECT_EQ(coerce("{broken", {"object"}), "\"{broken\"");
  EXPECT_EQ(coerce(" 7 ", {"string", "integer"}), "7") << "integer comes before string";
  EXPECT_EQ(coerce(" 7 ", {"string"}), "\" 7 \"") << "strings are verbatim";
  EXPECT_EQ(coerce("{\"a\": 1}", {}), "{\"a\":1}") << "unknown type: JSON when it is JSON";
  EXPECT_EQ(coerce("plain", {}), "\"plain\"");
}

// Model output nested deeper than outside JSON may be (kMaxJsonDepth) is never walked: JSON text stays a
// string, nested MiniMax-M3 tags deeper than the limit stay text, and a schema's branches are followed
// only that deep.
TEST(ParsersLimits, DeepModelOutputIsNotWalked) {
  const std::string deep_json = std::string(30000, '[') + std::string(30000, ']');
  EXPECT_EQ(coerce_value(deep_json, {"array"}), json(deep_json));
  EXPECT_EQ(coerce_value(deep_json, {}), json(deep_json));
  const std::string fine = std::string(100, '[') + std::string(100, ']');
  EXPECT_TRUE(coerce_value(fine, {"array"}).is_array());

  const std::string ns = "]<]minimax[>[";
  std::string nested;
  for (int i = 0; i < 20000; ++i) nested += ns + "<a>";
  nested += "x";
  for (int i = 0; i < 20000; ++i) nested += ns + "</a>";
  std::string output = ns + "<tool_call>\n" + ns + "<invoke name=\"f\">" + ns + "<v>" + nested + ns + "</v>" + ns +
                       "</invoke>\n" + ns + "</tool_call>";
  OutputParser parser(nullptr, make_tool_parser("minimax_m3", json()));
  ParsedOutput out = parse_output(parser, output);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  // The arguments nest as deep as a request may carry them back, and no deeper: the tags past that are
  // text.
  JsonInput<json> arguments = parse_json_input<json>(out.tool_calls[0].arguments);
  ASSERT_TRUE(arguments.ok());
  int depth = 0;
  const json* innermost = &arguments.value;
  for (; innermost->is_object(); innermost = &innermost->begin().value()) ++depth;
  EXPECT_EQ(depth, kMaxJsonDepth - 1);
  ASSERT_TRUE(innermost->is_string());
  EXPECT_TRUE(innermost->get<std::string>().ends_with("<a><a>x")) << innermost->get<std::string>().substr(0, 40);

  // 50,000 bare namespace tokens between a call's tags are skipped in a loop, not a recursion.
  std::string bare;
  for (int i = 0; i < 50000; ++i) bare += ns + "x";
  OutputParser bare_parser(nullptr, make_tool_parser("minimax_m3", json()));
  ParsedOutput calls = parse_output(bare_parser, ns + "<tool_call>\n" + ns + "<invoke name=\"f\">" + bare + ns +
                                                     "<v>1" + ns + "</v>" + ns + "</invoke>\n" + ns + "</tool_call>");
  ASSERT_EQ(calls.tool_calls.size(), 1u);
  EXPECT_EQ(calls.tool_calls[0].arguments, R"({"v":"1"})");

  json schema = {{"type", "integer"}};
  for (int i = 0; i < 1000; ++i) schema = {{"anyOf", json::array({schema})}};
  EXPECT_EQ(schema_types(schema), std::set<std::string>{"string"});  // the integer lies past the limit
}

TEST(ParsersScan, MarkersSplitAcrossDeltasAreHeldBack) {
  MarkerHit hit = find_marker("abc<|to", {"<|tool_call_begin|>", "<x>"}, false);
  EXPECT_FALSE(hit.found());
  EXPECT_EQ(hit.pos, 3u);
  hit = find_marker("abc<|to", {"<|tool_call_begin|>"}, true);
  EXPECT_EQ(hit.pos, 7u) << "at the end nothing is held";
  hit = find_marker("a<x>b<|tool_call_begin|>", {"<|tool_call_begin|>", "<x>"}, false);
  EXPECT_EQ(hit.marker, 1);
  EXPECT_EQ(hit.pos, 1u);
  EXPECT_EQ(hit.length, 3u);
  EXPECT_EQ(find_marker("a<", {"<x>"}, false).pos, 1u);
  EXPECT_EQ(find_marker("a<y", {"<x>"}, false).pos, 3u);
  EXPECT_EQ(json_string_body("a\"b\\c\n你"), "a\\\"b\\\\c\\n你");
  EXPECT_EQ(parse_attributes(" name=\"get weather\" string='true' bare=x"),
            (std::map<std::string, std::string>{{"name", "get weather"}, {"string", "true"}, {"bare", "x"}}));
}
