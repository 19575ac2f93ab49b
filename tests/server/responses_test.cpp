// /v1/responses without a model: the request turned into a chat request (responses_request.h), and the
// output items and stream events built from parser deltas (responses_output.h).
#include <gtest/gtest.h>

#include "server/api_error.h"
#include "server/responses_output.h"
#include "server/responses_request.h"

namespace sparrow::server {
namespace {

ResponsesRequest parse(const std::string& text) {
  return parse_responses_request(Json::parse(text), SamplingParams{}, kMaxLogprobs);
}

// The status and `param` of the ApiError parsing `text` throws.
std::pair<int, std::string> rejection(const std::string& text) {
  try {
    parse(text);
  } catch (const ApiError& e) {
    return {e.status(), e.param()};
  }
  return {0, "(accepted)"};
}

TEST(ResponsesRequest, StringInputAndInstructionsBecomeChatMessages) {
  ResponsesRequest r = parse(R"({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
                                 "temperature": 0.5, "metadata": {"a": "b"}, "user": "u"})");
  EXPECT_EQ(r.chat.model, "m");
  EXPECT_EQ(r.chat.max_tokens, 7);
  EXPECT_EQ(r.chat.sampling.temperature, 0.5f);
  EXPECT_EQ(r.chat.template_input["messages"],
            Json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])"));
  EXPECT_TRUE(r.chat.template_input["add_generation_prompt"].get<bool>());
  EXPECT_EQ(r.chat.tool_choice.mode, ToolChoice::Mode::None);
  EXPECT_EQ(r.tool_choice, "none");
  EXPECT_EQ(r.instructions, "Be brief.");
  EXPECT_EQ(r.metadata, Json::parse(R"({"a": "b"})"));
  EXPECT_EQ(r.text, Json::parse(R"({"format": {"type": "text"}})"));
  EXPECT_FALSE(r.chat.stream);
}

TEST(ResponsesRequest, ItemsMergeIntoAssistantTurnsAsVllmDoes) {
  ResponsesRequest r = parse(R"({"input": [
      {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
      {"type": "message", "role": "user", "content": "q"},
      {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
      {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "done"}]},
      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "so", "annotations": []}],
       "status": "in_progress"}]})");
  const Json& messages = r.chat.template_input["messages"];
  ASSERT_EQ(messages.size(), 5u) << messages.dump();
  EXPECT_EQ(messages[0], Json::parse(R"({"role": "system", "content": "a\nb"})"));  // developer -> system
  EXPECT_EQ(messages[2]["role"], "assistant");
  EXPECT_EQ(messages[2]["reasoning_content"], "think");
  EXPECT_TRUE(messages[2]["content"].is_null());
  ASSERT_EQ(messages[2]["tool_calls"].size(), 2u);  // both calls in the reasoning's turn
  EXPECT_EQ(messages[2]["tool_calls"][1],
            Json::parse(R"({"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}})"));
  EXPECT_EQ(messages[3], Json::parse(R"({"role": "tool", "content": "done", "tool_call_id": "c2", "name": "g"})"));
  EXPECT_EQ(messages[4], Json::parse(R"({"role": "assistant", "content": "so"})"));
  // A last assistant message still in progress is continued.
  EXPECT_TRUE(r.chat.template_input["continue_final_message"].get<bool>());
  EXPECT_FALSE(r.chat.template_input["add_generation_prompt"].get<bool>());
}

TEST(ResponsesRequest, FlatToolsAndToolChoice) {
  ResponsesRequest r = parse(R"({"input": "x", "tools": [{"type": "function", "name": "f", "description": "d",
      "parameters": {"type": "object"}, "strict": true}], "tool_choice": {"type": "function", "name": "f"},
      "parallel_tool_calls": false})");
  EXPECT_EQ(r.chat.tools, Json::parse(R"([{"type": "function", "function": {"name": "f", "description": "d",
      "parameters": {"type": "object"}, "strict": true}}])"));
  EXPECT_EQ(r.chat.template_input["tools"], r.chat.tools);
  EXPECT_EQ(r.chat.tool_choice.mode, ToolChoice::Mode::Named);
  EXPECT_EQ(r.chat.tool_choice.function_name, "f");
  EXPECT_FALSE(r.chat.parallel_tool_calls);
  EXPECT_EQ(r.tool_choice, Json::parse(R"({"type": "function", "name": "f"})"));  // echoed as given
  EXPECT_EQ(r.tools[0]["name"], "f");                                             // flat, as given

  EXPECT_EQ(parse(R"({"input": "x", "tools": [{"type": "function", "name": "f"}]})").chat.tool_choice.mode,
            ToolChoice::Mode::Auto);  // the default with tools
  ResponsesRequest no_tools = parse(R"({"input": "x", "tools": [], "tool_choice": "auto"})");
  EXPECT_EQ(no_tools.chat.tool_choice.mode, ToolChoice::Mode::None);
  EXPECT_EQ(no_tools.tool_choice, "none");
}

TEST(ResponsesRequest, TextFormatIsTheStructuredOutput) {
  using Kind = structured::StructuredOutputSpec::Kind;
  ResponsesRequest schema = parse(R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
      "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": true}}})");
  EXPECT_EQ(schema.chat.sampling.structured.kind, Kind::JsonSchema);
  EXPECT_EQ(Json::parse(schema.chat.sampling.structured.text)["properties"]["a"]["type"], "integer");
  EXPECT_EQ(schema.text["format"]["name"], "p");
  EXPECT_EQ(parse(R"({"input": "x", "text": {"format": {"type": "json_object"}}})").chat.sampling.structured.kind,
            Kind::JsonObject);
  EXPECT_FALSE(parse(R"({"input": "x", "text": {"format": {"type": "text"}}})").chat.sampling.structured.active());
  EXPECT_EQ(parse(R"({"input": "x", "text": {"verbosity": "low"}})").text["format"]["type"], "text");
}

TEST(ResponsesRequest, ReasoningEffortReachesTheTemplateAsVllmHandsIt) {
  ResponsesRequest off = parse(R"({"input": "x", "reasoning": {"effort": "none", "summary": "auto"}})");
  EXPECT_EQ(off.chat.template_input["chat_template_kwargs"],
            Json::parse(R"({"reasoning_effort": "none", "enable_thinking": false})"));
  ResponsesRequest kept = parse(R"({"input": "x", "reasoning": {"effort": "high"},
                                    "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(kept.chat.template_input["chat_template_kwargs"]["enable_thinking"], false);  // the client's wins
  EXPECT_EQ(kept.reasoning["effort"], "high");
}

TEST(ResponsesRequest, LogprobsOnlyWhenIncluded) {
  ResponsesRequest r = parse(R"({"input": "x", "top_logprobs": 3, "include": ["message.output_text.logprobs"]})");
  EXPECT_TRUE(r.output_logprobs);
  EXPECT_EQ(r.chat.sampling.logprobs, 3);
  ResponsesRequest plain = parse(R"({"input": "x", "top_logprobs": 3, "include": ["reasoning.encrypted_content"]})");
  EXPECT_FALSE(plain.output_logprobs);
  EXPECT_LT(plain.chat.sampling.logprobs, 0);
}

// input_image parts (issue 30): a user or system message with one keeps its parts, each image the template's
// {"type": "image"}, its URL in the chat request's images in order; text-only messages stay strings.
TEST(ResponsesRequest, InputImagesBecomeTemplateImagesAndTheRequestsImages) {
  ResponsesRequest r = parse(R"({"input": [
      {"role": "system", "content": "Look closely."},
      {"role": "user", "content": [{"type": "input_text", "text": "Compare "},
                                   {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"},
                                   {"type": "input_text", "text": " and "},
                                   {"type": "input_image", "image_url": "file:///media/b.jpg"}]}]})");
  EXPECT_EQ(r.chat.template_input["messages"], Json::parse(R"([
      {"role": "system", "content": "Look closely."},
      {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                   {"type": "text", "text": " and "}, {"type": "image"}]}])"));
  ASSERT_EQ(r.chat.images.size(), 2u);
  EXPECT_EQ(r.chat.images[0].url, "data:image/png;base64,AAAA");
  EXPECT_EQ(r.chat.images[0].param, "input[1].content[1].image_url");
  EXPECT_EQ(r.chat.images[1].url, "file:///media/b.jpg");
  EXPECT_EQ(r.chat.images[1].param, "input[1].content[3].image_url");
  EXPECT_TRUE(parse(R"({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]})").chat.images.empty());

  using R = std::pair<int, std::string>;
  auto with_part = [](const std::string& part, const std::string& role = "user") {
    return R"({"input": [{"role": ")" + role + R"(", "content": [{"type": "input_text", "text": "a"}, )" + part + "]}]}";
  };
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "file_id": "file-1"})")), R(400, "input[0].content[1].file_id"));
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image"})")), R(400, "input[0].content[1].image_url"));
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "image_url": {"url": "data:,"}})")),
            R(400, "input[0].content[1].image_url"));
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "image_url": "data:,", "detail": "max"})")),
            R(400, "input[0].content[1].detail"));
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "image_url": "data:,"}, {"type": "input_audio"})")),
            R(400, "input[0].content[2].type"));
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "image_url": "data:,"}, {"type": "picture"})")),
            R(400, "input[0].content[2].type"));
  // An assistant's message or a tool's output carries no images.
  EXPECT_EQ(rejection(with_part(R"({"type": "input_image", "image_url": "data:,"})", "assistant")),
            R(400, "input[0].content[1].type"));
  EXPECT_EQ(rejection(R"({"input": [{"type": "function_call_output", "call_id": "c",
                                     "output": [{"type": "input_image", "image_url": "data:,"}]}]})"),
            R(400, "input[0].output[0].type"));
}

TEST(ResponsesRequest, RefusalsNameTheField) {
  using R = std::pair<int, std::string>;
  EXPECT_EQ(rejection(R"({})"), R(400, "input"));
  EXPECT_EQ(rejection(R"({"input": 3})"), R(400, "input"));
  EXPECT_EQ(rejection(R"({"input": "x", "max_tokens": 3})"), R(400, "max_tokens"));  // unknown here
  EXPECT_EQ(rejection(R"({"input": "x", "previous_response_id": "resp_1"})"), R(400, "previous_response_id"));
  EXPECT_EQ(rejection(R"({"input": "x", "background": true})"), R(400, "background"));
  EXPECT_EQ(rejection(R"({"input": "x", "truncation": "auto"})"), R(400, "truncation"));
  EXPECT_EQ(rejection(R"({"input": "x", "max_tool_calls": 2})"), R(400, "max_tool_calls"));
  EXPECT_EQ(rejection(R"({"input": [{"type": "computer_call"}]})"), R(400, "input[0].type"));
  EXPECT_EQ(rejection(R"({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})"),
            R(400, "input[0].call_id"));
  EXPECT_EQ(rejection(R"({"input": [{"type": "reasoning", "encrypted_content": "zzz"}]})"),
            R(400, "input[0].encrypted_content"));
  EXPECT_EQ(rejection(R"({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})"),
            R(400, "input[0].content[0].type"));
  EXPECT_EQ(rejection(R"({"input": "x", "tools": [{"type": "file_search"}]})"), R(400, "tools[0].type"));
  EXPECT_EQ(rejection(R"({"input": "x", "tools": [{"type": "function"}]})"), R(400, "tools[0].name"));
  EXPECT_EQ(rejection(R"({"input": "x", "tool_choice": "required"})"), R(400, "tool_choice"));
  EXPECT_EQ(rejection(R"({"input": "x", "tools": [{"type": "function", "name": "f"}],
                         "tool_choice": {"type": "function", "name": "g"}})"),
            R(400, "tool_choice.name"));
  EXPECT_EQ(rejection(R"({"input": "x", "tool_choice": {"type": "web_search_preview"}})"), R(400, "tool_choice.type"));
  EXPECT_EQ(rejection(R"({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}})"),
            R(400, "text.format.name"));
  EXPECT_EQ(rejection(R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                         "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}})"),
            R(400, "text.format.schema"));
  EXPECT_EQ(rejection(R"({"input": "x", "text": {"format": {"type": "json_object"}},
                         "structured_outputs": {"json_object": true}})"),
            R(400, "structured_outputs"));
  EXPECT_EQ(rejection(R"({"input": "x", "include": ["everything"]})"), R(400, "include"));
  EXPECT_EQ(rejection(R"({"input": "x", "stream_options": {}})"), R(400, "stream_options"));
  EXPECT_EQ(rejection(R"({"input": "x", "top_p": 0})"), R(400, "top_p"));
}

parsers::OutputDelta delta(std::string reasoning, std::string content, std::vector<parsers::ToolCallDelta> calls = {}) {
  return {std::move(reasoning), std::move(content), std::move(calls)};
}

std::vector<std::string> types(const std::vector<Json>& events) {
  std::vector<std::string> out;
  for (const Json& e : events) out.push_back(e["type"]);
  return out;
}

TEST(ResponsesOutput, ReasoningThenTextThenCallsAsItems) {
  ResponseOutput output;
  std::vector<Json> events;
  auto add = [&](std::vector<Json> more) { events.insert(events.end(), more.begin(), more.end()); };
  add(output.add(delta("Let me", "")));
  add(output.add(delta(" think.", "")));
  add(output.add(delta("", "Checking.")));
  add(output.add(delta("", "", {{0, "call_a", "f", "{\"x\":"}})));
  add(output.add(delta("", "", {{0, "", "", " 1}"}, {1, "call_b", "g", "{}"}})));
  add(output.finish(false));
  EXPECT_EQ(types(events), (std::vector<std::string>{"response.output_item.added",
                                                     "response.content_part.added",
                                                     "response.reasoning_text.delta",
                                                     "response.reasoning_text.delta",
                                                     "response.reasoning_text.done",
                                                     "response.content_part.done",
                                                     "response.output_item.done",
                                                     "response.output_item.added",
                                                     "response.content_part.added",
                                                     "response.output_text.delta",
                                                     "response.output_text.done",
                                                     "response.content_part.done",
                                                     "response.output_item.done",
                                                     "response.output_item.added",
                                                     "response.function_call_arguments.delta",
                                                     "response.function_call_arguments.delta",
                                                     "response.function_call_arguments.done",
                                                     "response.output_item.done",
                                                     "response.output_item.added",
                                                     "response.function_call_arguments.delta",
                                                     "response.function_call_arguments.done",
                                                     "response.output_item.done"}));

  const Json& items = output.items();
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(items[0]["type"], "reasoning");
  EXPECT_EQ(items[0]["content"], Json::parse(R"([{"type": "reasoning_text", "text": "Let me think."}])"));
  EXPECT_EQ(items[0]["summary"], Json::array());
  EXPECT_EQ(items[1]["content"][0]["text"], "Checking.");
  EXPECT_EQ(items[1]["role"], "assistant");
  EXPECT_EQ(items[2]["arguments"], "{\"x\": 1}");
  EXPECT_EQ(items[2]["call_id"], "call_a");
  EXPECT_EQ(items[3]["name"], "g");
  for (const Json& item : items) EXPECT_EQ(item["status"], "completed");
  // Each item's events name it by its id and output index; the done event carries the final item.
  for (const Json& e : events) {
    size_t index = e["output_index"];
    if (e.contains("item_id")) EXPECT_EQ(e["item_id"], items[index]["id"]);
    if (e["type"] == "response.output_item.done") EXPECT_EQ(e["item"], items[index]);
  }
  EXPECT_TRUE(items[0]["id"].get<std::string>().starts_with("rs_"));
  EXPECT_TRUE(items[1]["id"].get<std::string>().starts_with("msg_"));
  EXPECT_TRUE(items[2]["id"].get<std::string>().starts_with("fc_"));
}

TEST(ResponsesOutput, CutShortMarksTheLastItemIncompleteAndLogprobsFollowTheText) {
  ResponseOutput output(true);
  Json one = Json::parse(R"([{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}])");
  Json two = Json::parse(R"([{"token": "b", "logprob": -2.0, "bytes": [98], "top_logprobs": []}])");
  output.add(delta("r", ""), one);  // reasoning: its token has no place among the text's logprobs
  output.add(delta("", ""), two);   // held back by the parsers: waits for the text that shows it
  std::vector<Json> events = output.add(delta("", "b"));
  EXPECT_EQ(events.back()["logprobs"], two);
  std::vector<Json> last = output.finish(true);
  EXPECT_EQ(output.items()[0]["status"], "completed");
  EXPECT_EQ(output.items()[1]["status"], "incomplete");
  EXPECT_EQ(output.items()[1]["content"][0]["logprobs"], two);
  EXPECT_EQ(last.back()["item"]["status"], "incomplete");
  EXPECT_TRUE(ResponseOutput().finish(false).empty());  // nothing open, nothing to close
}

}  // namespace
}  // namespace sparrow::server
