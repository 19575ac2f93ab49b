// JSON from outside (core/json_input.h): the values nlohmann's parser gives, nesting refused past
// kMaxJsonDepth while parsing, and objects of many keys in linear time.
#include "core/json_input.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

using namespace sparrow;
using nlohmann::json;
using nlohmann::ordered_json;

namespace {

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

template <typename Json>
typename JsonInput<Json>::Status status_of(const std::string& text) {
  return parse_json_input<Json>(text).status;
}

}  // namespace

TEST(JsonInput, GivesWhatNlohmannsParserGives) {
  const std::string text =
      R"({"b": [1, -2, 18446744073709551615, 2.5e-3, "\u00e9\n", true, null], "a": {"": {}}, "c": []})";
  EXPECT_EQ(parse_json_input<ordered_json>(text).value, ordered_json::parse(text));
  EXPECT_EQ(parse_json_input<json>(text).value, json::parse(text));
  EXPECT_EQ(parse_json_input<ordered_json>(text).value.begin().key(), "b");  // the order written
  EXPECT_EQ(parse_json_input<json>("3").value, json(3));
}

TEST(JsonInput, RepeatedKeysKeepTheirFirstPlaceAndLastValue) {
  ordered_json object = parse_json_input<ordered_json>(R"({"x": 1, "y": 2, "x": {"z": 3}})").value;
  EXPECT_EQ(object.dump(), R"({"x":{"z":3},"y":2})");  // as Python's json.loads
  EXPECT_EQ(parse_json_input<json>(R"({"x": 1, "x": 2})").value.dump(), R"({"x":2})");
  // The same past the size from which keys are found through an index.
  std::string text = "{";
  for (int i = 0; i < 40; ++i) text += "\"k" + std::to_string(i) + "\": " + std::to_string(i) + ", ";
  ordered_json large = parse_json_input<ordered_json>(text + "\"k3\": \"last\", \"k39\": 0}").value;
  EXPECT_EQ(large.size(), 40u);
  EXPECT_EQ(std::next(large.begin(), 3).key(), "k3");
  EXPECT_EQ(large["k3"], "last");
  EXPECT_EQ(large.back(), 0);
}

TEST(JsonInput, InvalidTextIsInvalid) {
  using Status = JsonInput<ordered_json>::Status;
  for (const char* text : {"", "{", "{not json", "[1,]", "[1] [2]", "{\"a\" 1}", "1e999", "\"\\x\""})
    EXPECT_EQ(status_of<ordered_json>(text), Status::Invalid) << text;
  EXPECT_TRUE(parse_json_input<ordered_json>("{").value.is_discarded());
}

TEST(JsonInput, NestingPastTheLimitIsRefused) {
  using Status = JsonInput<json>::Status;
  EXPECT_EQ(status_of<json>(nested(kMaxJsonDepth)), Status::Ok);
  EXPECT_EQ(status_of<json>(nested(kMaxJsonDepth + 1)), Status::TooDeep);
  EXPECT_EQ(status_of<ordered_json>("{\"a\": " + nested(kMaxJsonDepth) + "}"),
            JsonInput<ordered_json>::Status::TooDeep);
  EXPECT_EQ(status_of<json>(nested(30000)), Status::TooDeep);                     // the issue's reproduction
  EXPECT_EQ(status_of<json>(std::string(30000, '[')), Status::TooDeep);           // unclosed: refused all the same
  EXPECT_EQ(status_of<json>("[\"" + std::string(500, '[') + "\"]"), Status::Ok);  // brackets in a string
  EXPECT_EQ(status_of<json>("[" + nested(100) + ", " + nested(100) + "]"), Status::Ok);  // siblings do not add up
}

// nlohmann's ordered_json looks each key up from the start of its object: minutes for 200,000 keys.
TEST(JsonInput, LargeObjectsTakeLinearTime) {
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? ", \"k" : "\"k") + std::to_string(i) + "\": " + std::to_string(i);
  text += "}";
  auto start = std::chrono::steady_clock::now();
  JsonInput<ordered_json> parsed = parse_json_input<ordered_json>(text);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed.value.size(), 200000u);
  EXPECT_EQ(parsed.value.back(), 199999);
}
