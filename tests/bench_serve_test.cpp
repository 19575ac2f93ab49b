// `sparrow bench serve` (src/bench): the statistics against hand-computed values, the SSE and chunk
// parsing, the workloads' determinism and length distributions, and end to end against a real
// `sparrow serve` of the bundled model on a free port.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "bench/serve_bench.h"
#include "bench/serve_client.h"
#include "bench/serve_metrics.h"
#include "bench/workloads.h"
#include "core/base64.h"
#include "serve_process.h"
#include "test_util.h"
#include "vision/image.h"

namespace sparrow::bench {
namespace {

namespace fs = std::filesystem;
using sparrow::testing::error_message;
using sparrow::testing::mentions;

const fs::path kModel = fs::path(SPARROW_SOURCE_DIR) / "models" / "minimax_m3";

RequestResult finished(double start, double ttft, std::vector<double> itl, int64_t prompt, int64_t output) {
  RequestResult r;
  r.success = true;
  r.start_time = start;
  r.ttft = ttft;
  r.latency = ttft;
  for (double gap : itl) r.latency += gap;
  r.itl = std::move(itl);
  r.prompt_len = prompt;
  r.output_len = output;
  return r;
}

TEST(BenchServeStats, PercentilesInterpolateLikeNumpy) {
  EXPECT_EQ(percentile({}, 50), 0.0);
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3, 4}, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3, 4}, 0), 1.0);
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3, 4}, 100), 4.0);
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_NEAR(percentile(hundred, 99), 99.01, 1e-12);  // numpy.percentile(range(1, 101), 99)
  EXPECT_NEAR(percentile(hundred, 90), 90.1, 1e-12);

  Summary s = summarize({4, 1, 3, 2}, {90, 99});
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_DOUBLE_EQ(s.std, std::sqrt(1.25));  // population std, as numpy.std
  ASSERT_EQ(s.percentiles.size(), 2u);
  EXPECT_NEAR(s.percentiles[0].second, 3.7, 1e-12);
  EXPECT_NEAR(s.percentiles[1].second, 3.97, 1e-12);
}

TEST(BenchServeStats, TpotItlGoodputFromTimestamps) {
  // Request a: TTFT 100 ms, then gaps 20, 30, 50 ms: 4 tokens, E2EL 200 ms, TPOT 100 / 3 ms.
  // Request b: TTFT 300 ms, one gap of 10 ms, 2 tokens: TPOT 10 ms. Request c: one token (TPOT 0,
  // excluded from the TPOT statistics). Request d failed.
  std::vector<RequestResult> results = {finished(0.0, 0.1, {0.02, 0.03, 0.05}, 10, 4),
                                        finished(0.05, 0.3, {0.01}, 20, 2), finished(1.5, 0.05, {}, 5, 1)};
  RequestResult failed;
  failed.error = "HTTP 400: too long";
  failed.prompt_len = 7;
  results.push_back(failed);
  EXPECT_NEAR(tpot_seconds(results[0]), 0.1 / 3, 1e-12);
  EXPECT_EQ(tpot_seconds(results[2]), 0.0);

  RunInfo info;
  info.duration = 2.0;
  info.request_rate = std::numeric_limits<double>::infinity();
  info.slos = parse_slos({"ttft:150", "tpot:40"});  // a and c meet both; b misses TTFT
  info.metric_percentiles = {50};
  info.percentile_metrics = {"ttft", "itl"};
  Json j = result_json(info, results);
  EXPECT_EQ(j["completed"], 3);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["num_prompts"], 4);
  EXPECT_EQ(j["total_input_tokens"], 35);  // failed requests count nothing
  EXPECT_EQ(j["total_output_tokens"], 7);
  EXPECT_DOUBLE_EQ(j["request_throughput"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(j["request_goodput"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["output_throughput"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(j["total_token_throughput"].get<double>(), 21.0);
  EXPECT_NEAR(j["mean_ttft_ms"].get<double>(), 150.0, 1e-9);
  EXPECT_NEAR(j["median_ttft_ms"].get<double>(), 100.0, 1e-9);
  EXPECT_NEAR(j["mean_tpot_ms"].get<double>(), (100.0 / 3 + 10) / 2, 1e-9);
  EXPECT_NEAR(j["mean_itl_ms"].get<double>(), (20 + 30 + 50 + 10) / 4.0, 1e-9);  // gaps pooled
  EXPECT_NEAR(j["p50_itl_ms"].get<double>(), 25.0, 1e-9);
  EXPECT_NEAR(j["p90_itl_ms"].get<double>(), 44.0, 1e-9);
  EXPECT_NEAR(j["p99_e2el_ms"].get<double>(), 307.8, 1e-9);  // E2ELs 50, 200, 310
  EXPECT_EQ(j["max_concurrent_requests"], 2);  // a and b overlap; c starts after both ended
  EXPECT_EQ(j["max_output_tokens_per_s"].get<double>(), 6.0);  // a's 4 and b's 2 chunks in second 0
  EXPECT_EQ(j["output_lens"], Json::array({4, 2, 1, 0}));
  EXPECT_EQ(j["errors"][3], "HTTP 400: too long");
  EXPECT_TRUE(j["prefix_cache_hit_rate"].is_null());
  EXPECT_FALSE(j.contains("session_ids"));

  // Without SLOs there is no goodput, as vLLM writes it.
  info.slos = {};
  EXPECT_TRUE(result_json(info, results)["request_goodput"].is_null());
  std::string summary = summary_text(info, j);
  EXPECT_NE(summary.find("Successful requests:                     3"), std::string::npos) << summary;
  EXPECT_NE(summary.find("P99 TTFT (ms):"), std::string::npos) << summary;
}

TEST(BenchServeStats, GoodputSloParsing) {
  Slos slos = parse_slos({"ttft:500", "e2el:2000.5"});
  EXPECT_EQ(slos.ttft_ms, 500.0);
  EXPECT_EQ(slos.e2el_ms, 2000.5);
  EXPECT_FALSE(slos.tpot_ms);
  EXPECT_TRUE(mentions(error_message([] { parse_slos({"ttft=5"}); }), {"--goodput", "ttft=5"}));
  EXPECT_TRUE(mentions(error_message([] { parse_slos({"speed:5"}); }), {"--goodput", "speed"}));
  EXPECT_TRUE(mentions(error_message([] { parse_slos({"tpot:-1"}); }), {"--goodput", "tpot"}));
  EXPECT_TRUE(mentions(error_message([] { parse_slos({"tpot:"}); }), {"--goodput"}));
}

TEST(BenchServeStats, PrefixCacheCountersFromPrometheus) {
  const std::string sparrow_page =
      "# HELP vllm:prefix_cache_queries Prompt tokens looked up in the prefix cache.\n"
      "# TYPE vllm:prefix_cache_queries counter\n"
      "vllm:prefix_cache_queries_total{model_name=\"a}b\"} 4129\n"
      "vllm:prefix_cache_hits_total{model_name=\"a}b\"} 1792\n"
      "vllm:prefix_cache_hits_total{model_name=\"other\"} 8\n"
      "vllm:prompt_tokens_total{model_name=\"a}b\"} 99\n";
  auto c = parse_prefix_cache_counters(sparrow_page);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->queries, 4129);
  EXPECT_EQ(c->hits, 1800);
  auto legacy = parse_prefix_cache_counters("vllm:gpu_prefix_cache_queries_total 10\nvllm:gpu_prefix_cache_hits_total 5\n");
  ASSERT_TRUE(legacy);
  EXPECT_EQ(legacy->hits, 5);
  EXPECT_FALSE(parse_prefix_cache_counters("# nothing\nsglang:cache_hit_rate 0.5\n"));
}

TEST(BenchServeStats, EngineStepCountersFromPrometheus) {
  const std::string page =
      "sparrow:decode_steps_total{model_name=\"m\"} 100\n"
      "sparrow:decode_step_seconds_total{model_name=\"m\"} 2.5\n"
      "sparrow:decode_forward_seconds_total{model_name=\"m\"} 2\n"
      "sparrow:prefill_steps_total{model_name=\"m\"} 4\n"
      "sparrow:prefill_step_seconds_total{model_name=\"m\"} 1\n"
      "sparrow:prefill_forward_seconds_total{model_name=\"m\"} 0.9\n";
  auto after = parse_engine_step_counters(page);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->decode_steps, 100);
  EXPECT_EQ(after->prefill_forward_seconds, 0.9);
  EngineStepCounters before;
  before.decode_steps = 60, before.decode_seconds = 1.5, before.decode_forward_seconds = 1.25;
  const EngineStepCounters run = *after - before;
  EXPECT_EQ(run.decode_steps, 40);
  EXPECT_EQ(run.decode_seconds, 1.0);
  EXPECT_EQ(run.decode_forward_seconds, 0.75);
  EXPECT_FALSE(parse_engine_step_counters("vllm:prefix_cache_hits_total 3\n"));  // not a sparrow server
}

TEST(BenchServeStats, SpecDecodeCountersFromPrometheus) {
  const std::string page =
      "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 50\n"
      "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 200\n"
      "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 90\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"0\"} 40\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"1\"} 30\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"3\"} 5\n";
  auto after = parse_spec_decode_counters(page);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->drafts, 50);
  EXPECT_EQ(after->accepted_tokens, 90);
  EXPECT_EQ(after->accepted_by_position, (std::vector<double>{40, 30, 0, 5}));
  SpecDecodeCounters before{10, 40, 10, {8, 2}};
  const SpecDecodeCounters run = *after - before;
  EXPECT_EQ(run.drafts, 40);
  EXPECT_EQ(run.accepted_by_position, (std::vector<double>{32, 28, 0, 5}));
  RunInfo info;
  info.spec_decode = run;
  const Json j = result_json(info, {});
  EXPECT_DOUBLE_EQ(j["spec_decode_acceptance_length"].get<double>(), 1 + 80.0 / 40);
  EXPECT_DOUBLE_EQ(j["spec_decode_acceptance_rate"].get<double>(), 100 * 80.0 / 160);
  EXPECT_NE(summary_text(info, j).find("Acceptance length:"), std::string::npos);
  EXPECT_FALSE(parse_spec_decode_counters("vllm:prefix_cache_hits_total 3\n"));
}

TEST(BenchServeSse, EventsAcrossArbitraryReads) {
  const std::string stream =
      ": keep-alive comment\r\n"
      "data: {\"a\": 1}\r\n\r\n"
      "event: message\ndata: {\"b\":\ndata: 2}\n\n"
      "data: [DONE]\n\n";
  const std::vector<std::string> expected = {"{\"a\": 1}", "{\"b\":\n2}", "[DONE]"};
  SseParser whole;
  EXPECT_EQ(whole.feed(stream), expected);
  for (size_t piece : {1, 2, 3, 7}) {
    SseParser parser;
    std::vector<std::string> events;
    for (size_t i = 0; i < stream.size(); i += piece)
      for (std::string& e : parser.feed(std::string_view(stream).substr(i, piece))) events.push_back(e);
    EXPECT_EQ(events, expected) << "pieces of " << piece;
  }
  SseParser partial;
  EXPECT_TRUE(partial.feed("data: {\"unfinished\"").empty());
}

TEST(BenchServeSse, WhatChunksSay) {
  ChunkInfo role = read_chunk(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})", true);
  EXPECT_FALSE(role.output);  // sparrow's and vLLM's first chat chunk is not a token
  ChunkInfo content = read_chunk(R"({"choices":[{"delta":{"content":"Hi"}}]})", true);
  EXPECT_TRUE(content.output);
  EXPECT_EQ(content.text, "Hi");
  EXPECT_TRUE(read_chunk(R"({"choices":[{"delta":{"reasoning_content":"hm"}}]})", true).output);
  EXPECT_TRUE(read_chunk(R"({"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]})", true)
                  .output);
  EXPECT_TRUE(read_chunk(R"({"choices":[{"text":" world","index":0}]})", false).output);
  // A step whose token has no text yet is still a token (vLLM's client times it too) ...
  EXPECT_TRUE(read_chunk(R"({"choices":[{"text":"","index":0}]})", false).output);
  EXPECT_TRUE(read_chunk(R"({"choices":[{"delta":{"content":""}}]})", true).output);
  // ... but not a chat finish chunk without a delta, nor a usage chunk without choices.
  EXPECT_FALSE(read_chunk(R"({"choices":[{"delta":{},"finish_reason":"stop"}]})", true).output);
  EXPECT_FALSE(read_chunk(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}})", false).output);
  ChunkInfo usage = read_chunk(R"({"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5}})", false);
  EXPECT_FALSE(usage.output);
  EXPECT_EQ(usage.prompt_tokens, 12);
  EXPECT_EQ(usage.completion_tokens, 5);
  EXPECT_TRUE(read_chunk("[DONE]", false).done);
  EXPECT_EQ(read_chunk(R"({"error":{"message":"engine failed","code":500}})", false).error, "engine failed");
  EXPECT_FALSE(read_chunk("{not json", false).error.empty());
}

TEST(BenchServeSse, BaseUrls) {
  BaseUrl u = parse_base_url("http://127.0.0.1:8000");
  EXPECT_EQ(u.origin, "http://127.0.0.1:8000");
  EXPECT_EQ(u.prefix, "");
  u = parse_base_url("https://host/openai/");
  EXPECT_EQ(u.origin, "https://host");
  EXPECT_EQ(u.prefix, "/openai");
  EXPECT_TRUE(mentions(error_message([] { parse_base_url("127.0.0.1:8000"); }), {"--base-url", "http://"}));
}

TEST(BenchServeWorkload, RngDistributions) {
  Rng a(7), b(7), c(8);
  for (int i = 0; i < 10; ++i) {
    const double x = a.uniform();
    EXPECT_EQ(x, b.uniform());
    EXPECT_NE(x, c.uniform());
  }
  Rng rng(1);
  const int n = 200000;
  double sum = 0, squares = 0;
  std::vector<double> lognormals;
  for (int i = 0; i < n; ++i) {
    const double g = rng.gamma(2.0, 3.0);  // mean 6, variance 18
    sum += g;
    squares += g * g;
    lognormals.push_back(double(rng.lognormal(600, 1.4, 0, 1 << 30)));
  }
  EXPECT_NEAR(sum / n, 6.0, 0.05);
  EXPECT_NEAR(squares / n - (sum / n) * (sum / n), 18.0, 0.4);
  std::sort(lognormals.begin(), lognormals.end());
  EXPECT_NEAR(percentile(lognormals, 50), 600, 10);
  EXPECT_NEAR(percentile(lognormals, 99) / percentile(lognormals, 50), std::exp(1.4 * 2.3263), 1.0);
  for (int i = 0; i < 1000; ++i) {
    const int64_t k = rng.integer(3, 5);
    EXPECT_TRUE(k >= 3 && k <= 5);
  }
}

TEST(BenchServeWorkload, RandomIsDeterministicWithRangedLengths) {
  TextMaker words(nullptr);
  RandomOptions o;
  o.num_prompts = 400;
  o.input_len = 100;
  o.output_len = 20;
  o.range_ratio = 0.5;
  o.prefix_len = 10;
  o.seed = 3;
  std::vector<Job> a = random_workload(o, words), b = random_workload(o, words);
  o.seed = 4;
  std::vector<Job> c = random_workload(o, words);
  ASSERT_EQ(a.size(), 400u);
  int64_t in_min = 1 << 30, in_max = 0, out_min = 1 << 30, out_max = 0;
  std::string prefix;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].requests.size(), 1u);
    const WorkItem &x = a[i].requests[0], &y = b[i].requests[0];
    EXPECT_EQ(x.prompt, y.prompt);
    EXPECT_EQ(x.output_len, y.output_len);
    // Words mode: one word per token, each with its leading space.
    EXPECT_EQ(int64_t(std::count(x.prompt.begin(), x.prompt.end(), ' ')), x.prompt_len);
    const int64_t input = x.prompt_len - o.prefix_len;
    in_min = std::min(in_min, input);
    in_max = std::max(in_max, input);
    out_min = std::min(out_min, x.output_len);
    out_max = std::max(out_max, x.output_len);
    // The shared prefix is the same text in every prompt.
    size_t cut = 0;
    for (int w = 0; w < o.prefix_len; ++w) cut = x.prompt.find(' ', cut + 1);
    if (i == 0) prefix = x.prompt.substr(0, cut);
    EXPECT_EQ(x.prompt.substr(0, cut), prefix);
  }
  EXPECT_EQ(in_min, 50);  // uniform over [50, 150] and [10, 30]: 400 draws reach both ends
  EXPECT_EQ(in_max, 150);
  EXPECT_EQ(out_min, 10);
  EXPECT_EQ(out_max, 30);
  EXPECT_NE(a[0].requests[0].prompt, c[0].requests[0].prompt);

  o.range_ratio = 1.0;
  EXPECT_TRUE(mentions(error_message([&] { random_workload(o, words); }), {"--random-range-ratio"}));
}

TEST(BenchServeWorkload, TokenizerPromptsHaveExactLengths) {
  if (!fs::exists(kModel / "tokenizer.json")) GTEST_SKIP() << "no bundled model";
  std::shared_ptr<const Tokenizer> tokenizer = load_tokenizer(kModel.string());
  TextMaker text(tokenizer);
  Rng rng(11);
  for (int64_t n : {1, 2, 7, 64, 300, 1000}) {
    std::string t = text.make(rng, n);
    EXPECT_EQ(int64_t(tokenizer->encode(t).size()), n) << t;
  }
  RandomOptions o;
  o.num_prompts = 20;
  o.input_len = 50;
  o.prefix_len = 30;
  for (const Job& job : random_workload(o, text)) EXPECT_EQ(job.requests[0].prompt_len, 80);
}

TEST(BenchServeWorkload, AgenticSessionsGrowAndAreDeterministic) {
  TextMaker words(nullptr);
  AgenticOptions o;
  o.sessions = 40;
  o.max_turns = 30;
  o.max_context = 60000;
  o.seed = 5;
  std::vector<Job> a = agentic_workload(o, words), b = agentic_workload(o, words);
  ASSERT_EQ(a.size(), 40u);
  AgenticOptions one = o;
  one.sessions = 1;
  EXPECT_EQ(agentic_workload(one, words)[0].messages, a[0].messages);  // sessions do not depend on each other

  std::vector<double> tool_lengths;
  int64_t turns = 0, tool_results = 0, longest = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    const Job& job = a[s];
    EXPECT_EQ(job.messages, b[s].messages);
    EXPECT_EQ(job.messages[0], a[0].messages[0]);  // one system prompt for all sessions
    EXPECT_EQ(job.tools, a[0].tools);
    EXPECT_EQ(job.tools.size(), 8u);
    EXPECT_EQ(job.requests[0].think_time_s, 0.0);
    for (size_t k = 0; k < job.requests.size(); ++k) {
      const WorkItem& item = job.requests[k];
      EXPECT_GE(item.output_len, 50);
      EXPECT_LE(item.output_len, 500);
      EXPECT_LE(item.prompt_len + item.output_len, o.max_context);
      EXPECT_NE(job.messages[item.messages - 1]["role"], "assistant");  // each turn ends with new input
      if (k > 0) {
        EXPECT_GT(item.messages, job.requests[k - 1].messages);
        EXPECT_GT(item.prompt_len, job.requests[k - 1].prompt_len);
        EXPECT_GT(item.think_time_s, 0.0);
        EXPECT_LE(item.think_time_s, 300.0);
      }
      longest = std::max(longest, item.prompt_len);
      ++turns;
    }
    // Every tool message answers the call of the assistant message before it.
    for (size_t m = 1; m < job.messages.size(); ++m)
      if (job.messages[m]["role"] == "tool") {
        const Json& call = job.messages[m - 1];
        ASSERT_EQ(call["role"], "assistant");
        EXPECT_EQ(call["tool_calls"][0]["id"], job.messages[m]["tool_call_id"]);
        const std::string content = job.messages[m]["content"];
        tool_lengths.push_back(double(std::count(content.begin(), content.end(), ' ')));
        ++tool_results;
      }
  }
  EXPECT_GT(longest, 30000);  // contexts grow far: 30 turns of about 1.6K tokens each
  const double tool_share = double(tool_results) / double(turns);
  EXPECT_NEAR(tool_share, 0.85, 0.06);
  std::sort(tool_lengths.begin(), tool_lengths.end());
  EXPECT_NEAR(percentile(tool_lengths, 50), 600, 90);  // heavy tail: p99 far above the median
  EXPECT_GT(percentile(tool_lengths, 99), 6 * percentile(tool_lengths, 50));
  EXPECT_GE(tool_lengths.front(), 60);
  EXPECT_LE(tool_lengths.back(), 30000);

  // A cap the first turn cannot fit under is an error, not an empty run.
  o.max_context = 100;
  EXPECT_TRUE(mentions(error_message([&] { agentic_workload(o, words); }), {"--agentic-max-context"}));
}

TEST(BenchServeWorkload, ArrivalsPoissonAndGamma) {
  for (double t : arrival_times(5, std::numeric_limits<double>::infinity(), 1, 0)) EXPECT_EQ(t, 0.0);
  auto variation = [](const std::vector<double>& at) {
    std::vector<double> gaps = {at[0]};
    for (size_t i = 1; i < at.size(); ++i) gaps.push_back(at[i] - at[i - 1]);
    Summary s = summarize(gaps, {});
    return s.std / s.mean;
  };
  std::vector<double> poisson = arrival_times(20000, 10, 1, 1);
  EXPECT_NEAR(poisson.back(), 2000.0, 1e-9);  // scaled so the offered load is exactly the rate
  EXPECT_TRUE(std::is_sorted(poisson.begin(), poisson.end()));
  EXPECT_NEAR(variation(poisson), 1.0, 0.05);  // exponential gaps
  EXPECT_NEAR(variation(arrival_times(20000, 10, 4, 1)), 0.5, 0.05);  // gamma: 1 / sqrt(shape)
  EXPECT_EQ(arrival_times(50, 3, 1, 9), arrival_times(50, 3, 1, 9));
  EXPECT_TRUE(mentions(error_message([] { arrival_times(5, 1, 0, 0); }), {"--burstiness"}));
}

// random-mm (vLLM's RandomMultiModalDataset): vLLM's bucket syntax, counts in the ratio's range, each image a JPEG of
// its bucket's size in a data: URL, the same draws for the same seed; videos refused.
TEST(BenchServeWorkload, RandomMmImagesFollowTheBucketsAndTheSeed) {
  const std::vector<ImageBucket> buckets = parse_image_buckets("{(256, 256, 1): 0.5, (720,1280,1):0.5, (720, 1280, 16): 0.0}");
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[1].height, 720);
  EXPECT_EQ(buckets[1].width, 1280);
  EXPECT_EQ(buckets[2].frames, 16);
  EXPECT_EQ(buckets[2].probability, 0.0);
  using sparrow::testing::error_message;
  EXPECT_NE(error_message([] { parse_image_buckets("{(256, 256): 1}"); }).find("expected ','"), std::string::npos);
  EXPECT_NE(error_message([] { parse_image_buckets("[1, 2]"); }).find("expected '{'"), std::string::npos);
  EXPECT_EQ(parse_image_limit(R"({"image": 3, "video": 0})"), 3);
  EXPECT_NE(error_message([] { parse_image_limit(R"({"audio": 1})"); }).find("unknown modality"), std::string::npos);

  RandomOptions r;
  r.num_prompts = 6;
  r.input_len = 8;
  r.output_len = 4;
  r.seed = 5;
  RandomMmOptions mm;
  mm.base_items = 2;
  mm.items_range_ratio = 0.5;  // 1 to 3 images
  mm.buckets = {{28, 56, 1, 0.5}, {40, 30, 1, 0.5}};
  const std::vector<Job> jobs = random_mm_workload(r, mm, TextMaker(nullptr));
  std::set<std::pair<int64_t, int64_t>> sizes;
  for (const Job& job : jobs) {
    const std::vector<std::string>& images = job.requests[0].images;
    EXPECT_GE(images.size(), 1u);
    EXPECT_LE(images.size(), 3u);
    for (const std::string& url : images) {
      const std::string prefix = "data:image/jpeg;base64,";
      ASSERT_EQ(url.rfind(prefix, 0), 0u);
      const vision::Image image = vision::decode_image(base64_decode(url.substr(prefix.size())));
      sizes.insert({image.height, image.width});
    }
  }
  EXPECT_EQ(sizes, (std::set<std::pair<int64_t, int64_t>>{{28, 56}, {40, 30}}));
  const std::vector<Job> again = random_mm_workload(r, mm, TextMaker(nullptr));
  for (size_t i = 0; i < jobs.size(); ++i) EXPECT_EQ(again[i].requests[0].images, jobs[i].requests[0].images);
  // The text is the random workload's, draw for draw.
  EXPECT_EQ(random_workload(r, TextMaker(nullptr))[3].requests[0].prompt, jobs[3].requests[0].prompt);
  mm.image_limit = 1;  // the count's range is clamped to the limit: at least 1, at most 1
  for (const Job& job : random_mm_workload(r, mm, TextMaker(nullptr))) EXPECT_EQ(job.requests[0].images.size(), 1u);
  mm.buckets = {{720, 1280, 16, 1.0}};
  EXPECT_NE(error_message([&] { random_mm_workload(r, mm, TextMaker(nullptr)); }).find("is a video"), std::string::npos);
}

TEST(BenchServeWorkload, RequestBodies) {
  ServeBenchOptions o;
  o.ignore_eos = true;
  Job random;
  random.requests.push_back({"hello there", 0, 2, 16, 0});
  nlohmann::json completion = nlohmann::json::parse(request_body(random, random.requests[0], false, "m", o));
  EXPECT_EQ(completion["prompt"], "hello there");
  EXPECT_EQ(completion["max_tokens"], 16);
  EXPECT_EQ(completion["stream"], true);
  EXPECT_EQ(completion["stream_options"]["include_usage"], true);
  EXPECT_EQ(completion["ignore_eos"], true);
  EXPECT_EQ(completion["min_tokens"], 16);
  nlohmann::json chat = nlohmann::json::parse(request_body(random, random.requests[0], true, "m", o));
  EXPECT_EQ(chat["messages"], nlohmann::json::parse(R"([{"role": "user", "content": "hello there"}])"));
  EXPECT_EQ(chat["max_completion_tokens"], 16);
  Job with_images = random;
  with_images.requests[0].images = {"data:image/jpeg;base64,AAAA", "data:image/jpeg;base64,BBBB"};
  nlohmann::json mm = nlohmann::json::parse(request_body(with_images, with_images.requests[0], true, "m", o));
  EXPECT_EQ(mm["messages"], nlohmann::json::parse(R"([{"role": "user", "content": [
      {"type": "text", "text": "hello there"},
      {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
      {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}}]}])"));

  AgenticOptions a;
  a.sessions = 1;
  Job session = agentic_workload(a, TextMaker(nullptr))[0];
  ASSERT_GE(session.requests.size(), 2u);
  nlohmann::json turn = nlohmann::json::parse(request_body(session, session.requests[1], true, "m", o));
  EXPECT_EQ(turn["messages"].size(), session.requests[1].messages);
  EXPECT_EQ(turn["tool_choice"], "none");
  EXPECT_EQ(turn["tools"].size(), 8u);
}

// ---- end to end: `sparrow bench serve` against `sparrow serve` of the bundled model ----

std::string slurp(const fs::path& p) { return test::read_text_file(p.string()); }

// `sparrow serve` of the bundled model as a child process on a free port, for the end-to-end tests.
class ServerProcess : public test::ServeProcess {
 public:
  explicit ServerProcess(const fs::path& log)
      : ServeProcess({kModel, "--port", "0", "--disable-log-requests", "--kv-cache-memory", "64MiB",
                      "--shutdown-timeout", "5"},
                     log.string()) {}
};

class BenchServeEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kModel / "config.json")) return;
    dir_ = new testing::TempDir();
    server_ = new ServerProcess(dir_->file("server.log"));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete dir_;
    server_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!server_) GTEST_SKIP() << "no bundled model at " << kModel;
    ASSERT_NE(server_->port(), 0) << "sparrow serve did not start:\n" << slurp(dir_->file("server.log"));
  }

  // Runs `sparrow bench serve` with `args`; its exit status, and stdout + stderr in `output`.
  int bench(const std::string& args, std::string& output) {
    const std::string log = dir_->file("bench.log");
    const std::string cmd = std::string(SPARROW_BINARY) + " bench serve --base-url http://127.0.0.1:" +
                            std::to_string(server_->port()) + " " + args + " >" + log + " 2>&1";
    const int rc = std::system(cmd.c_str());
    output = slurp(log);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  nlohmann::json result(const std::string& name) { return nlohmann::json::parse(slurp(dir_->file(name))); }

  static testing::TempDir* dir_;
  static ServerProcess* server_;
};
testing::TempDir* BenchServeEndToEnd::dir_ = nullptr;
ServerProcess* BenchServeEndToEnd::server_ = nullptr;

TEST_F(BenchServeEndToEnd, RandomCompletions) {
  std::string out;
  ASSERT_EQ(bench("--num-prompts 6 --random-input-len 32 --random-output-len 8 --ignore-eos --max-concurrency 3 "
                  "--goodput e2el:60000 --save-result --result-dir " + dir_->path() + " --result-filename random.json",
                  out),
            0)
      << out;
  EXPECT_NE(out.find("Serving Benchmark Result"), std::string::npos) << out;
  nlohmann::json j = result("random.json");
  for (const char* key : {"completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                          "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                          "median_ttft_ms", "p99_ttft_ms", "p90_ttft_ms", "std_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                          "p90_e2el_ms", "prefix_cache_hit_rate", "input_lens", "output_lens", "ttfts", "itls",
                          "errors"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["completed"], 6) << j["errors"];
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["output_lens"], nlohmann::json::array({8, 8, 8, 8, 8, 8}));  // --ignore-eos: fixed lengths
  EXPECT_EQ(j["total_output_tokens"], 48);
  int64_t inputs = 0;
  for (const auto& n : j["input_lens"]) {
    EXPECT_GE(n.get<int64_t>(), 32);  // the server's count of 32 words
    inputs += n.get<int64_t>();
  }
  EXPECT_EQ(j["total_input_tokens"], inputs);
  for (const auto& t : j["ttfts"]) EXPECT_GT(t.get<double>(), 0);
  for (const auto& gaps : j["itls"]) EXPECT_EQ(gaps.size(), 7u);  // a chunk per token: 8 tokens, 7 gaps
  EXPECT_LE(j["max_concurrent_requests"].get<int>(), 3);
  EXPECT_EQ(j["request_goodput"].get<double>(), j["request_throughput"].get<double>());
  EXPECT_TRUE(j["prefix_cache_hit_rate"].is_number());  // sparrow's /metrics has the counters
  // ... and the engine loop's: 6 requests of 8 tokens need decode steps; a step's forward part is in it.
  const nlohmann::json& decode = j["engine_steps"]["decode"];
  EXPECT_GE(decode["steps"].get<double>(), 7);
  EXPECT_GT(decode["mean_step_ms"].get<double>(), 0);
  EXPECT_LE(decode["mean_forward_ms"].get<double>(), decode["mean_step_ms"].get<double>());
  EXPECT_GE(decode["host_fraction"].get<double>(), 0);
}

TEST_F(BenchServeEndToEnd, WarmupsAreSentButNotCounted) {
  std::string out;
  ASSERT_EQ(bench("--num-prompts 2 --random-input-len 16 --random-output-len 4 --ignore-eos --num-warmups 3 "
                  "--save-result --result-dir " + dir_->path() + " --result-filename warm.json",
                  out),
            0)
      << out;
  EXPECT_NE(out.find("Warm-up: 3 requests (0 failed)"), std::string::npos) << out;
  nlohmann::json j = result("warm.json");
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["total_output_tokens"], 8);  // the warm-ups' tokens are in no figure
  EXPECT_EQ(j["output_lens"].size(), 2u);
}

TEST_F(BenchServeEndToEnd, AgenticChatSessions) {
  std::string out;
  ASSERT_EQ(bench("--dataset-name agentic --tokenizer " + kModel.string() +
                      " --agentic-sessions 2 --agentic-turns 4 --agentic-max-context 450 --agentic-system-len 100 "
                      "--agentic-append-len 30 --agentic-output-len 8 --agentic-think-time-ms 5 --ignore-eos "
                      "--max-concurrency 2 --request-rate 50 --save-result --result-dir " + dir_->path() +
                      " --result-filename agentic.json",
                  out),
            0)
      << out;
  nlohmann::json j = result("agentic.json");
  EXPECT_EQ(j["backend"], "openai-chat");
  EXPECT_EQ(j["endpoint"], "/v1/chat/completions");
  EXPECT_GE(j["num_prompts"].get<int>(), 3);
  EXPECT_EQ(j["completed"], j["num_prompts"]) << j["errors"];
  EXPECT_EQ(j["failed"], 0);
  // Turns of one session in order, each sending more than the last.
  std::map<int64_t, std::pair<int64_t, int64_t>> last;  // session -> (turn, input length)
  for (size_t i = 0; i < j["session_ids"].size(); ++i) {
    const int64_t s = j["session_ids"][i], t = j["turn_ids"][i], len = j["input_lens"][i];
    if (last.count(s)) {
      EXPECT_EQ(t, last[s].first + 1);
      EXPECT_GT(len, last[s].second);
    } else {
      EXPECT_EQ(t, 0);
    }
    last[s] = {t, len};
  }
  EXPECT_EQ(last.size(), 2u);
  // Each turn resends the conversation, so the server's prefix cache must serve much of it.
  EXPECT_GT(j["prefix_cache_hit_rate"].get<double>(), 0.3);
}

TEST_F(BenchServeEndToEnd, FailuresAreCountedNotFatal) {
  std::string out;
  // Prompts longer than the model's 1024-token context: every request is refused with HTTP 400.
  ASSERT_EQ(bench("--num-prompts 3 --random-input-len 1500 --random-output-len 4 --save-result --result-dir " +
                      dir_->path() + " --result-filename failed.json",
                  out),
            0)
      << out;
  nlohmann::json j = result("failed.json");
  EXPECT_EQ(j["completed"], 0);
  EXPECT_EQ(j["failed"], 3);
  for (const auto& e : j["errors"]) EXPECT_NE(e.get<std::string>().find("HTTP 400"), std::string::npos) << e;
  EXPECT_NE(out.find("Error 0: HTTP 400"), std::string::npos) << out;

  // No server at all: one line, exit status 1.
  const std::string cmd = std::string(SPARROW_BINARY) + " bench serve --port 1 >/dev/null 2>" + dir_->file("err");
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 1);
  std::string err = slurp(dir_->file("err"));
  if (!err.empty() && err.back() == '\n') err.pop_back();
  EXPECT_TRUE(mentions(err, {"error: ", "/v1/models"}));
}

}  // namespace
}  // namespace sparrow::bench
