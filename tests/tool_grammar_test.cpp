// Forced tool calls (src/server/parsers/tool_grammar.cpp) and the structured-output pieces they need
// (special tokens a grammar may produce, the start_after gate). For every tool-call format: the grammar
// accepts a call written as markers.h shows it and refuses a call to an unknown tool, a missing required
// argument and a wrongly typed value; random walks through the compiled grammar's masks always parse, with
// that format's ToolParser, into calls to offered tools whose arguments have the required keys and the
// schema's types; special tokens are allowed only where the markup is.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/parsers/parser.h"
#include "structured/front_ends.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

using namespace sparrow;
using namespace sparrow::structured;
using namespace sparrow::parsers;
using nlohmann::json;

namespace {

const nlohmann::ordered_json& tools() {
  static const nlohmann::ordered_json t = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"], "type": "string"},
                     "where": {"type": "object", "properties": {"lat": {"type": "number"}, "name": {"type": "string"}}, "required": ["lat"]},
                     "hours": {"type": "array", "items": {"type": "integer"}}},
      "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "number"}, "b": {"type": "number"}, "exact": {"type": "boolean"},
                     "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
      "required": ["a", "b"]}}}])");
  return t;
}

// One format: its parser name and a call to get_weather(city="Paris", days=3) as markers.h shows it, with
// {CITY}, {DAYS} and {NAME} to replace.
struct Format {
  std::string parser, call;
  std::string days_element;  // the part of `call` that is the days argument
};

const std::vector<Format>& formats() {
  static const std::vector<Format> f = {
      {"kimi_k2",
       "<|tool_calls_section_begin|><|tool_call_begin|>functions.{NAME}:0<|tool_call_argument_begin|>"
       "{\"city\": \"{CITY}\", \"days\": {DAYS}}<|tool_call_end|><|tool_calls_section_end|>",
       ", \"days\": {DAYS}"},
      {"deepseek_v32",
       "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"{NAME}\">\n"
       "<｜DSML｜parameter name=\"city\" string=\"true\">{CITY}</｜DSML｜parameter>\n"
       "<｜DSML｜parameter name=\"days\" string=\"false\">{DAYS}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
       "</｜DSML｜function_calls>",
       "<｜DSML｜parameter name=\"days\" string=\"false\">{DAYS}</｜DSML｜parameter>\n"},
      {"minimax_m2",
       "<minimax:tool_call>\n<invoke name=\"{NAME}\">\n<parameter name=\"city\">{CITY}</parameter>\n"
       "<parameter name=\"days\">{DAYS}</parameter>\n</invoke>\n</minimax:tool_call>",
       "<parameter name=\"days\">{DAYS}</parameter>\n"},
      {"minimax_m3",
       "]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"{NAME}\">]<]minimax[>[<city>{CITY}]<]minimax[>[</city>"
       "]<]minimax[>[<days>{DAYS}]<]minimax[>[</days>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>",
       "]<]minimax[>[<days>{DAYS}]<]minimax[>[</days>"},
      {"kimi_k3",
       "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"{NAME}\" index=\"1\"<|sep|>"
       "<|open|>argument key=\"city\" type=\"string\"<|sep|>{CITY}<|close|>argument<|sep|>"
       "<|open|>argument key=\"days\" type=\"integer\"<|sep|>{DAYS}<|close|>argument<|sep|><|close|>call<|sep|>"
       "<|close|>tools<|sep|>",
       "<|open|>argument key=\"days\" type=\"integer\"<|sep|>{DAYS}<|close|>argument<|sep|>"},
  };
  return f;
}

std::string fill(std::string text, const std::string& name, const std::string& city, const std::string& days) {
  for (auto [key, value] : {std::pair{"{NAME}", name}, {"{CITY}", city}, {"{DAYS}", days}}) {
    size_t at;
    while ((at = text.find(key)) != std::string::npos) text.replace(at, std::string_view(key).size(), value);
  }
  return text;
}

// Whole-text acceptance by a grammar, over a byte vocabulary.
std::shared_ptr<const TokenVocabulary> byte_vocabulary() {
  static auto v = [] {
    std::vector<std::string> bytes(256);
    for (int b = 0; b < 256; ++b) bytes[size_t(b)] = std::string(1, char(b));
    return std::make_shared<const TokenVocabulary>(bytes, std::vector<char>(256, 0), 256);
  }();
  return v;
}

bool accepts(const std::string& ebnf, const std::string& text) {
  GrammarMatcher m(std::make_shared<const CompiledGrammar>(grammar_from_ebnf(ebnf), byte_vocabulary()), {});
  return m.accept_bytes(text) && m.is_terminated();
}

ParsedOutput parse(const std::string& parser, const std::string& text) {
  OutputParser p(nullptr, make_tool_parser(parser, json::parse(tools().dump()), 7));
  return parse_output(p, text);
}

// A JSON number of any size: the grammar admits numbers beyond int64 and double (JSON has no bound), which
// the parsers then keep as they can (a double, or the text when it overflows).
bool integral(const json& v) {
  if (v.is_number_integer()) return true;
  if (v.is_number_float()) return std::abs(v.get<double>()) >= 9.2e18;
  return v.is_string() && !v.get<std::string>().empty() &&
         v.get<std::string>().find_first_not_of("-0123456789") == std::string::npos;
}
bool numeric(const json& v) {
  return v.is_number() || (v.is_string() && v.get<std::string>().find_first_not_of("-+.0123456789eE") == std::string::npos);
}

// The call's arguments have the tool's required keys and the schema's types.
void expect_valid_call(const ToolCall& call, const std::string& text) {
  json args;
  try {
    args = json::parse(call.arguments);
  } catch (const json::out_of_range&) {
    return;  // a number beyond what nlohmann can hold: valid JSON, no verdict
  } catch (const json::parse_error& e) {
    FAIL() << e.what() << ": " << call.arguments << "\n" << text;
  }
  ASSERT_TRUE(args.is_object()) << text;
  if (call.name == "get_weather") {
    ASSERT_TRUE(args.contains("city") && args["city"].is_string()) << text;
    ASSERT_TRUE(args.contains("days") && integral(args["days"])) << text;
    if (args.contains("unit")) EXPECT_TRUE(args["unit"] == "c" || args["unit"] == "f") << text;
    if (args.contains("where")) {
      ASSERT_TRUE(args["where"].is_object()) << text;
      EXPECT_TRUE(args["where"].contains("lat") && numeric(args["where"]["lat"])) << text;
      if (args["where"].contains("name")) EXPECT_TRUE(args["where"]["name"].is_string()) << text;
    }
    if (args.contains("hours")) {
      ASSERT_TRUE(args["hours"].is_array()) << text;
      for (const json& h : args["hours"]) EXPECT_TRUE(integral(h)) << text;
    }
  } else {
    ASSERT_EQ(call.name, "add") << text;
    ASSERT_TRUE(args.contains("a") && numeric(args["a"])) << text;
    ASSERT_TRUE(args.contains("b") && numeric(args["b"])) << text;
    if (args.contains("exact")) EXPECT_TRUE(args["exact"].is_boolean()) << text;
    if (args.contains("tags")) {
      ASSERT_TRUE(args["tags"].is_array()) << text;
      for (const json& t : args["tags"]) EXPECT_TRUE(integral(t)) << text;
    }
  }
  const std::set<std::string> declared = call.name == "get_weather" ? std::set<std::string>{"city", "days", "unit", "where", "hours"}
                                                                    : std::set<std::string>{"a", "b", "exact", "tags"};
  for (auto it = args.begin(); it != args.end(); ++it)
    EXPECT_TRUE(declared.count(it.key())) << "undeclared argument " << it.key() << " in " << text;
}

TEST(ToolGrammar, AcceptsTheFormatsCallAndRefusesBadOnes) {
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.parser);
    const ToolGrammar g = tool_call_grammar(f.parser, tools(), {});
    const std::string good = fill(f.call, "get_weather", "Paris", "3");
    EXPECT_TRUE(accepts(g.ebnf, good)) << good << "\n" << g.ebnf;
    ParsedOutput parsed = parse(f.parser, good);
    ASSERT_EQ(parsed.tool_calls.size(), 1u) << good;
    EXPECT_EQ(parsed.tool_calls[0].name, "get_weather");
    EXPECT_EQ(json::parse(parsed.tool_calls[0].arguments), json({{"city", "Paris"}, {"days", 3}}));
    EXPECT_EQ(parsed.content, "");

    EXPECT_FALSE(accepts(g.ebnf, fill(f.call, "get_time", "Paris", "3"))) << "an unknown tool";
    EXPECT_FALSE(accepts(g.ebnf, fill(f.call, "get_weather", "Paris", "three"))) << "a string for an integer";
    EXPECT_FALSE(accepts(g.ebnf, fill(f.call, "get_weather", "Paris", "3.5"))) << "a number for an integer";
    {  // a string enum: only its values (the unit argument, optional, after days)
      const std::string days = fill(f.days_element, "get_weather", "Paris", "3");
      std::string unit = f.days_element;
      auto replace_all = [&](const std::string& from, const std::string& to) {
        for (size_t at = unit.find(from); at != std::string::npos; at = unit.find(from, at + to.size()))
          unit.replace(at, from.size(), to);
      };
      replace_all("days", "unit");
      if (f.parser == "kimi_k2") replace_all("{DAYS}", "\"{DAYS}\"");
      if (f.parser == "kimi_k3") replace_all("integer", "string");
      if (f.parser == "deepseek_v32") replace_all("false", "true");
      std::string with_unit = good, bad_unit = good;
      with_unit.insert(good.find(days) + days.size(), fill(unit, "", "", "c"));
      bad_unit.insert(good.find(days) + days.size(), fill(unit, "", "", "k"));
      EXPECT_TRUE(accepts(g.ebnf, with_unit)) << with_unit;
      EXPECT_FALSE(accepts(g.ebnf, bad_unit)) << bad_unit;
      EXPECT_EQ(json::parse(parse(f.parser, with_unit).tool_calls.at(0).arguments)["unit"], "c") << with_unit;
    }
    EXPECT_FALSE(accepts(g.ebnf, fill(f.call, "get_weather", "Pa<ris", "3"))) << "'<' in raw text or a JSON string";
    // A missing required argument: the call without its days element, which the parser still reads.
    std::string without_days = good;
    const std::string days = fill(f.days_element, "get_weather", "Paris", "3");
    ASSERT_NE(good.find(days), std::string::npos);
    without_days.erase(good.find(days), days.size());
    EXPECT_EQ(parse(f.parser, without_days).tool_calls.size(), 1u) << "the parser reads it: " << without_days;
    EXPECT_FALSE(accepts(g.ebnf, without_days)) << without_days;

    // A named choice admits only that tool; parallel calls admit two.
    const ToolGrammar named = tool_call_grammar(f.parser, tools(), {.only_function = "add"});
    EXPECT_FALSE(accepts(named.ebnf, good));
    EXPECT_THROW(tool_call_grammar(f.parser, tools(), {.only_function = "nope"}), Error);
  }
}

TEST(ToolGrammar, MinimaxM3NestedTagsAsTheTemplateRendersThem) {
  // minimax-m3.jinja's to_xml: an object argument as one tag per key, an array as <item> tags; JSON text
  // is accepted too. The parser reads both into the same arguments.
  const ToolGrammar g = tool_call_grammar("minimax_m3", tools(), {});
  const std::string ns = "]<]minimax[>[";
  const std::string head = ns + "<tool_call>\n" + ns + "<invoke name=\"get_weather\">" + ns + "<city>Oslo" + ns + "</city>" +
                           ns + "<days>2" + ns + "</days>";
  const std::string tail = ns + "</invoke>\n" + ns + "</tool_call>";
  const std::string nested = head + ns + "<where>" + ns + "<lat>59.9" + ns + "</lat>" + ns + "<name>x" + ns + "</name>" + ns +
                             "</where>" + ns + "<hours>" + ns + "<item>1" + ns + "</item>" + ns + "<item>2" + ns + "</item>" + ns +
                             "</hours>" + tail;
  const std::string as_json = head + ns + "<where>{\"lat\": 59.9, \"name\": \"x\"}" + ns + "</where>" + ns + "<hours>[1, 2]" + ns +
                              "</hours>" + tail;
  const json expected = {{"city", "Oslo"}, {"days", 2}, {"where", {{"lat", 59.9}, {"name", "x"}}}, {"hours", {1, 2}}};
  for (const std::string& text : {nested, as_json}) {
    EXPECT_TRUE(accepts(g.ebnf, text)) << text;
    EXPECT_EQ(json::parse(parse("minimax_m3", text).tool_calls.at(0).arguments), expected) << text;
  }
  const std::string no_lat = head + ns + "<where>" + ns + "<name>x" + ns + "</name>" + ns + "</where>" + tail;
  EXPECT_FALSE(accepts(g.ebnf, no_lat)) << "a required nested key missing";
  const std::string empty_hours = head + ns + "<hours>" + ns + "</hours>" + tail;
  EXPECT_FALSE(accepts(g.ebnf, empty_hours)) << "empty nested text cannot be typed";
}

TEST(ToolGrammar, UnsupportedSchemasAndNamesAreErrorsNamingTheTool) {
  auto bad_schema = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}])");
  auto bad_name = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "a<b"}}])");
  for (const Format& f : formats()) {
    try {
      tool_call_grammar(f.parser, bad_schema, {});
      ADD_FAILURE() << f.parser << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tool 'f'"), std::string::npos) << e.what();
    }
    if (f.parser != "kimi_k3") {
      EXPECT_THROW(tool_call_grammar(f.parser, bad_name, {}), Error) << f.parser;
    }
  }
  EXPECT_THROW(tool_call_grammar("no_such_parser", tools(), {}), Error);
}

// The deepseek_v32 tokenizer's bytes with every format's special tokens appended as special (excluded)
// tokens, plus one special token no grammar lists.
struct WalkVocabulary {
  std::unique_ptr<Tokenizer> tokenizer;
  std::shared_ptr<const TokenVocabulary> vocab;
  std::vector<std::string> extra;  // texts of the appended tokens, from id base on
  int32_t base = 0, eos = 0, stray = 0;
};

const WalkVocabulary& walk_vocabulary() {
  static WalkVocabulary v = [] {
    WalkVocabulary w;
    w.tokenizer = load_tokenizer(SPARROW_SOURCE_DIR "/models/deepseek_v32");
    std::vector<std::string> bytes;
    std::vector<char> excluded;
    for (int32_t id = 0; id < w.tokenizer->vocab_size(); ++id) {
      const std::string* b = w.tokenizer->token_bytes(id);
      bytes.push_back(b ? *b : "");
      excluded.push_back(!b || w.tokenizer->is_special(id));
    }
    w.base = int32_t(bytes.size());
    w.extra = {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|open|>", "<|close|>", "<|sep|>",
               "]<]minimax[>[", "<minimax:tool_call>", "</minimax:tool_call>", "<|stray|>"};
    for (const std::string& t : w.extra) {
      bytes.push_back(t);
      excluded.push_back(1);
    }
    w.stray = int32_t(bytes.size()) - 1;
    w.eos = *w.tokenizer->eos_id();
    w.vocab = std::make_shared<const TokenVocabulary>(bytes, excluded, int32_t(bytes.size()));
    return w;
  }();
  return v;
}

bool bit(const std::vector<uint32_t>& words, int32_t t) { return (words[size_t(t) >> 5] >> (t & 31)) & 1u; }

TEST(ToolGrammar, RandomWalksParseIntoValidCalls) {
  const WalkVocabulary& w = walk_vocabulary();
  GrammarCompiler compiler(w.vocab);
  std::vector<uint32_t> words(size_t(w.vocab->mask_words()));
  for (const Format& f : formats()) {
    for (bool parallel : {false, true}) {
      SCOPED_TRACE(f.parser + (parallel ? " parallel" : ""));
      const ToolGrammar g = tool_call_grammar(f.parser, tools(), {.parallel_tool_calls = parallel});
      StructuredOutputSpec spec;
      spec.kind = StructuredOutputSpec::Kind::Grammar;
      spec.text = g.ebnf;
      spec.special_tokens = g.special_tokens;
      auto compiled = compiler.compile(spec);
      ASSERT_FALSE(compiled->special_tokens().empty());
      std::mt19937 rng(5);
      int finished = 0, specials_drawn = 0, several = 0;
      for (int walk = 0; walk < 25; ++walk) {
        GrammarMatcher m(compiled, {w.eos});
        std::string text;
        while (!m.is_completed() && text.size() < 3000) {
          ASSERT_GT(m.fill_next_token_bitmask(words.data()), 0) << text;
          ASSERT_FALSE(bit(words, w.stray)) << "a special token the grammar does not list";
          std::vector<int32_t> allowed, special;
          for (int32_t t = 0; t < w.vocab->mask_size(); ++t)
            if (bit(words, t)) (w.vocab->excluded(t) && t != w.eos ? special : allowed).push_back(t);
          // A special token allowed here is one the grammar lists, and its text fits here.
          for (int32_t t : special) {
            EXPECT_TRUE(compiled->is_special_token(t)) << t;
            ASSERT_TRUE(m.accept_bytes(w.vocab->bytes(t))) << w.vocab->bytes(t) << " after " << text;
            m.rollback(1);
          }
          // Prefer the markup's special tokens, short tokens and ending, so walks finish.
          int32_t pick;
          if (!special.empty() && rng() % 4 != 0) pick = special[rng() % special.size()];
          else if (bit(words, w.eos) && rng() % 2 == 0) pick = w.eos;
          else {
            if (allowed.empty()) allowed = special;
            pick = allowed[rng() % allowed.size()];
            for (int tries = 0; tries < 4 && pick != w.eos && w.vocab->bytes(pick).size() > 2; ++tries)
              pick = allowed[rng() % allowed.size()];
          }
          if (w.vocab->excluded(pick) && pick != w.eos) ++specials_drawn;
          ASSERT_TRUE(m.accept_token(pick)) << pick;
          if (pick != w.eos) text += w.vocab->bytes(pick);
        }
        if (!m.is_completed()) continue;  // wandered: no verdict
        ++finished;
        ParsedOutput parsed = parse(f.parser, text);
        ASSERT_GE(parsed.tool_calls.size(), 1u) << text;
        if (!parallel) EXPECT_EQ(parsed.tool_calls.size(), 1u) << text;
        several += parsed.tool_calls.size() > 1;
        for (const ToolCall& call : parsed.tool_calls) expect_valid_call(call, text);
        EXPECT_EQ(parsed.content.find_first_not_of(" \n"), std::string::npos) << "content: " << parsed.content;
      }
      EXPECT_GE(finished, 8);
      EXPECT_GT(specials_drawn, 0);
      if (parallel) EXPECT_GE(several, 1) << "parallel_tool_calls: no walk made two calls";
    }
  }
}

TEST(ToolGrammar, SpecialTokensOnlyWhereTheMarkupIs) {
  const WalkVocabulary& w = walk_vocabulary();
  GrammarCompiler compiler(w.vocab);
  const ToolGrammar g = tool_call_grammar("kimi_k2", tools(), {});
  StructuredOutputSpec spec{StructuredOutputSpec::Kind::Grammar, g.ebnf, {}, true, g.special_tokens};
  GrammarMatcher m(compiler.compile(spec), {w.eos});
  std::vector<uint32_t> words(size_t(w.vocab->mask_words()));
  auto specials_allowed = [&] {
    m.fill_next_token_bitmask(words.data());
    std::vector<std::string> out;
    for (int32_t t = w.base; t < w.vocab->mask_size(); ++t)
      if (bit(words, t)) out.push_back(w.vocab->bytes(t));
    return out;
  };
  EXPECT_EQ(specials_allowed(), std::vector<std::string>{"<|tool_calls_section_begin|>"});
  ASSERT_TRUE(m.accept_token(w.base + 0));
  EXPECT_EQ(specials_allowed(), std::vector<std::string>{"<|tool_call_begin|>"});
  ASSERT_TRUE(m.accept_token(w.base + 2));
  EXPECT_TRUE(specials_allowed().empty()) << "the name comes next";
  ASSERT_TRUE(m.accept_bytes("functions.add:0"));
  EXPECT_EQ(specials_allowed(), std::vector<std::string>{"<|tool_call_argument_begin|>"});
  // The spelled-out text is still the grammar's.
  EXPECT_TRUE(m.accept_bytes("<|tool_call_argument_begin|>"));
  EXPECT_TRUE(specials_allowed().empty()) << "inside the arguments";
  // Without the list, no special token at all.
  StructuredOutputSpec plain{StructuredOutputSpec::Kind::Grammar, g.ebnf, {}, true};
  GrammarMatcher p(compiler.compile(plain), {w.eos});
  p.fill_next_token_bitmask(words.data());
  for (int32_t t = w.base; t < w.vocab->mask_size(); ++t) EXPECT_FALSE(bit(words, t)) << w.vocab->bytes(t);
  EXPECT_FALSE(p.accept_token(w.base + 0));
  EXPECT_NE(spec.cache_key(), plain.cache_key());
}

TEST(ToolGrammar, NothingIsMaskedBeforeTheStartAfterSequence) {
  const WalkVocabulary& w = walk_vocabulary();
  GrammarCompiler compiler(w.vocab);
  const int32_t close = w.base + 6, sep = w.base + 7;  // <|close|>, <|sep|>
  const std::vector<int32_t> think = w.tokenizer->encode("think");
  std::vector<int32_t> trigger = {close};
  trigger.insert(trigger.end(), think.begin(), think.end());
  trigger.push_back(sep);
  StructuredOutputSpec spec{StructuredOutputSpec::Kind::Regex, "[0-9]+", {}, true, {}, trigger};
  GrammarMatcher m(compiler.compile(spec), {w.eos});
  std::vector<uint32_t> words(size_t(w.vocab->mask_words()));
  const int32_t letter = w.tokenizer->encode("a").at(0);
  auto allowed = [&] { return m.fill_next_token_bitmask(words.data()); };
  EXPECT_EQ(allowed(), w.vocab->mask_size());
  EXPECT_FALSE(m.started());
  // Reasoning text, a partial trigger, the eos: all allowed and accepted.
  for (int32_t t : {letter, close, letter, w.stray}) ASSERT_TRUE(m.accept_token(t));
  EXPECT_EQ(allowed(), w.vocab->mask_size());
  EXPECT_FALSE(m.is_terminated());
  for (int32_t t : trigger) ASSERT_TRUE(m.accept_token(t));
  EXPECT_TRUE(m.started());
  const int64_t after = allowed();
  EXPECT_LT(after, w.vocab->mask_size());
  EXPECT_FALSE(bit(words, letter));
  EXPECT_FALSE(m.accept_token(letter));
  ASSERT_TRUE(m.accept_bytes("42"));
  EXPECT_TRUE(m.is_terminated());
  // Rolling back past the trigger opens everything again.
  m.rollback(1);
  EXPECT_TRUE(m.started());
  EXPECT_EQ(allowed(), after);
  m.rollback(1);
  EXPECT_FALSE(m.started());
  EXPECT_EQ(allowed(), w.vocab->mask_size());
  EXPECT_EQ(m.num_accepted(), int64_t(4 + trigger.size() - 1));
  StructuredOutputSpec at_once{StructuredOutputSpec::Kind::Regex, "[0-9]+", {}, true};
  EXPECT_NE(spec.cache_key(), at_once.cache_key());
}

TEST(ToolGrammar, GbnfPrintingRoundTrips) {
  // A JSON schema's grammar printed as GBNF and read back accepts and refuses the same texts.
  const Grammar g = grammar_from_json_schema(R"({"type": "object", "properties": {"s": {"type": "string",
      "pattern": "ab[\u00e9-\u00f0]"}, "t": {"type": "string"}, "n": {"type": "number"}}, "required": ["s"]})",
                                             {.any_whitespace = false});
  const Grammar back = grammar_from_ebnf("root ::= x-0\n" + to_gbnf(g, "x-"));
  auto accepted = [&](const Grammar& grammar, const std::string& text) {
    GrammarMatcher m(std::make_shared<const CompiledGrammar>(grammar, byte_vocabulary()), {});
    return m.accept_bytes(text) && m.is_terminated();
  };
  for (const std::string text : {"{\"s\": \"ab\xC3\xA9\"}", "{\"s\": \"ab\xC3\xB0\", \"t\": \"q\\\"\\\\\\n\x01\"}",
                                 "{\"s\": \"abc\"}", "{\"s\": \"ab\xC3\xA9\", \"n\": -1.5e3}", "{\"n\": 1}"}) {
    EXPECT_EQ(accepted(g, text), accepted(back, text)) << text;
  }
  EXPECT_TRUE(accepted(back, "{\"s\": \"ab\xC3\xA9\", \"n\": -1.5e3}"));
  EXPECT_FALSE(accepted(back, "{\"s\": \"abc\"}"));
  EXPECT_EQ(gbnf_literal("a\"\\\n"), "\"a\\\"\\\\\\x0A\"");
}

}  // namespace
