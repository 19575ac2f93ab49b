// The messages between rank 0's server and the other data-parallel groups' engines (engine/remote_groups.h):
// a request with every sampling parameter set, an event with every field set (log-probabilities of -inf and
// a stop string or a stop token), and an engine's statistics all come back exactly as sent; a damaged message
// (cut short, padded, of an unknown kind) is a one-line error, never a crash. Serving with them end to end:
// tests/server/test_tensor_parallel.py.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "engine/remote_groups.h"
#include "model/lora.h"

using namespace sparrow;

namespace {

Request a_request() {
  Request r;
  r.id = "cmpl-42-0";
  r.prompt = {1, 2, 3, 4000};
  SamplingParams& p = r.params;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  p.top_k = 40;
  p.repetition_penalty = 1.1f;
  p.presence_penalty = -0.5f;
  p.frequency_penalty = 0.25f;
  p.seed = 123456789012345ull;
  p.max_tokens = 77;
  p.min_tokens = 3;
  p.ignore_eos = true;
  p.stop = {"\n\n", "END"};
  p.stop_token_ids = {7, 9};
  p.include_stop_str_in_output = true;
  p.logprobs = 5;
  p.prompt_logprobs = 2;
  p.n = 3;
  p.skip_special_tokens = false;
  p.structured.kind = structured::StructuredOutputSpec::Kind::JsonSchema;
  p.structured.text = R"({"type":"object"})";
  p.structured.choices = {"a", "b"};
  p.structured.any_whitespace = false;
  p.structured.special_tokens = {"<|tool_call_begin|>"};
  p.structured.start_after = {100, 101};
  p.logit_bias = {{5, -100.0f}, {6, 2.5f}};
  p.allowed_token_ids = std::vector<int32_t>{1, 5, 6};
  return r;
}

RequestOutput an_event() {
  RequestOutput e;
  e.request_id = "cmpl-42-0";
  e.index = 2;
  e.new_tokens = {11, 12};
  e.new_text = "h\xc3\xa9llo";
  TokenLogprob lp;
  lp.token = 11;
  lp.logprob = -std::numeric_limits<float>::infinity();
  lp.rank = 17;
  lp.top = {{3, -0.1f}, {4, -2.0f}};
  e.logprobs = {lp, lp};
  e.prompt_logprobs = {std::nullopt, lp};
  e.finished = true;
  e.finish_reason = "stop";
  e.stop_reason = std::string("END");
  e.prompt_tokens = 4;
  e.completion_tokens = 9;
  e.cached_tokens = 2;
  e.first_scheduled = std::chrono::steady_clock::now() - std::chrono::milliseconds(250);
  return e;
}

}  // namespace

TEST(RemoteGroups, RequestsSurviveTheLink) {
  const Request want = a_request();
  const Request got = decode_request(encode_request(want));
  EXPECT_EQ(got.id, want.id);
  EXPECT_EQ(got.prompt, want.prompt);
  const SamplingParams &p = got.params, &q = want.params;
  EXPECT_EQ(p.temperature, q.temperature);
  EXPECT_EQ(p.top_p, q.top_p);
  EXPECT_EQ(p.min_p, q.min_p);
  EXPECT_EQ(p.top_k, q.top_k);
  EXPECT_EQ(p.repetition_penalty, q.repetition_penalty);
  EXPECT_EQ(p.presence_penalty, q.presence_penalty);
  EXPECT_EQ(p.frequency_penalty, q.frequency_penalty);
  EXPECT_EQ(p.seed, q.seed);
  EXPECT_EQ(p.max_tokens, q.max_tokens);
  EXPECT_EQ(p.min_tokens, q.min_tokens);
  EXPECT_EQ(p.ignore_eos, q.ignore_eos);
  EXPECT_EQ(p.stop, q.stop);
  EXPECT_EQ(p.stop_token_ids, q.stop_token_ids);
  EXPECT_EQ(p.include_stop_str_in_output, q.include_stop_str_in_output);
  EXPECT_EQ(p.logprobs, q.logprobs);
  EXPECT_EQ(p.prompt_logprobs, q.prompt_logprobs);
  EXPECT_EQ(p.n, q.n);
  EXPECT_EQ(p.skip_special_tokens, q.skip_special_tokens);
  EXPECT_EQ(p.structured.kind, q.structured.kind);
  EXPECT_EQ(p.structured.text, q.structured.text);
  EXPECT_EQ(p.structured.choices, q.structured.choices);
  EXPECT_EQ(p.structured.any_whitespace, q.structured.any_whitespace);
  EXPECT_EQ(p.structured.special_tokens, q.structured.special_tokens);
  EXPECT_EQ(p.structured.start_after, q.structured.start_after);
  EXPECT_EQ(p.logit_bias, q.logit_bias);
  EXPECT_EQ(p.allowed_token_ids, q.allowed_token_ids);

  Request plain;  // the defaults: no seed, no allowed ids
  plain.id = "x";
  plain.prompt = {1};
  StepPlan::LoraSource none{"stale", "x", "y", 1};
  const Request back = decode_request(encode_request(plain), &none);
  EXPECT_FALSE(back.params.seed.has_value());
  EXPECT_FALSE(back.params.allowed_token_ids.has_value());
  EXPECT_TRUE(none.name.empty()) << "no adapter: an empty source";
  EXPECT_EQ(back.lora, nullptr);
}

// A request's LoRA adapter crosses as its source, from which the group's leader loads its own copy.
TEST(RemoteGroups, ARequestsAdapterTravelsAsItsSource) {
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->name = "sql";
  adapter->path = "/adapters/sql";
  adapter->base_model = "/models/base";
  adapter->max_rank = 64;
  Request request = a_request();
  request.lora = adapter;
  StepPlan::LoraSource source;
  const Request back = decode_request(encode_request(request), &source);
  EXPECT_EQ(source.name, "sql");
  EXPECT_EQ(source.path, "/adapters/sql");
  EXPECT_EQ(source.base_model, "/models/base");
  EXPECT_EQ(source.max_rank, 64);
  EXPECT_EQ(back.lora, nullptr) << "the leader attaches its own copy";
  EXPECT_EQ(back.prompt, request.prompt);
  // A source without a name is a damaged message.
  adapter->name.clear();
  EXPECT_THROW(decode_request(encode_request(request)), Error);
}

TEST(RemoteGroups, EventsAndStatisticsSurviveTheLink) {
  const RequestOutput want = an_event();
  const RequestOutput got = decode_output(encode_output(want));
  EXPECT_EQ(got.request_id, want.request_id);
  EXPECT_EQ(got.index, want.index);
  EXPECT_EQ(got.new_tokens, want.new_tokens);
  EXPECT_EQ(got.new_text, want.new_text);
  ASSERT_EQ(got.logprobs.size(), 2u);
  EXPECT_TRUE(std::isinf(got.logprobs[1].logprob) && got.logprobs[1].logprob < 0);
  EXPECT_EQ(got.logprobs[1].rank, 17);
  EXPECT_EQ(got.logprobs[1].top, want.logprobs[1].top);
  ASSERT_EQ(got.prompt_logprobs.size(), 2u);
  EXPECT_FALSE(got.prompt_logprobs[0].has_value());
  EXPECT_EQ(got.prompt_logprobs[1]->token, 11);
  EXPECT_TRUE(got.finished);
  EXPECT_EQ(got.finish_reason, "stop");
  EXPECT_EQ(got.stop_reason, want.stop_reason);
  EXPECT_EQ(got.prompt_tokens, 4);
  EXPECT_EQ(got.completion_tokens, 9);
  EXPECT_EQ(got.cached_tokens, 2);
  ASSERT_TRUE(got.first_scheduled.has_value());
  // The time travels as an age: within the time the test took of the original.
  const auto skew = *got.first_scheduled - *want.first_scheduled;
  EXPECT_LT(std::chrono::abs(skew), std::chrono::seconds(5));

  RequestOutput token_stop;
  token_stop.request_id = "r";
  token_stop.stop_reason = int32_t(7);
  EXPECT_EQ(decode_output(encode_output(token_stop)).stop_reason, token_stop.stop_reason);
  EXPECT_FALSE(decode_output(encode_output(RequestOutput{})).stop_reason.has_value());

  EngineStats stats;
  stats.running = 3;
  stats.waiting = 4;
  stats.kv_blocks_used = 5;
  stats.kv_blocks_total = 6;
  stats.prefix_queries = 7;
  stats.prefix_hits = 8;
  stats.preemptions = 9;
  stats.prompt_tokens_total = 10;
  stats.generation_tokens_total = 11;
  stats.decode_steps = {12, 1.5, 0.5};
  stats.prefill_steps = {13, 2.5, 1.25};
  stats.iteration_tokens.steps_by_log2[4] = 14;
  stats.iteration_tokens.tokens = 15;
  stats.mm_cache_queries = 16;
  stats.mm_cache_hits = 17;
  stats.encoder_seconds = 0.25;
  EngineStats sum = decode_stats(encode_stats(stats));
  add_stats(sum, stats);
  EXPECT_EQ(sum.running, 6);
  EXPECT_EQ(sum.kv_blocks_total, 12);
  EXPECT_EQ(sum.generation_tokens_total, 22);
  EXPECT_EQ(sum.prefill_steps.steps, 26);
  EXPECT_DOUBLE_EQ(sum.prefill_steps.forward_seconds, 2.5);
  EXPECT_EQ(sum.iteration_tokens.steps_by_log2[4], 28);
  EXPECT_EQ(sum.iteration_tokens.tokens, 30);
  EXPECT_EQ(sum.mm_cache_queries, 32);
  EXPECT_EQ(sum.mm_cache_hits, 34);
  EXPECT_DOUBLE_EQ(sum.encoder_seconds, 0.5);
}

TEST(RemoteGroups, DamagedMessagesAreRefused) {
  for (const std::vector<uint8_t>& bytes : {encode_request(a_request()), encode_output(an_event())}) {
    const bool request = bytes == encode_request(a_request());
    for (size_t n = 0; n < bytes.size(); ++n) {
      const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
      EXPECT_THROW(request ? (void)decode_request(cut) : (void)decode_output(cut), Error) << n;
    }
    std::vector<uint8_t> padded = bytes;
    padded.push_back(0);
    EXPECT_THROW(request ? (void)decode_request(padded) : (void)decode_output(padded), Error);
  }
  // A count larger than the message could hold is refused before anything is allocated.
  std::vector<uint8_t> huge = encode_request(a_request());
  for (int i = 0; i < 8; ++i) huge[size_t(i)] = 0xff;  // the id's length
  EXPECT_THROW(decode_request(huge), Error);
  std::vector<uint8_t> stats = encode_stats(EngineStats{});
  stats.pop_back();
  EXPECT_THROW(decode_stats(stats), Error);
}
