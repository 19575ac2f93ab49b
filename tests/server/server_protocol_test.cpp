// The server's engine-independent layers: request validation (openai_requests.h), error bodies,
// the chat output rules on top of the parsers (chat_output.h), response pieces, metrics and the
// engine-to-handler event queue.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "server/api_error.h"
#include "server/chat_output.h"
#include "server/event_queue.h"
#include "server/metrics.h"
#include "server/openai_requests.h"
#include "server/openai_responses.h"

namespace sparrow::server {
namespace {

Json parse(const std::string& text) { return Json::parse(text); }

// The status and `param` of the ApiError `fn` throws.
template <typename Fn>
std::pair<int, std::string> rejection(Fn fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return {e.status(), e.param()};
  }
  return {0, "(accepted)"};
}

ChatRequest chat(const std::string& text) { return parse_chat_request(parse(text), SamplingParams{}, kMaxLogprobs); }
CompletionRequest completion(const std::string& text) {
  return parse_completion_request(parse(text), SamplingParams{}, kMaxLogprobs, 4);
}

const char* kTools = R"([{"type": "function", "function": {"name": "get_weather",
                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";

TEST(ServerRequests, ChatDefaultsAndFields) {
  ChatRequest r = chat(R"({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "n": 2,
                           "stop": "x", "seed": 3, "logprobs": true, "top_logprobs": 2})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.max_tokens, 7);  // max_completion_tokens wins
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.n, 2);
  EXPECT_EQ(r.sampling.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(r.sampling.seed, 3u);
  EXPECT_EQ(r.sampling.logprobs, 2);
  EXPECT_EQ(r.tool_choice.mode, ToolChoice::Mode::None);
  EXPECT_TRUE(r.template_input["add_generation_prompt"].get<bool>());

  ChatRequest with_tools =
      chat(std::string(R"({"messages": [{"role": "user", "content": "hi"}], "tools": )") + kTools + "}");
  EXPECT_EQ(with_tools.tool_choice.mode, ToolChoice::Mode::Auto);  // the default with tools
  // The tool schema reaches the template in the client's key order.
  EXPECT_EQ(with_tools.template_input["tools"][0]["function"].begin().key(), "name");
}

TEST(ServerRequests, ChatValidationErrors) {
  const std::string messages = R"("messages": [{"role": "user", "content": "hi"}])";
  auto status_param = [&](const std::string& rest) {
    return rejection([&] { chat("{" + messages + ", " + rest + "}"); });
  };
  EXPECT_EQ(status_param(R"("tools": [])"), std::make_pair(400, std::string("tools")));
  EXPECT_EQ(status_param(R"("tool_choice": "auto")"), std::make_pair(400, std::string("tool_choice")));
  EXPECT_EQ(status_param(R"("tool_choice": "sometimes", "tools": )" + std::string(kTools)),
            std::make_pair(400, std::string("tool_choice")));
  EXPECT_EQ(status_param(R"("tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": )" +
                         std::string(kTools)),
            std::make_pair(400, std::string("tool_choice.function.name")));
  EXPECT_EQ(status_param(R"("stream_options": {"include_usage": true})"),
            std::make_pair(400, std::string("stream_options")));
  EXPECT_EQ(status_param(R"("top_logprobs": 3)"), std::make_pair(400, std::string("top_logprobs")));
  EXPECT_EQ(status_param(R"("max_tokens": -1)"), std::make_pair(400, std::string("max_tokens")));
  EXPECT_EQ(status_param(R"("max_tokens": "ten")"), std::make_pair(400, std::string("max_tokens")));
  EXPECT_EQ(status_param(R"("temperature": "hot")"), std::make_pair(400, std::string("temperature")));
  EXPECT_EQ(status_param(R"("top_p": 0)"), std::make_pair(400, std::string("top_p")));
  EXPECT_EQ(status_param(R"("n": 0)"), std::make_pair(400, std::string("n")));
  EXPECT_EQ(status_param(R"("stop": [1])"), std::make_pair(400, std::string("stop")));
  // Structured outputs and logit controls: bad values are 400s naming the field (docs/server.md).
  EXPECT_EQ(status_param(R"("response_format": {"type": "xml"})"), std::make_pair(400, std::string("response_format.type")));
  EXPECT_EQ(status_param(R"("response_format": {"type": "json_schema"})"),
            std::make_pair(400, std::string("response_format.json_schema")));
  EXPECT_EQ(status_param(R"("response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})"),
            std::make_pair(400, std::string("response_format.json_schema.schema")));
  EXPECT_EQ(status_param(R"("logit_bias": {"x": 5})"), std::make_pair(400, std::string("logit_bias")));
  EXPECT_EQ(status_param(R"("logit_bias": {"1": 500})"), std::make_pair(400, std::string("logit_bias")));
  EXPECT_EQ(status_param(R"("allowed_token_ids": [])"), std::make_pair(400, std::string("allowed_token_ids")));
  EXPECT_EQ(status_param(R"("structured_outputs": {"regex": "(a"})"), std::make_pair(400, std::string("structured_outputs.regex")));
  EXPECT_EQ(status_param(R"("structured_outputs": {"grammar": "start ::= \"a\""})"),
            std::make_pair(400, std::string("structured_outputs.grammar")));
  EXPECT_EQ(status_param(R"("structured_outputs": {"choice": []})"), std::make_pair(400, std::string("structured_outputs.choice")));
  EXPECT_EQ(status_param(R"("structured_outputs": {"structural_tag": "{}"})"),
            std::make_pair(400, std::string("structured_outputs.structural_tag")));
  EXPECT_EQ(status_param(R"("guided_json": {"not": {}})"), std::make_pair(400, std::string("guided_json")));
  EXPECT_EQ(status_param(R"("guided_choice": "yes")"), std::make_pair(400, std::string("guided_choice")));
  EXPECT_EQ(status_param(R"("guided_regex": "a+", "guided_choice": ["a"])"), std::make_pair(400, std::string("guided_choice")));
  EXPECT_EQ(status_param(R"("guided_regex": "a{0,99999}")"), std::make_pair(400, std::string("guided_regex")));
  EXPECT_EQ(status_param(R"("bad_words": ["x"])"), std::make_pair(400, std::string("bad_words")));
  EXPECT_EQ(status_param(R"("stream": true, "prompt_logprobs": 1)"),
            std::make_pair(400, std::string("prompt_logprobs")));
  EXPECT_EQ(rejection([&] { chat(R"({"messages": []})"); }), std::make_pair(400, std::string("messages")));
  EXPECT_EQ(rejection([&] { chat(R"({"messages": [{"content": "no role"}]})"); }),
            std::make_pair(400, std::string("messages[0].role")));
  EXPECT_EQ(rejection([&] { chat(R"({"model": "m"})"); }), std::make_pair(400, std::string("messages")));
  EXPECT_EQ(rejection([&] { parse_json_object("{not json"); }).first, 400);
  EXPECT_EQ(rejection([&] { parse_json_object("[1]"); }).first, 400);
}

// The message of the ApiError `fn` throws.
template <typename Fn>
std::string rejection_message(Fn fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(ServerRequests, StructuredOutputFieldsReachTheSamplingParams) {
  using Kind = structured::StructuredOutputSpec::Kind;
  const std::string messages = R"({"messages": [{"role": "user", "content": "hi"}], )";
  ChatRequest r = chat(messages + R"("structured_outputs": {"json": {"type": "object", "properties": {"b": {}, "a": {}}},
                                     "disable_any_whitespace": true}})");
  EXPECT_EQ(r.sampling.structured.kind, Kind::JsonSchema);
  EXPECT_EQ(r.sampling.structured.text, R"({"type":"object","properties":{"b":{},"a":{}}})");  // order kept
  EXPECT_FALSE(r.sampling.structured.any_whitespace);
  r = chat(messages + R"("guided_json": "{\"type\": \"string\"}", "guided_decoding_backend": "xgrammar"})");
  EXPECT_EQ(r.sampling.structured.text, R"({"type": "string"})");
  r = chat(messages + R"("guided_choice": ["a", "b"]})");
  EXPECT_EQ(r.sampling.structured.kind, Kind::Choice);
  EXPECT_EQ(r.sampling.structured.choices, (std::vector<std::string>{"a", "b"}));
  r = chat(messages + R"("response_format": {"type": "json_object"}})");
  EXPECT_EQ(r.sampling.structured.kind, Kind::JsonObject);
  r = chat(messages + R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": {"type": "integer"}}}})");
  EXPECT_EQ(r.sampling.structured.kind, Kind::JsonSchema);
  r = chat(messages + R"("response_format": {"type": "text"}, "guided_regex": "a+", "logit_bias": {"7": -3.5}, "allowed_token_ids": [1, 2]})");
  EXPECT_EQ(r.sampling.structured.kind, Kind::Regex);
  EXPECT_EQ(r.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{7, -3.5f}}));
  EXPECT_EQ(*r.sampling.allowed_token_ids, (std::vector<int32_t>{1, 2}));
  CompletionRequest c = parse_completion_request(parse(R"({"prompt": "x", "structured_outputs": {"grammar": "root ::= [a-z]+"}})"),
                                                 SamplingParams{}, kMaxLogprobs, 16);
  EXPECT_EQ(c.sampling.structured.kind, Kind::Grammar);
}

TEST(ServerRequests, BodiesNestedTooDeepAreRefusedBeforeParsing) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  // The issue's reproduction: 30,000 levels in a message's content.
  std::string deep = R"({"messages": [{"role": "user", "content": )" + nested(30000) + "}]}";
  EXPECT_EQ(rejection([&] { parse_json_object(deep); }).first, 400);
  EXPECT_NE(rejection_message([&] { parse_json_object(deep); }).find("more than 128 levels deep"), std::string::npos);
  // 128 levels in all (the body and messages take 3 of them) still parse.
  EXPECT_NO_THROW(parse_json_object(R"({"messages": [{"role": "user", "content": )" + nested(125) + "}]}"));
  EXPECT_EQ(rejection([&] { parse_json_object(R"({"messages": [{"role": "user", "content": )" + nested(126) + "}]}"); })
                .first,
            400);
}

TEST(ServerRequests, FloatFieldsRefuseValuesBeyondFloat32) {
  const std::string messages = R"("messages": [{"role": "user", "content": "hi"}])";
  for (const char* field : {"temperature", "repetition_penalty"}) {
    std::string body = "{" + messages + ", \"" + field + "\": 1e308}";
    EXPECT_EQ(rejection([&] { chat(body); }), std::make_pair(400, std::string(field)));
    std::string message = rejection_message([&] { chat(body); });
    EXPECT_NE(message.find("got 1e+308"), std::string::npos) << message;
    EXPECT_EQ(rejection([&] { completion(R"({"prompt": "a", ")" + std::string(field) + R"(": 1e39})"); }),
              std::make_pair(400, std::string(field)));
  }
  // Out-of-range messages show the value given too.
  EXPECT_NE(rejection_message([&] { chat("{" + messages + R"(, "top_p": 1.5})"); }).find("got 1.5"), std::string::npos);
  EXPECT_EQ(chat("{" + messages + R"(, "temperature": 3.4e38})").sampling.temperature, 3.4e38f);  // still a float
  // An integer field given a huge float is refused, not converted out of range.
  EXPECT_EQ(rejection([&] { chat("{" + messages + R"(, "top_k": 1e300})"); }), std::make_pair(400, std::string("top_k")));
}

// vLLM's content forms: a string, a list of content parts, or null for an assistant message.
TEST(ServerRequests, MessageContentTypes) {
  auto with_content = [](const std::string& role, const std::string& content) {
    return R"({"messages": [{"role": "user", "content": "hi"}, {"role": ")" + role + R"(", "content": )" + content +
           "}]}";
  };
  for (const char* content : {R"("text")", R"([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])", "[]"})
    EXPECT_NO_THROW(chat(with_content("user", content))) << content;
  EXPECT_NO_THROW(chat(with_content("assistant", "null")));
  EXPECT_NO_THROW(chat(R"({"messages": [{"role": "assistant", "tool_calls": []}]})"));  // no content at all

  for (const char* content : {"42", "true", R"({"text": "a"})", "null"})
    EXPECT_EQ(rejection([&] { chat(with_content("user", content)); }), std::make_pair(400, std::string("messages[1].content")))
        << content;
  EXPECT_EQ(rejection([&] { chat(with_content("user", "[[\"a\"]]")); }),
            std::make_pair(400, std::string("messages[1].content[0]")));
  EXPECT_EQ(rejection([&] { chat(with_content("user", R"(["a"])")); }),
            std::make_pair(400, std::string("messages[1].content[0]")));
  EXPECT_EQ(rejection([&] { chat(with_content("user", R"([{"text": "a"}])")); }),
            std::make_pair(400, std::string("messages[1].content[0].type")));
  EXPECT_EQ(rejection([&] { chat(with_content("user", R"([{"type": "text", "text": 5}])")); }),
            std::make_pair(400, std::string("messages[1].content[0].text")));
  // Media parts other than images are refused, not dropped.
  for (const char* type : {"input_audio", "video_url", "file", "audio_url"}) {
    std::string content = std::string(R"([{"type": "text", "text": "see"}, {"type": ")") + type + R"(", ")" + type +
                          R"(": {"url": "https://example.com/x"}}])";
    EXPECT_EQ(rejection([&] { chat(with_content("user", content)); }),
              std::make_pair(400, std::string("messages[1].content[1].type")))
        << type;
    std::string message = rejection_message([&] { chat(with_content("user", content)); });
    EXPECT_NE(message.find(std::string("'") + type + "' are not supported"), std::string::npos) << message;
  }
  // Image parts: their URLs kept in order, each seen by the template as {"type": "image"} (server/chat_images.h
  // loads them); one without its url is a 400 naming it.
  const ChatRequest images = chat(with_content(
      "user", R"([{"type": "image_url", "image_url": {"url": "data:a"}}, {"type": "text", "text": "and"},
                  {"type": "image_url", "image_url": {"url": "data:b"}}])"));
  ASSERT_EQ(images.images.size(), 2u);
  EXPECT_EQ(images.images[0].url, "data:a");
  EXPECT_EQ(images.images[1].param, "messages[1].content[2].image_url.url");
  const Json& parts = images.template_input["messages"][1]["content"];
  EXPECT_EQ(parts[0], Json({{"type", "image"}}));
  EXPECT_EQ(parts[1]["text"], "and");
  EXPECT_EQ(rejection([&] { chat(with_content("user", R"([{"type": "image_url", "image_url": {}}])")); }),
            std::make_pair(400, std::string("messages[1].content[0].image_url.url")));
}

TEST(ServerRequests, CompletionPrompts) {
  EXPECT_EQ(completion(R"({"prompt": "abc"})").prompts, std::vector<Prompt>{std::string("abc")});
  std::vector<Prompt> ids = {std::vector<int32_t>{1, 2}};
  EXPECT_EQ(completion(R"({"prompt": [1, 2]})").prompts, ids);
  CompletionRequest many = completion(R"({"prompt": [[1], [2, 3]], "logprobs": 2, "echo": true})");
  EXPECT_EQ(many.prompts.size(), 2u);
  EXPECT_EQ(many.logprobs, 2);
  EXPECT_TRUE(many.echo);
  EXPECT_EQ(completion(R"({"prompt": "a"})").max_tokens, 16);  // OpenAI's completions default
  EXPECT_EQ(completion(R"({"prompt": "a", "max_tokens": null})").max_tokens, 16);

  EXPECT_EQ(rejection([] { completion(R"({"prompt": ""})"); }), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(rejection([] { completion(R"({"prompt": []})"); }), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(rejection([] { completion(R"({"prompt": [-1]})"); }), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(rejection([] { completion(R"({"prompt": [1.5]})"); }), std::make_pair(400, std::string("prompt")));
  EXPECT_EQ(rejection([] { completion(R"({"prompt": ["a","b","c","d","e"]})"); }).first, 400);  // > 4 prompts
  EXPECT_EQ(rejection([] { completion(R"({"prompt": "a", "logprobs": 21})"); }),
            std::make_pair(400, std::string("logprobs")));
  EXPECT_EQ(rejection([] { completion(R"({})"); }), std::make_pair(400, std::string("prompt")));
}

TEST(ServerRequests, ModelDefaultsApplyUnlessGiven) {
  SamplingParams defaults;
  defaults.temperature = 0.6f;
  defaults.top_k = 40;
  ChatRequest r =
      parse_chat_request(parse(R"({"messages": [{"role": "user", "content": "x"}], "top_k": 5})"), defaults, 20);
  EXPECT_EQ(r.sampling.temperature, 0.6f);
  EXPECT_EQ(r.sampling.top_k, 5);
}

// vLLM's chat echo: the last message's text when it is the assistant's (the response's role), content
// parts joined by newlines; nothing for another role or without echo.
TEST(ServerRequests, ChatEcho) {
  const std::string user = R"({"role": "user", "content": "hi"})";
  auto echo_of = [&](const std::string& last, const std::string& echo = "true") {
    return chat(R"({"messages": [)" + user + ", " + last + R"(], "echo": )" + echo + "}").echo_text;
  };
  EXPECT_EQ(echo_of(R"({"role": "assistant", "content": "I am"})"), "I am");
  EXPECT_EQ(echo_of(R"({"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})"),
            "a\nb");
  EXPECT_EQ(echo_of(R"({"role": "assistant", "content": null})"), "");
  EXPECT_EQ(echo_of(R"({"role": "user", "content": "again"})"), "");
  EXPECT_EQ(echo_of(R"({"role": "assistant", "content": "I am"})", "false"), "");
  EXPECT_EQ(chat(R"({"messages": [{"role": "assistant", "content": "x"}]})").echo_text, "");
}

TEST(ServerErrors, OpenAiErrorObject) {
  Json body = error_body(400, "bad", "tools");
  EXPECT_EQ(body, parse(R"({"error": {"message": "bad", "type": "BadRequestError", "param": "tools", "code": 400}})"));
  EXPECT_TRUE(error_body(404, "x")["error"]["param"].is_null());
  EXPECT_EQ(error_type(401), "AuthenticationError");
  EXPECT_EQ(error_type(413), "RequestTooLargeError");
  EXPECT_EQ(error_type(503), "ServiceUnavailableError");
}

// Kimi K2 markup (server/parsers/markers.h), fed in small pieces as the engine would.
const std::string kKimiOutput =
    "Let me check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"zone\": \"CET\"}<|tool_call_end|>"
    "<|tool_calls_section_end|>";

struct Streamed {
  std::vector<Json> deltas;
  ChatChoiceOutput output;
};

Streamed stream_kimi(ChatOutputRules rules, size_t piece = 5) {
  Streamed s{{},
             ChatChoiceOutput(std::make_unique<parsers::OutputParser>(
                                  nullptr, parsers::make_tool_parser("kimi_k2", nlohmann::json(nullptr))),
                              rules)};
  for (size_t at = 0; at < kKimiOutput.size(); at += piece) {
    bool last = at + piece >= kKimiOutput.size();
    parsers::OutputDelta d = s.output.feed(kKimiOutput.substr(at, piece), 1, last);
    if (!d.empty()) s.deltas.push_back(delta_json(d));
  }
  return s;
}

TEST(ServerChatOutput, StreamedToolCallsJoinToTheMessage) {
  Streamed s = stream_kimi({});
  std::string content;
  std::map<int, std::string> arguments;
  std::map<int, int> headers;  // pieces carrying id/type/name per index
  for (const Json& d : s.deltas) {
    if (d.contains("content")) content += d["content"].get<std::string>();
    for (const Json& call : d.value("tool_calls", Json::array())) {
      int index = call["index"];
      if (call.contains("id")) {
        ++headers[index];
        EXPECT_EQ(call["type"], "function");
        EXPECT_TRUE(call["function"].contains("name"));
      }
      arguments[index] += call["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(content, "Let me check. ");  // no markup leaks into content
  EXPECT_EQ(headers, (std::map<int, int>{{0, 1}, {1, 1}}));
  Json message = message_json(s.output.joined(), false);
  ASSERT_EQ(message["tool_calls"].size(), 2u);
  EXPECT_EQ(message["content"], "Let me check. ");
  EXPECT_EQ(message["tool_calls"][0]["id"], "functions.get_weather:0");
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(arguments[0]),
            Json::parse(message["tool_calls"][0]["function"]["arguments"].get<std::string>()));
  EXPECT_EQ(Json::parse(arguments[1]), parse(R"({"zone": "CET"})"));
  EXPECT_EQ(s.output.finish_reason("stop"), "tool_calls");
}

TEST(ServerChatOutput, NamedChoiceAndNoParallelCalls) {
  ChatOutputRules named;
  named.only_function = "get_time";
  named.tool_calls_finish = false;  // a named tool_choice finishes with "stop", as vLLM
  Streamed s = stream_kimi(named, 3);
  Json message = message_json(s.output.joined(), false);
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_time");
  for (const Json& d : s.deltas)
    for (const Json& call : d.value("tool_calls", Json::array())) EXPECT_EQ(call["index"], 0);  // renumbered
  EXPECT_EQ(s.output.finish_reason("stop"), "stop");

  ChatOutputRules single;
  single.parallel_tool_calls = false;
  Streamed first_only = stream_kimi(single, 7);
  ASSERT_EQ(first_only.output.joined().tool_calls.size(), 1u);
  EXPECT_EQ(first_only.output.joined().tool_calls[0].name, "get_weather");
}

TEST(ServerChatOutput, ReasoningCanBeDropped) {
  auto run = [](bool include) {
    ChatOutputRules rules;
    rules.include_reasoning = include;
    ChatChoiceOutput out(std::make_unique<parsers::OutputParser>(parsers::make_reasoning_parser("kimi_k2"), nullptr),
                         rules);
    out.feed("<think>plan", 2, false);
    out.feed("</think>Hello", 2, true);
    return out;
  };
  ChatChoiceOutput with = run(true);
  EXPECT_EQ(with.joined().reasoning, "plan");
  EXPECT_EQ(with.joined().content, "Hello");
  EXPECT_EQ(message_json(with.joined(), true)["reasoning"], "plan");
  EXPECT_GE(with.reasoning_tokens(), 2);
  ChatChoiceOutput without = run(false);
  EXPECT_EQ(without.joined().reasoning, "");
  EXPECT_EQ(without.joined().content, "Hello");
}

TEST(ServerResponses, UsageAndIds) {
  Usage u(10, 5);
  EXPECT_EQ(usage_json(u), parse(R"({"prompt_tokens": 10, "total_tokens": 15, "completion_tokens": 5})"));
  u.cached_tokens = 4;
  EXPECT_EQ(usage_json(u)["prompt_tokens_details"]["cached_tokens"], 4);
  std::string id = random_id("chatcmpl-");
  EXPECT_EQ(id.size(), 9u + 32u);
  EXPECT_NE(id, random_id("chatcmpl-"));
  EXPECT_EQ(sse_event(parse(R"({"a": 1})")), "data: {\"a\":1}\n\n");
  // Invalid UTF-8 never makes serialisation throw.
  EXPECT_NO_THROW(to_text(Json(std::string("\xff"))));
}

TEST(ServerMetrics, PrometheusText) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(5);
  std::string out;
  h.render(out, "x", "model_name=\"m\"");
  EXPECT_NE(out.find("x_bucket{model_name=\"m\",le=\"0.1\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{model_name=\"m\",le=\"1\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{model_name=\"m\",le=\"+Inf\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count{model_name=\"m\"} 3\n"), std::string::npos) << out;

  ServerMetrics metrics("my \"model\"", 100, CacheInfo{64, "fp8", "auto", true});
  metrics.observe_time_to_first_token(0.2);
  metrics.observe_finished(1.0, 0.2, 7, 5, "length");
  metrics.observe_phases(0.05, 0.15, 0.8, 0.95);
  metrics.observe_request(2, 16);
  metrics.observe_max_generation_tokens(5);
  EngineGauges gauges;
  gauges.iteration_steps_by_log2[0] = 3;  // 3 steps of 1 token, 2 of 5-8, 1 of 9-16
  gauges.iteration_steps_by_log2[3] = 2;
  gauges.iteration_steps_by_log2[4] = 1;
  gauges.iteration_tokens = 3 + 14 + 12;
  gauges.running = 2;
  gauges.kv_blocks_used = 3;
  gauges.kv_blocks_total = 12;
  gauges.prefix_hits = 64;
  gauges.decode = {12, 0.5, 0.25};
  std::string text = metrics.render(gauges);
  const std::string labels = "{model_name=\"my \\\"model\\\"\"}";
  for (const std::string& line : std::vector<std::string>{
           "vllm:num_requests_running" + labels + " 2", "vllm:kv_cache_usage_perc" + labels + " 0.25",
           "vllm:prefix_cache_hits_total" + labels + " 64", "# TYPE vllm:prefix_cache_hits counter",
           "# TYPE vllm:time_to_first_token_seconds histogram",
           "vllm:time_to_first_token_seconds_count" + labels + " 1",
           "vllm:request_success_total{model_name=\"my \\\"model\\\"\",finished_reason=\"length\"} 1",
           "vllm:request_time_per_output_token_seconds_sum" + labels + " 0.2",
           "sparrow:decode_steps_total" + labels + " 12", "sparrow:decode_step_seconds_total" + labels + " 0.5",
           "sparrow:decode_forward_seconds_total" + labels + " 0.25", "sparrow:prefill_steps_total" + labels + " 0",
           "vllm:request_queue_time_seconds_sum" + labels + " 0.05",
           "vllm:request_prefill_time_seconds_sum" + labels + " 0.15",
           "vllm:request_decode_time_seconds_sum" + labels + " 0.8",
           "vllm:request_inference_time_seconds_sum" + labels + " 0.95",
           "vllm:request_params_n_bucket{model_name=\"my \\\"model\\\"\",le=\"1\"} 0",
           "vllm:request_params_n_bucket{model_name=\"my \\\"model\\\"\",le=\"2\"} 1",
           "vllm:request_params_max_tokens_sum" + labels + " 16",
           "vllm:request_max_num_generation_tokens_sum" + labels + " 5",
           "# TYPE vllm:iteration_tokens_total histogram",
           "vllm:iteration_tokens_total_bucket{model_name=\"my \\\"model\\\"\",le=\"1\"} 3",
           "vllm:iteration_tokens_total_bucket{model_name=\"my \\\"model\\\"\",le=\"8\"} 5",
           "vllm:iteration_tokens_total_bucket{model_name=\"my \\\"model\\\"\",le=\"16\"} 6",
           "vllm:iteration_tokens_total_bucket{model_name=\"my \\\"model\\\"\",le=\"+Inf\"} 6",
           "vllm:iteration_tokens_total_sum" + labels + " 29",
           "vllm:cache_config_info{model_name=\"my \\\"model\\\"\",block_size=\"64\",cache_dtype=\"fp8\","
           "enable_prefix_caching=\"True\",indexer_kv_dtype=\"auto\",num_gpu_blocks=\"12\"} 1"})
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << line << "\n" << text;
}

TEST(ServerEventQueue, CrossesThreadsAndWakesTheConsumer) {
  EventQueue<int> queue;
  EXPECT_FALSE(queue.pop());
  queue.push(-1);  // before anyone listens: the wake-up comes when the listener is set
  std::mutex mutex;
  std::condition_variable woken;
  int wakes = 0;
  queue.set_wake([&] {
    std::lock_guard<std::mutex> lock(mutex);
    ++wakes;
    woken.notify_all();
  });
  EXPECT_EQ(wakes, 1);
  EXPECT_EQ(queue.pop(), -1);
  std::thread producer([&] {
    for (int i = 0; i < 100; ++i) queue.push(i);
  });
  for (int i = 0; i < 100; ++i) {
    std::optional<int> v;
    std::unique_lock<std::mutex> lock(mutex);
    ASSERT_TRUE(woken.wait_for(lock, std::chrono::seconds(5), [&] { return (v = queue.pop()).has_value(); }));
    EXPECT_EQ(*v, i);
  }
  producer.join();
  EXPECT_EQ(wakes, 101);  // one per push
  EXPECT_FALSE(queue.pop());
}

}  // namespace
}  // namespace sparrow::server
