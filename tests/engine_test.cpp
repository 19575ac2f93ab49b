// The serving engine (src/engine) on the fixture models:
//   - a concurrent mix of requests (different lengths, shared prefixes, late arrivals, some aborted
//     midway) with a cache small enough to force preemption and a token budget small enough to force
//     chunked prefill gives every request exactly the greedy tokens it gets alone, and frees every block;
//   - seeded sampling gives the same tokens alone and batched, and choice i of n uses seed + i;
//   - logprobs and prompt logprobs are the log_softmax of the model's own logits;
//   - stop token ids, end-of-sequence ids, min_tokens and stop strings across token boundaries;
//   - abort at any point, validation errors, and the threaded Engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/planner.h"
#include "engine/engine.h"
#include "engine/engine_core.h"
#include "model/model.h"
#include "runner/data_parallel.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using sparrow::testing::cache_with_blocks;

using Tokens = std::vector<int32_t>;

fs::path fixture(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name; }

std::vector<Tokens> fixture_prompts(const std::string& name) {
  std::ifstream in(fixture(name) / "prompts.json");
  return nlohmann::json::parse(in)["prompts"].get<std::vector<Tokens>>();
}


// Plenty of room: every request of a test fits at once, prefills in one step.
EngineConfig roomy_config(const Model& model) {
  EngineConfig config;
  config.max_model_len = 160;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 4096;
  config.cache = cache_with_blocks(model, 16, 8 * 10, config.max_num_seqs);
  return config;
}

// Everything one choice received, its events joined.
struct Choice {
  Tokens tokens;
  std::string text;
  std::vector<TokenLogprob> logprobs;
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  int64_t events = 0;
  bool finished = false;
  std::string finish_reason;
  std::optional<std::variant<std::string, int32_t>> stop_reason;
  int64_t completion_tokens = 0, cached_tokens = 0;
  std::vector<std::string> texts_so_far;  // the joined text after each event
};

// Collects the events of many requests; choices are keyed "id/index".
struct Recorder {
  std::map<std::string, Choice> choices;
  std::string errors;  // protocol violations seen in the events

  EngineCore::OutputCallback callback() {
    return [this](const RequestOutput& event) { record(event); };
  }
  void record(const RequestOutput& event) {
    Choice& c = choices[event.request_id + "/" + std::to_string(event.index)];
    if (c.finished) errors += "event after the last for " + event.request_id + "\n";
    c.tokens.insert(c.tokens.end(), event.new_tokens.begin(), event.new_tokens.end());
    c.text += event.new_text;
    c.texts_so_far.push_back(c.text);
    c.logprobs.insert(c.logprobs.end(), event.logprobs.begin(), event.logprobs.end());
    if (!event.prompt_logprobs.empty()) c.prompt_logprobs = event.prompt_logprobs;
    ++c.events;
    c.finished = event.finished;
    c.finish_reason = event.finish_reason;
    c.stop_reason = event.stop_reason;
    c.completion_tokens = event.completion_tokens;
    c.cached_tokens = event.cached_tokens;
    if (event.completion_tokens != int64_t(c.tokens.size()))
      errors += "completion_tokens of " + event.request_id + " disagrees with the tokens sent\n";
  }
  const Choice& operator()(const std::string& id, int64_t index = 0) const { return choices.at(id + "/" + std::to_string(index)); }
};

void run_until_idle(EngineCore& engine) {
  for (int steps = 0; engine.step(); ++steps) ASSERT_LT(steps, 100000) << "the engine does not finish";
}

// Each request run by itself in a roomy engine.
Recorder run_alone(Model& model, const std::vector<Request>& requests, EngineConfig config, const Tokenizer* tokenizer = nullptr) {
  Recorder recorder;
  EngineCore engine(model, tokenizer, config);
  for (const Request& request : requests) {
    engine.add(request, recorder.callback());
    run_until_idle(engine);
  }
  EXPECT_EQ(recorder.errors, "");
  return recorder;
}

void expect_everything_free(const EngineCore& engine) {
  EXPECT_EQ(engine.cache().num_free_blocks(), engine.cache().plan().num_blocks);
  EXPECT_EQ(engine.stats().running, 0);
  EXPECT_EQ(engine.stats().waiting, 0);
  EXPECT_EQ(engine.stats().kv_blocks_used, 0);
}

Request greedy_request(std::string id, Tokens prompt, int64_t max_tokens) {
  Request r{std::move(id), std::move(prompt), {}};
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  return r;
}

// A prompt of `length` ids in [2, vocab), from a fixed generator.
Tokens random_prompt(std::mt19937& rng, int64_t length, int64_t vocab) {
  Tokens t(length);
  for (int32_t& id : t) id = int32_t(2 + rng() % uint32_t(vocab - 2));
  return t;
}

// The requests of the concurrency test: the fixture's prompts, random ones of many lengths, and two that
// share a long prefix with another (prefix-cache hits while it runs).
std::vector<Request> mixed_requests(const std::string& family, int64_t vocab) {
  std::vector<Tokens> prompts = fixture_prompts(family);
  std::mt19937 rng(1234);
  for (int64_t length : {1, 3, 17, 40, 64, 70, 9}) prompts.push_back(random_prompt(rng, length, vocab));
  Tokens shared(prompts[2].begin(), prompts[2].begin() + 70);
  for (int i = 0; i < 2; ++i) {
    Tokens p = shared;
    Tokens tail = random_prompt(rng, 5 + i * 7, vocab);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  std::vector<Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i)
    requests.push_back(greedy_request("r" + std::to_string(i), prompts[i], 10 + int64_t(i * 7) % 25));
  return requests;
}

class EngineFamily : public ::testing::TestWithParam<std::string> {};

}  // namespace

// The central property: scheduling (batching, chunking, preemption, prefix hits, aborts of others)
// never changes what a request gets.
TEST_P(EngineFamily, ConcurrentMixGivesEachRequestItsTokensAlone) {
  auto model = load_model(fixture(GetParam()).string());
  const std::vector<Request> requests = mixed_requests(GetParam(), model->vocab_size());
  Recorder alone = run_alone(*model, requests, roomy_config(*model));

  EngineConfig tight;
  tight.max_model_len = 160;
  tight.max_num_seqs = 6;
  tight.max_num_batched_tokens = 13;  // every prompt above 13 tokens is prefilled in chunks
  tight.cache = cache_with_blocks(*model, 4, 40, tight.max_num_seqs);  // 160 tokens: preemption
  EngineCore engine(*model, nullptr, tight);
  Recorder mixed;
  // Two thirds arrive at once, the rest while the others run.
  const size_t first_wave = requests.size() * 2 / 3;
  for (size_t i = 0; i < first_wave; ++i) engine.add(requests[i], mixed.callback());
  const std::set<std::string> aborted_midway = {"r2", "r7"}, aborted_early = {"r5"};
  size_t next = first_wave;
  for (int step = 0; engine.has_work() || next < requests.size(); ++step) {
    ASSERT_LT(step, 100000);
    engine.step();
    if (step % 4 == 3 && next < requests.size()) engine.add(requests[next++], mixed.callback());
    for (const std::string& id : aborted_midway)
      if (mixed.choices.count(id + "/0") && mixed(id).events == 3) engine.abort(id);
    if (step == 1)
      for (const std::string& id : aborted_early) engine.abort(id);
  }

  EXPECT_EQ(mixed.errors, "");
  EXPECT_GT(engine.stats().preemptions, 0) << "the test should force preemption";
  EXPECT_GT(engine.stats().prefix_hits, 0) << "the test should hit the prefix cache";
  for (const Request& r : requests) {
    SCOPED_TRACE(r.id + ", prompt of " + std::to_string(r.prompt.size()));
    const Choice& got = mixed(r.id);
    const Choice& want = alone(r.id);
    EXPECT_TRUE(got.finished);
    if (aborted_midway.count(r.id) || aborted_early.count(r.id)) {
      EXPECT_EQ(got.finish_reason, "abort");
      ASSERT_LE(got.tokens.size(), want.tokens.size());
      EXPECT_TRUE(std::equal(got.tokens.begin(), got.tokens.end(), want.tokens.begin()));
    } else {
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.finish_reason, want.finish_reason);
    }
  }
  EXPECT_EQ(mixed("r5").tokens.size(), 0u);
  expect_everything_free(engine);
}

TEST_P(EngineFamily, ChoicesOfOneGreedyRequestAreIdentical) {
  auto model = load_model(fixture(GetParam()).string());
  Request r = greedy_request("n3", fixture_prompts(GetParam())[1], 12);
  Recorder alone = run_alone(*model, {r}, roomy_config(*model));
  r.params.n = 3;
  Recorder three = run_alone(*model, {r}, roomy_config(*model));
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(three("n3", i).tokens, alone("n3").tokens) << "choice " << i;
}

// The start-up step (EngineConfig::warm_up, on by default on a GPU): a full budget of prompt tokens in as
// many sequences as max_model_len and max_num_seqs allow, and nothing left of it: every block free and none
// in the prefix cache, every state slot free, every counter at zero, and the requests after it get the
// tokens they get without it.
TEST_P(EngineFamily, WarmUpRunsAFullStepAndLeavesNothing) {
  auto model = load_model(fixture(GetParam()).string());
  EngineConfig config = roomy_config(*model);
  config.max_num_batched_tokens = 400;  // 160 + 160 + 80 (roomy_config's max_model_len: 160)
  const std::vector<Tokens> prompts = fixture_prompts(GetParam());
  std::vector<Request> requests;
  for (size_t i = 0; i < 3; ++i) requests.push_back(greedy_request("r" + std::to_string(i), prompts[i], 6));
  const Recorder cold = run_alone(*model, requests, config);

  config.warm_up = true;
  EngineCore engine(*model, nullptr, config);
  EXPECT_EQ(engine.warm_up(), 400);  // once more by hand: the constructor ran it too
  expect_everything_free(engine);
  EXPECT_EQ(engine.cache().num_cached_blocks(), 0);
  if (engine.cache().plan().num_state_slots > 0)
    EXPECT_EQ(engine.cache().num_free_state_slots(), engine.cache().plan().num_state_slots);
  const EngineStats stats = engine.stats();
  EXPECT_EQ(stats.prompt_tokens_total + stats.generation_tokens_total + stats.prefix_queries, 0);
  EXPECT_EQ(stats.prefill_steps.steps + stats.decode_steps.steps, 0);
  Recorder warm;
  for (const Request& request : requests) {
    engine.add(request, warm.callback());
    run_until_idle(engine);
  }
  for (const Request& request : requests) EXPECT_EQ(warm(request.id).tokens, cold(request.id).tokens) << request.id;
  EXPECT_EQ(warm(requests[0].id).cached_tokens, 0);  // the warm-up's prompt left no prefix behind
}

// The cache gpu_kv_cache_bytes measures a step in holds exactly that step: a warm-up of the full budget
// runs whole in it (and the engine accepts it for max_model_len).
TEST_P(EngineFamily, DummyStepCacheHoldsItsStep) {
  auto model = load_model(fixture(GetParam()).string());
  EngineConfig config = roomy_config(*model);
  config.max_num_batched_tokens = 400;  // sequences of 160, 160 and 80 tokens
  config.max_num_seqs = 3;              // as many state slots as the step's sequences
  config.cache = dummy_step_cache_config(*model, config.cache, config.max_num_seqs, 160, 400);
  EngineCore engine(*model, nullptr, config);
  EXPECT_EQ(engine.cache().plan().num_blocks * engine.cache().plan().block_size, 400);
  EXPECT_EQ(engine.warm_up(), 400);
  expect_everything_free(engine);
}

INSTANTIATE_TEST_SUITE_P(EngineFixtures, EngineFamily,
                         ::testing::Values("deepseek_v32", "kimi_linear", "kimi_k3", "kimi_k3_1_pro", "minimax_m3"));

TEST(EngineGreedy, MatchesTheTransformersReference) {
  auto model = load_model(fixture("deepseek_v32").string());
  std::ifstream in(fixture("deepseek_v32") / "greedy.json");
  auto want = nlohmann::json::parse(in)["completions"].get<std::vector<Tokens>>();
  std::vector<Tokens> prompts = fixture_prompts("deepseek_v32");
  EngineConfig config = roomy_config(*model);
  config.max_num_batched_tokens = 16;  // chunked prefill, all three at once
  EngineCore engine(*model, nullptr, config);
  Recorder got;
  for (size_t i = 0; i < prompts.size(); ++i) engine.add(greedy_request(std::to_string(i), prompts[i], 40), got.callback());
  run_until_idle(engine);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got(std::to_string(i)).tokens, want[i]) << "prompt " << i;
}

TEST(EngineSeeds, SameSeedSameTokensAloneOrBatched) {
  auto model = load_model(fixture("minimax_m3").string());
  std::vector<Request> requests = mixed_requests("minimax_m3", model->vocab_size());
  for (size_t i = 0; i < requests.size(); ++i) {
    SamplingParams& p = requests[i].params;
    p.temperature = 0.9f;
    p.top_p = 0.95f;
    p.top_k = 40;
    p.max_tokens = 12;
    p.seed = 100 + i;
  }
  requests[3].params.n = 3;
  Recorder alone = run_alone(*model, requests, roomy_config(*model));

  EngineConfig tight = roomy_config(*model);
  tight.max_num_seqs = 6;
  tight.max_num_batched_tokens = 11;
  tight.cache = cache_with_blocks(*model, 4, 48, tight.max_num_seqs);
  EngineCore engine(*model, nullptr, tight);
  Recorder batched;
  Request unseeded = greedy_request("unseeded", requests[0].prompt, 12);
  unseeded.params.temperature = 1.0f;
  engine.add(unseeded, batched.callback());
  for (const Request& r : requests) engine.add(r, batched.callback());
  run_until_idle(engine);
  EXPECT_GT(engine.stats().preemptions, 0);
  for (const Request& r : requests)
    for (int64_t i = 0; i < r.params.n; ++i) EXPECT_EQ(batched(r.id, i).tokens, alone(r.id, i).tokens) << r.id << "/" << i;

  // Choice i of a seeded request draws as a single request seeded with seed + i.
  Request single = requests[3];
  single.params.n = 1;
  *single.params.seed += 2;
  EXPECT_EQ(run_alone(*model, {single}, roomy_config(*model))(single.id).tokens, alone(requests[3].id, 2).tokens);
  EXPECT_NE(alone(requests[3].id, 0).tokens, alone(requests[3].id, 1).tokens);
  expect_everything_free(engine);
}

namespace {

// log_softmax of a row, in double: the reference for logprobs.
std::vector<double> log_softmax(const float* row, int64_t n) {
  double max = *std::max_element(row, row + n), sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(row[i]) - max);
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = double(row[i]) - max - std::log(sum);
  return out;
}

// Logits at every prompt position, from one offline prefill.
Tensor reference_logits(Model& model, const Tokens& prompt) {
  SequenceState state = sparrow::testing::new_sequence(model);
  Batch batch = make_batch({{&state, prompt}});
  batch.all_logits = true;
  return sparrow::testing::run_step(model, batch);
}

}  // namespace

TEST(EngineLogprobs, AreTheLogSoftmaxOfTheModelLogits) {
  auto model = load_model(fixture("deepseek_v32").string());
  const int64_t vocab = model->vocab_size();
  const Tokens prompt = fixture_prompts("deepseek_v32")[1];
  const Tensor ref = reference_logits(*model, prompt);

  Request r = greedy_request("lp", prompt, 1);
  r.params.logprobs = 4;
  r.params.prompt_logprobs = 2;
  // Penalties and temperature change the draw, never the reported logprobs (vLLM's raw_logprobs).
  r.params.temperature = 0.5f;
  r.params.repetition_penalty = 1.7f;
  r.params.seed = 9;
  EngineConfig config = roomy_config(*model);
  config.max_num_batched_tokens = 5;  // the prompt logprobs come from several chunks
  Request other = greedy_request("other", fixture_prompts("deepseek_v32")[0], 3);
  EngineCore engine(*model, nullptr, config);
  Recorder got;
  engine.add(other, got.callback());
  engine.add(r, got.callback());
  run_until_idle(engine);

  const Choice& c = got("lp");
  ASSERT_EQ(c.prompt_logprobs.size(), prompt.size());
  EXPECT_FALSE(c.prompt_logprobs[0].has_value());
  for (size_t p = 1; p < prompt.size(); ++p) {
    ASSERT_TRUE(c.prompt_logprobs[p].has_value()) << p;
    const TokenLogprob& lp = *c.prompt_logprobs[p];
    std::vector<double> want = log_softmax(ref.row(int64_t(p) - 1), vocab);
    EXPECT_EQ(lp.token, prompt[p]);
    EXPECT_NEAR(lp.logprob, want[prompt[p]], 1e-4) << "prompt position " << p;
    ASSERT_EQ(lp.top.size(), 2u);
    EXPECT_NEAR(lp.top[0].second, *std::max_element(want.begin(), want.end()), 1e-4);
  }
  ASSERT_EQ(c.logprobs.size(), 1u);
  std::vector<double> want = log_softmax(ref.row(int64_t(prompt.size()) - 1), vocab);
  EXPECT_EQ(c.logprobs[0].token, c.tokens[0]);
  EXPECT_NEAR(c.logprobs[0].logprob, want[c.tokens[0]], 1e-4);
  ASSERT_EQ(c.logprobs[0].top.size(), 4u);
  for (size_t k = 0; k < 4; ++k) {
    std::vector<double> sorted = want;
    std::sort(sorted.rbegin(), sorted.rend());
    EXPECT_NEAR(c.logprobs[0].top[k].second, sorted[k], 1e-4);
  }
  EXPECT_TRUE(got("other").prompt_logprobs.empty());
  EXPECT_TRUE(got("other").logprobs.empty());
}

TEST(EngineStops, StopTokenIdsEndOfSequenceAndMinTokens) {
  auto model = load_model(fixture("kimi_linear").string());
  const Tokens prompt = fixture_prompts("kimi_linear")[0];
  const Tokens free_run = run_alone(*model, {greedy_request("a", prompt, 20)}, roomy_config(*model))("a").tokens;
  ASSERT_EQ(free_run.size(), 20u);
  const int32_t stop_id = free_run[5];
  const size_t first = std::find(free_run.begin(), free_run.end(), stop_id) - free_run.begin();
  const Tokens until_stop(free_run.begin(), free_run.begin() + first + 1);

  Request by_id = greedy_request("by_id", prompt, 20);
  by_id.params.stop_token_ids = {stop_id};
  Choice c = run_alone(*model, {by_id}, roomy_config(*model))("by_id");
  EXPECT_EQ(c.tokens, until_stop);  // the stop token is kept
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_EQ(c.stop_reason, (std::optional<std::variant<std::string, int32_t>>(stop_id)));

  EngineConfig eos = roomy_config(*model);
  eos.eos_token_ids = {stop_id};
  c = run_alone(*model, {greedy_request("eos", prompt, 20)}, eos)("eos");
  EXPECT_EQ(c.tokens, until_stop);
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_FALSE(c.stop_reason.has_value());

  Request ignoring = greedy_request("ignore", prompt, 20);
  ignoring.params.ignore_eos = true;
  c = run_alone(*model, {ignoring}, eos)("ignore");
  EXPECT_EQ(c.tokens, free_run);
  EXPECT_EQ(c.finish_reason, "length");

  // min_tokens: the end token cannot come before min_tokens tokens exist.
  Request at_least = greedy_request("min", prompt, 20);
  at_least.params.min_tokens = int64_t(first) + 3;
  c = run_alone(*model, {at_least}, eos)("min");
  ASSERT_GE(c.tokens.size(), first + 3);
  EXPECT_EQ(std::count(c.tokens.begin(), c.tokens.begin() + int64_t(first) + 3, stop_id), 0);
  EXPECT_NE(c.tokens, free_run);
}

namespace {

// A tokenizer for the fixtures' vocabulary: token i reads as two letters, so that stop strings can start
// inside a token and span several.
class TwoLetterTokenizer : public Tokenizer {
 public:
  explicit TwoLetterTokenizer(int32_t vocab) {
    for (int32_t id = 0; id < vocab; ++id) {
      std::string text = {char('a' + id % 26), char('A' + id / 26 % 26)};
      set_token(id, text, text, /*special=*/false);
    }
  }
  std::vector<TokenId> encode(std::string_view) const override { return {}; }
};

}  // namespace

TEST(EngineStops, StopStringsAcrossTokenBoundaries) {
  auto model = load_model(fixture("deepseek_v32").string());
  TwoLetterTokenizer tokenizer(int32_t(model->vocab_size()));
  const Tokens prompt = fixture_prompts("deepseek_v32")[2];
  const Choice free_run = run_alone(*model, {greedy_request("a", prompt, 20)}, roomy_config(*model), &tokenizer)("a");
  ASSERT_EQ(free_run.text.size(), 40u);
  // The last letter of token 6 and the first two of token 7... through token 8: starts mid-token.
  const std::string stop = free_run.text.substr(13, 4);
  const size_t at = free_run.text.find(stop);
  const size_t last_token = (at + stop.size() - 1) / 2;

  for (bool include : {false, true}) {
    SCOPED_TRACE(include ? "include_stop_str_in_output" : "stop string hidden");
    Request r = greedy_request("s", prompt, 20);
    r.params.stop = {"no such text", stop};
    r.params.include_stop_str_in_output = include;
    const Choice c = run_alone(*model, {r}, roomy_config(*model), &tokenizer)("s");
    const std::string want = free_run.text.substr(0, include ? at + stop.size() : at);
    EXPECT_EQ(c.text, want);
    EXPECT_EQ(c.tokens, Tokens(free_run.tokens.begin(), free_run.tokens.begin() + int64_t(last_token) + 1));
    EXPECT_EQ(c.finish_reason, "stop");
    EXPECT_EQ(c.stop_reason, (std::optional<std::variant<std::string, int32_t>>(stop)));
    // No event ever showed text beyond what the final text keeps.
    for (const std::string& so_far : c.texts_so_far) EXPECT_EQ(want.compare(0, so_far.size(), so_far), 0) << so_far;
  }
  // Without a stop the text is every token's letters.
  std::string letters;
  for (int32_t id : free_run.tokens) letters += *tokenizer.token_bytes(id);
  EXPECT_EQ(free_run.text, letters);
}

TEST(EngineAbort, AtAnyPointFreesEverything) {
  auto model = load_model(fixture("kimi_k3_1_pro").string());
  const std::vector<Tokens> prompts = fixture_prompts("kimi_k3_1_pro");
  EngineConfig config = roomy_config(*model);
  config.max_num_batched_tokens = 8;
  EngineCore engine(*model, nullptr, config);
  Recorder got;
  engine.add(greedy_request("waiting", prompts[2], 10), got.callback());
  engine.abort("waiting");  // before any step
  engine.add(greedy_request("prefilling", prompts[2], 10), got.callback());
  engine.add(greedy_request("decoding", prompts[0], 30), got.callback());
  // (4 tokens: with 8 a step it finishes, its 2 tokens drawn, before the aborts below)
  engine.add(greedy_request("finishing", Tokens(prompts[0].begin(), prompts[0].begin() + 4), 2), got.callback());
  engine.step();
  engine.abort("prefilling");  // 8 of 70 prompt tokens computed
  for (int i = 0; i < 4; ++i) engine.step();
  engine.abort("decoding");
  engine.abort("finishing");  // already finished: ignored
  engine.abort("never submitted");
  run_until_idle(engine);

  EXPECT_EQ(got.errors, "");
  for (const char* id : {"waiting", "prefilling", "decoding"}) {
    EXPECT_TRUE(got(id).finished) << id;
    EXPECT_EQ(got(id).finish_reason, "abort") << id;
  }
  EXPECT_EQ(got("waiting").events, 1);
  EXPECT_TRUE(got("prefilling").tokens.empty());
  EXPECT_GT(got("decoding").tokens.size(), 0u);
  EXPECT_LT(got("decoding").tokens.size(), 30u);
  EXPECT_EQ(got("finishing").finish_reason, "length");
  expect_everything_free(engine);

  // abort_all, as the engine's shutdown does.
  engine.add(greedy_request("x", prompts[1], 10), got.callback());
  engine.add(greedy_request("y", prompts[2], 10), got.callback());
  engine.step();
  engine.abort_all();
  EXPECT_EQ(got("x").finish_reason, "abort");
  EXPECT_EQ(got("y").finish_reason, "abort");
  expect_everything_free(engine);
}

TEST(EngineValidation, BadRequestsAreOneLineErrors) {
  auto model = load_model(fixture("deepseek_v32").string());
  EngineCore engine(*model, nullptr, roomy_config(*model));  // max_model_len 160, vocabulary 256
  auto error = [&](Request r) { return sparrow::testing::error_message([&] { engine.add(r, [](const RequestOutput&) {}); }); };
  using sparrow::testing::mentions;
  EXPECT_TRUE(mentions(error(greedy_request("a", {}, 4)), {"prompt is empty"}));
  EXPECT_TRUE(mentions(error(greedy_request("a", {3, 256}, 4)), {"256", "vocabulary"}));
  EXPECT_TRUE(mentions(error(greedy_request("a", {3, -1}, 4)), {"-1", "vocabulary"}));
  EXPECT_TRUE(mentions(error(greedy_request("a", Tokens(150, 3), 11)), {"160", "161", "150", "11"}));
  Request bad = greedy_request("a", {3}, 4);
  bad.params.top_p = 2;
  EXPECT_TRUE(mentions(error(bad), {"top_p"}));
  bad = greedy_request("a", {3}, 0);
  EXPECT_TRUE(mentions(error(bad), {"max_tokens"}));
  bad = greedy_request("a", {3}, 4);
  bad.params.stop = {"x"};
  EXPECT_TRUE(mentions(error(bad), {"stop strings", "tokenizer"}));
  bad = greedy_request("", {3}, 4);
  EXPECT_TRUE(mentions(error(bad), {"id"}));
  engine.add(greedy_request("dup", {3}, 4), [](const RequestOutput&) {});
  EXPECT_TRUE(mentions(error(greedy_request("dup", {3}, 4)), {"dup", "already in use"}));
  EXPECT_EQ(error(greedy_request("fits", Tokens(150, 3), 10)), "");

  EngineConfig too_long = roomy_config(*model);
  too_long.max_model_len = 100000;
  EXPECT_TRUE(mentions(sparrow::testing::error_message([&] { EngineCore(*model, nullptr, too_long); }),
                       {"max_model_len", "100000"}));
}

namespace {

// Waits for the threaded engine's final events.
struct Waiter {
  std::mutex mutex;
  std::condition_variable done;
  Recorder recorder;
  int64_t finished = 0;

  std::function<void(const RequestOutput&)> callback() {
    return [this](const RequestOutput& event) {
      std::lock_guard lock(mutex);
      recorder.record(event);
      finished += event.finished;
      done.notify_all();
    };
  }
  bool wait_for(int64_t count) {
    std::unique_lock lock(mutex);
    return done.wait_for(lock, std::chrono::seconds(60), [&] { return finished >= count; });
  }
};

}  // namespace

TEST(EngineThreaded, RequestsFromManyThreadsAbortAndShutdown) {
  auto model = load_model(fixture("minimax_m3").string());
  const std::vector<Request> requests = mixed_requests("minimax_m3", model->vocab_size());
  EngineConfig config = roomy_config(*model);
  Recorder alone = run_alone(*model, requests, config);
  config.max_num_batched_tokens = 32;
  config.cache = cache_with_blocks(*model, 8, 40, config.max_num_seqs);

  Waiter waiter;
  {
    Engine engine(std::move(model), nullptr, config);
    std::vector<std::thread> clients;
    for (int t = 0; t < 3; ++t)
      clients.emplace_back([&, t] {
        for (size_t i = t; i < requests.size(); i += 3) engine.submit(requests[i], waiter.callback());
      });
    for (auto& c : clients) c.join();
    engine.abort("r4");
    EXPECT_THROW(engine.submit(requests[0], waiter.callback()), Error);  // id in use
    ASSERT_TRUE(waiter.wait_for(int64_t(requests.size())));
    // Statistics are published after each step, so they may trail the last event briefly.
    Engine::Stats stats = engine.stats();
    for (int i = 0; i < 1000 && stats.running + stats.waiting + stats.kv_blocks_used > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      stats = engine.stats();
    }
    EXPECT_EQ(stats.running + stats.waiting, 0);
    EXPECT_EQ(stats.kv_blocks_used, 0);
    EXPECT_GT(stats.generation_tokens_total, 0);

    // A request still running when the engine goes away ends with "abort".
    Request last = greedy_request("last", requests[2].prompt, 60);
    engine.submit(last, waiter.callback());
  }
  ASSERT_TRUE(waiter.wait_for(int64_t(requests.size()) + 1));
  EXPECT_EQ(waiter.recorder.errors, "");
  EXPECT_EQ(waiter.recorder("last").finish_reason, "abort");
  for (const Request& r : requests) {
    const Choice& got = waiter.recorder(r.id);
    if (r.id == "r4" && got.finish_reason == "abort") continue;
    EXPECT_EQ(got.tokens, alone(r.id).tokens) << r.id;
  }
}

namespace {


}  // namespace

TEST(EngineErrors, AFailedStepEndsItsRequestsAndTheEngineGoesOn) {
  sparrow::testing::FailingModel model(load_model(fixture("deepseek_v32").string()), /*poison=*/0);
  const Tokens prompt = fixture_prompts("deepseek_v32")[0];
  EngineCore engine(model, nullptr, roomy_config(model));
  Recorder got;
  engine.add(greedy_request("poisoned", {5, 0, 7}, 4), got.callback());
  run_until_idle(engine);
  EXPECT_EQ(got("poisoned").finish_reason, "error");
  expect_everything_free(engine);
  engine.add(greedy_request("fine", prompt, 4), got.callback());
  run_until_idle(engine);
  EXPECT_EQ(got("fine").finish_reason, "length");
  EXPECT_EQ(got("fine").tokens.size(), 4u);
  expect_everything_free(engine);
}

namespace {
// The host group of one data-parallel group: the leaders' meeting is a copy (runner/data_parallel.h).
class AloneGroup : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return Device::Cpu; }
  std::string backend() const override { return "test"; }
  void all_reduce(void*, int64_t, ScalarType) override {}
  void all_gather(const void* send, void* recv, int64_t count, ScalarType type) override {
    std::memcpy(recv, send, size_t(count) * scalar_size(type));
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, ScalarType type) override {
    std::memcpy(recv, send, size_t(count) * scalar_size(type));
  }
  void all_to_all(const void* send, void* recv, int64_t count, ScalarType type) override {
    std::memcpy(recv, send, size_t(count) * scalar_size(type));
  }
  void broadcast(void*, int64_t, int) override {}
  void send(const void*, int64_t, int) override {}
  void recv(void*, int64_t, int) override {}
  void barrier() override {}
};
}  // namespace

// Under data parallelism a failed step is not one request's error: the other groups were in its collectives,
// so the core says so (and the serving Engine ends the run) instead of going on out of step with them.
TEST(EngineErrors, AFailedDataParallelStepIsTheRunsEnd) {
  sparrow::testing::FailingModel model(load_model(fixture("deepseek_v32").string()), /*poison=*/0);
  AloneGroup leaders;
  DataParallelSync groups(leaders);
  EngineConfig config = roomy_config(model);
  config.runner.data_parallel = &groups;
  EngineCore engine(model, nullptr, config);
  Recorder got;
  engine.add(greedy_request("poisoned", {5, 0, 7}, 4), got.callback());
  const std::string error = sparrow::testing::error_message([&] { run_until_idle(engine); });
  EXPECT_NE(error.find("a data-parallel step failed"), std::string::npos) << error;
  EXPECT_NE(error.find("poisoned batch"), std::string::npos) << error;
  EXPECT_EQ(groups.exchanges(), 1);  // it met the other groups before failing
}

// A warm-up that fails (as a GPU out of memory would: the warm-up's first token is 0) stops the start with
// the cause and the flags to change, and gives back what it took.
TEST(EngineWarmUp, AFailedStepNamesTheFlags) {
  sparrow::testing::FailingModel failing(load_model(fixture("kimi_linear").string()), /*poison=*/0);
  EngineConfig config = roomy_config(failing);
  const std::string error = sparrow::testing::error_message([&] {
    config.warm_up = true;
    EngineCore engine(failing, nullptr, config);
  });
  for (const char* part : {"poisoned batch", "--kv-cache-memory", "--max-num-batched-tokens", "4096 tokens"})
    EXPECT_NE(error.find(part), std::string::npos) << part << " not in: " << error;
  config.warm_up = false;
  EngineCore engine(failing, nullptr, config);
  EXPECT_FALSE(sparrow::testing::error_message([&] { engine.warm_up(); }).empty());
  expect_everything_free(engine);
}

// --gpu-memory-utilization on a GPU, vLLM's meaning: what the weights (in use) and the two measured steps
// leave of utilization x total; nothing left is a start error with the numbers and the flags.
TEST(EngineMemory, GpuUtilizationBudget) {
  const int64_t gib = int64_t(1) << 30;
  EXPECT_EQ(gpu_kv_cache_budget(0.9, 100 * gib, 60 * gib, 5 * gib, gib), 90 * gib - 66 * gib);
  EXPECT_EQ(gpu_kv_cache_budget(1.0, 100 * gib, 60 * gib, 0, 0), 40 * gib);
  const std::string none = sparrow::testing::error_message([&] { gpu_kv_cache_budget(0.6, 100 * gib, 58 * gib, 3 * gib, gib); });
  for (const char* part : {"--gpu-memory-utilization 0.6", "leaves nothing", "58.00 GiB", "3.00 GiB", "60.00 GiB allowed", "--kv-cache-memory",
                           "--max-num-batched-tokens"})
    EXPECT_NE(none.find(part), std::string::npos) << part << " not in: " << none;
  for (double bad : {0.0, 1.5, -0.1})
    EXPECT_NE(sparrow::testing::error_message([&] { gpu_kv_cache_budget(bad, 100 * gib, 0, 0, 0); }).find("(0, 1]"),
              std::string::npos);
}
