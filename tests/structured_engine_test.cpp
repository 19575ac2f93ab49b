// Structured outputs through the engine (engine/engine_core.cpp, ops::sample_tokens' token bitmask) on the
// trained deepseek_v32 model with its tokenizer: sampled outputs are valid JSON for their schema, match
// their regex or choice, stay inside allowed_token_ids, follow logit_bias; a small cache that forces
// preemption gives every structured request exactly the tokens it gets alone (its grammar is not fed
// twice); bad specs are refused at validation.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <regex>

#include "cache/planner.h"
#include "engine/engine_core.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "server/parsers/parser.h"
#include "tokenizer/tokenizer.h"

namespace sparrow {
namespace {

constexpr const char* kModel = SPARROW_SOURCE_DIR "/models/deepseek_v32";

struct Loaded {
  std::unique_ptr<Model> model = load_model(kModel);
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(kModel);
};
Loaded& loaded() {
  static Loaded l;
  return l;
}

EngineConfig config_with_blocks(const Model& model, int64_t blocks, int64_t max_num_seqs) {
  EngineConfig config;
  config.max_model_len = 256;
  config.max_num_seqs = max_num_seqs;
  config.max_num_batched_tokens = 4096;
  CacheConfig cache;
  cache.block_size = 16;
  cache.kv_cache_dtype = "float32";
  cache.max_num_seqs = max_num_seqs;
  cache.memory_bytes = int64_t(1) << 30;
  const CachePlan plan = plan_cache(model.cache_spec(), cache);
  cache.memory_bytes = blocks * plan.row_bytes + (plan.num_state_slots + plan.num_snapshot_slots) * plan.state_slot_bytes;
  config.cache = cache;
  return config;
}

struct Output {
  std::vector<int32_t> tokens;
  std::string text, finish_reason;
};

// Runs the requests together; outputs keyed "id/index".
std::map<std::string, Output> run(const std::vector<Request>& requests, EngineConfig config,
                                  int64_t* preemptions = nullptr) {
  Loaded& l = loaded();
  EngineCore engine(*l.model, l.tokenizer.get(), config);
  std::map<std::string, Output> out;
  for (const Request& r : requests)
    engine.add(r, [&](const RequestOutput& e) {
      Output& o = out[e.request_id + "/" + std::to_string(e.index)];
      o.tokens.insert(o.tokens.end(), e.new_tokens.begin(), e.new_tokens.end());
      o.text += e.new_text;
      if (e.finished) o.finish_reason = e.finish_reason;
    });
  for (int steps = 0; engine.step(); ++steps) EXPECT_LT(steps, 100000);
  if (preemptions) *preemptions = engine.stats().preemptions;
  return out;
}

Request request(std::string id, const std::string& prompt, structured::StructuredOutputSpec spec, uint64_t seed) {
  Request r{std::move(id), loaded().tokenizer->encode(prompt), {}};
  r.params.structured = std::move(spec);
  r.params.seed = seed;
  r.params.max_tokens = 200;
  return r;
}

const char* kSchema = R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
    "count": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "count"]})";

TEST(StructuredEngine, SampledOutputsFollowTheirSpecs) {
  using Kind = structured::StructuredOutputSpec::Kind;
  std::vector<Request> requests;
  Request json = request("json", "def parse(data):\n", {Kind::JsonSchema, kSchema, {}, true}, 1);
  json.params.n = 3;
  requests.push_back(json);
  requests.push_back(request("regex", "x = ", {Kind::Regex, R"([a-z]+\(\d{1,3}\))", {}, true}, 2));
  requests.push_back(request("choice", "The answer is", {Kind::Choice, "", {"yes", "no", "maybe"}, true}, 3));
  requests.push_back(request("object", "{", {Kind::JsonObject, "", {}, true}, 4));
  auto out = run(requests, config_with_blocks(*loaded().model, 200, 8));
  int whole = 0;
  for (int i = 0; i < 3; ++i) {
    const Output& o = out.at("json/" + std::to_string(i));
    std::printf("[ output ] json/%d (%s): %s\n", i, o.finish_reason.c_str(), o.text.c_str());
    if (o.finish_reason == "length") continue;  // the model wandered for 200 tokens: no verdict
    EXPECT_EQ(o.finish_reason, "stop") << o.text;
    nlohmann::json v = nlohmann::json::parse(o.text);
    EXPECT_TRUE(v.contains("name") && v["name"].is_string() && v.contains("count") && v["count"].is_number_integer()) << o.text;
    ++whole;
  }
  EXPECT_GE(whole, 1);
  EXPECT_TRUE(std::regex_match(out.at("regex/0").text, std::regex(R"([a-z]+\(\d{1,3}\))"))) << out.at("regex/0").text;
  const std::string choice = out.at("choice/0").text;
  EXPECT_TRUE(choice == "yes" || choice == "no" || choice == "maybe") << choice;
  EXPECT_EQ(out.at("choice/0").finish_reason, "stop");
  if (out.at("object/0").finish_reason == "stop") EXPECT_TRUE(nlohmann::json::parse(out.at("object/0").text).is_object());
}

TEST(StructuredEngine, PreemptionDoesNotFeedTheGrammarTwice) {
  using Kind = structured::StructuredOutputSpec::Kind;
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) {
    Request r = request("r" + std::to_string(i), "import os\nimport sys\n# parse the config file into a dict\n",
                        {Kind::JsonSchema, kSchema, {}, true}, uint64_t(10 + i));
    r.params.max_tokens = 60;
    requests.push_back(r);
  }
  std::map<std::string, Output> alone;
  for (const Request& r : requests) {
    auto one = run({r}, config_with_blocks(*loaded().model, 200, 8));
    alone[r.id + "/0"] = one.at(r.id + "/0");
  }
  // 6 sequences of up to ~80 tokens in 20 blocks of 16: preemption by recompute happens.
  int64_t preemptions = 0;
  auto together = run(requests, config_with_blocks(*loaded().model, 20, 6), &preemptions);
  EXPECT_GT(preemptions, 0);
  for (const auto& [key, o] : alone) {
    EXPECT_EQ(together.at(key).tokens, o.tokens) << key;
    EXPECT_EQ(together.at(key).finish_reason, o.finish_reason) << key;
  }
}

TEST(StructuredEngine, AllowedTokenIdsAndLogitBias) {
  Loaded& l = loaded();
  Request allowed{"allowed", l.tokenizer->encode("def f"), {}};
  allowed.params.temperature = 1.0f;
  allowed.params.seed = 5;
  allowed.params.max_tokens = 30;
  allowed.params.allowed_token_ids = std::vector<int32_t>{100, 200, 300};
  Request biased{"biased", l.tokenizer->encode("def f"), {}};
  biased.params.temperature = 0;
  biased.params.max_tokens = 5;
  biased.params.logit_bias = {{1234, 100.0f}};
  auto out = run({allowed, biased}, config_with_blocks(*l.model, 200, 8));
  EXPECT_EQ(out.at("allowed/0").tokens.size(), 30u);
  for (int32_t t : out.at("allowed/0").tokens) EXPECT_TRUE(t == 100 || t == 200 || t == 300) << t;
  EXPECT_EQ(out.at("biased/0").tokens, std::vector<int32_t>(5, 1234));
}

TEST(StructuredEngine, BadSpecsAndIdsAreRefusedAtValidation) {
  Loaded& l = loaded();
  EngineCore engine(*l.model, l.tokenizer.get(), config_with_blocks(*l.model, 20, 2));
  using Kind = structured::StructuredOutputSpec::Kind;
  Request r = request("bad", "x", {Kind::Regex, "(a", {}, true}, 1);
  EXPECT_THROW(engine.validate(r), Error);
  r = request("bad", "x", {Kind::JsonSchema, R"({"type": "nope"})", {}, true}, 1);
  EXPECT_THROW(engine.validate(r), Error);
  r = request("ids", "x", {}, 1);
  r.params.allowed_token_ids = std::vector<int32_t>{int32_t(l.model->vocab_size())};
  EXPECT_THROW(engine.validate(r), Error);
  r.params.allowed_token_ids = std::vector<int32_t>{};
  EXPECT_THROW(engine.validate(r), Error);
  r.params.allowed_token_ids.reset();
  r.params.logit_bias = {{5, 101.0f}};
  EXPECT_THROW(engine.validate(r), Error);
  r.params.logit_bias = {{int32_t(l.model->vocab_size()), 1.0f}};
  EXPECT_THROW(engine.validate(r), Error);
  // A grammar that allows nothing after its end ends the choice cleanly when the end token is ignored.
  Request done = request("done", "x", {Kind::Choice, "", {"ab"}, true}, 1);
  done.params.ignore_eos = true;
  auto out = run({done}, config_with_blocks(*l.model, 20, 2));
  EXPECT_EQ(out.at("done/0").text, "ab");
  EXPECT_EQ(out.at("done/0").finish_reason, "stop");
}

TEST(StructuredEngine, ForcedToolCallsAlwaysParse) {
  // tool_choice "required" as the server builds it (parsers/tool_grammar.cpp): the deepseek_v32 model's own
  // DSML markup, its ｜DSML｜ special token allowed; every finished sample parses into a valid call, and
  // the model writes the special token, as it was trained to, rather than spelling it out.
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object",
      "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "convert_units", "parameters": {"type": "object",
      "properties": {"value": {"type": "number"}, "from_unit": {"type": "string", "enum": ["km", "mi"]},
                     "to_unit": {"type": "string", "enum": ["km", "mi"]}}, "required": ["value", "from_unit", "to_unit"]}}}])");
  const parsers::ToolGrammar grammar = parsers::tool_call_grammar("deepseek_v32", tools, {});
  structured::StructuredOutputSpec spec;
  spec.kind = structured::StructuredOutputSpec::Kind::Grammar;
  spec.text = grammar.ebnf;
  spec.special_tokens = grammar.special_tokens;
  Request r = request("call", "<｜User｜>What is 12 * 7?<｜Assistant｜></think>", spec, 5);
  r.params.n = 6;
  r.params.max_tokens = 160;
  r.params.skip_special_tokens = false;
  const std::optional<int32_t> dsml = loaded().tokenizer->token_to_id("｜DSML｜");
  ASSERT_TRUE(dsml);
  auto out = run({r}, config_with_blocks(*loaded().model, 200, 8));
  int parsed = 0, special = 0;
  for (int i = 0; i < 6; ++i) {
    const Output& o = out.at("call/" + std::to_string(i));
    std::printf("[ output ] call/%d (%s): %s\n", i, o.finish_reason.c_str(), o.text.c_str());
    if (o.finish_reason == "length") continue;  // wandered in a raw string for 160 tokens: no verdict
    EXPECT_EQ(o.finish_reason, "stop");
    parsers::OutputParser parser(nullptr, parsers::make_tool_parser("deepseek_v32", nlohmann::json::parse(tools.dump()), 1));
    const parsers::ParsedOutput result = parsers::parse_output(parser, o.text);
    ASSERT_EQ(result.tool_calls.size(), 1u) << o.text;
    const auto args = nlohmann::json::parse(result.tool_calls[0].arguments);
    if (result.tool_calls[0].name == "calculator") {
      EXPECT_TRUE(args["expression"].is_string()) << o.text;
    } else {
      ASSERT_EQ(result.tool_calls[0].name, "convert_units");
      EXPECT_TRUE(args["value"].is_number() && args["from_unit"].is_string() && args["to_unit"].is_string()) << o.text;
    }
    ++parsed;
    special += std::count(o.tokens.begin(), o.tokens.end(), *dsml) > 0;
  }
  EXPECT_GE(parsed, 3);
  EXPECT_GE(special, 1) << "the model never wrote its ｜DSML｜ token";
}

TEST(StructuredSampling, BitmaskAndBiasOnTheCpu) {
  // Row 0 masked to {3, 7}, row 1 unmasked but biased: the draw honours both.
  const int64_t vocab = 40;
  Tensor logits = Tensor::empty({2, vocab}, ScalarType::F32);
  for (int64_t i = 0; i < 2 * vocab; ++i) logits.as<float>()[i] = float(i % vocab) * 0.1f;
  std::vector<uint32_t> words(2, 0);
  words[0] = (1u << 3) | (1u << 7);
  std::vector<int32_t> rows = {0};
  std::vector<TokenDraw> draws(2);
  draws[0].temperature = draws[1].temperature = 0;
  std::vector<LogitAdjustment> adjustments(1);
  adjustments[0].row = 1;
  adjustments[0].token = 2;
  adjustments[0].bias = 50.0f;
  auto tokens = ops::sample_tokens(logits, draws, adjustments, {rows, words, 2});
  EXPECT_EQ(tokens, (std::vector<int32_t>{7, 2}));
  for (uint64_t key = 0; key < 200; ++key) {
    draws[0].temperature = 5.0f;
    draws[0].key = key;
    const int32_t t = ops::sample_tokens(logits, draws, {}, {rows, words, 2})[0];
    EXPECT_TRUE(t == 3 || t == 7) << t;
  }
}

}  // namespace
}  // namespace sparrow
