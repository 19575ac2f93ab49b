// Speculative decoding's "dspark" method on its two drafter fixtures, each a random drafter with an
// independent float64 reference written from vLLM 0.33's code:
//   kimi_k3_dspark     K3DSparkModel (MLA) for tests/fixtures/kimi_k3_1_pro, over tools/kimi_k3_reference.py
//                      (tools/make_dspark_fixture.py);
//   minimax_m3_dspark  the Qwen3 DSpark drafter (GQA with q/k norms, a 16-token sliding window, its own head
//                      over a reduced draft vocabulary with d2t) for tests/fixtures/minimax_m3, over
//                      transformers' MiniMax-M3 (tools/make_qwen3_dspark_fixture.py).
// For each:
//   - the target's captured streams (K3: AttnRes partial sums after layers 1, 4, 7; MiniMax: the residual
//     stream after layers 0 and 1) equal the reference's;
//   - the drafter's block logits, before and after the Markov bias, equal the reference's;
//   - the proposer's drafts (after a whole prefill, a chunked one, and a prefix-cache hit whose blocks carry
//     the drafter's rows) equal the reference's;
//   - the engine with --speculative-config dspark gives the greedy tokens it gives without, alone and squeezed
//     (chunked prefill, preemption, prefix hits; the target's KDA states roll back after rejections);
//   - `generate` alone and under -tp / -dp gives the same tokens.
// Bad uses are one-line errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "cuda/model_test_util.h"
#include "drafter_test_util.h"
#include "engine/dspark_proposer.h"
#include "engine/engine_core.h"
#include "engine/sequence.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"
#include "model/dspark.h"
#include "runner/model_runner.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::Held, sparrow::testing::roomy_cache, sparrow::testing::target_step;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

fs::path fixture(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name; }

using Case = sparrow::testing::DSparkCase;

// A drafter fixture and its target.
struct Pair {
  std::string drafter, target;
};
const Pair kK3{"kimi_k3_dspark", "kimi_k3_1_pro"}, kMiniMax{"minimax_m3_dspark", "minimax_m3"};

std::vector<Case> read_cases(const Pair& pair) {
  std::ifstream in(fixture(pair.drafter) / "fixture.json");
  EXPECT_EQ(nlohmann::json::parse(in)["target"], "tests/fixtures/" + pair.target);
  return sparrow::testing::read_dspark_cases(fixture(pair.drafter));
}

constexpr int64_t kBlock = 4;  // the fixtures' num_speculative_tokens

struct Loaded {
  explicit Loaded(const Pair& pair = kK3)
      : target(load_model(fixture(pair.target).string())),
        drafter(load_dspark_drafter(fixture(pair.drafter).string(), *target)) {}
  std::unique_ptr<Model> target;
  std::unique_ptr<DSparkDrafter> drafter;
};

class DSparkFixtures : public ::testing::TestWithParam<Pair> {};

Tokens propose(DraftProposer& proposer, KvCache& cache, Sequence& seq, int64_t k) {
  EXPECT_TRUE(cache.allocate(seq.cache_id, seq.num_computed() + proposer.rows_ahead(k)));
  Sequence* seqs[] = {&seq};
  const int64_t most[] = {k};
  proposer.propose(seqs, most);
  return seq.draft;
}

}  // namespace

TEST_P(DSparkFixtures, TargetStreamsMatchTheReference) {
  Loaded m(GetParam());
  ModelRunner target(*m.target);
  for (const Case& c : read_cases(GetParam())) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()));
    KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
    const SeqId id = cache.create_sequence();
    ASSERT_TRUE(cache.allocate(id, int64_t(c.prompt.size())));
    SequenceState state;
    state.cache = cache.view(id);
    Batch batch = make_batch({{&state, c.prompt}});
    batch.keep_hidden_states = true;
    batch.all_logits = false;
    const Tensor logits = target.run(batch);
    EXPECT_EQ(model_test::argmax(logits.row(0), logits.dim(1)), c.bonus);
    ASSERT_EQ(batch.hidden_states.shape(), c.aux.shape());
    const Tensor streams = batch.hidden_states.to(Device::Cpu, ScalarType::F32);
    for (int64_t p = 0; p < c.aux.dim(0); ++p)
      EXPECT_LT(model_test::relative_l2(streams.row(p), c.aux.row(p), c.aux.dim(1)), 2e-3) << "position " << p;
  }
}

// The block over the reference's own streams: the drafter alone, before and after the Markov bias.
TEST_P(DSparkFixtures, BlockLogitsMatchTheReference) {
  Loaded m(GetParam());
  ModelRunner drafter(*m.drafter);
  for (const Case& c : read_cases(GetParam())) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()));
    KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
    const Tensor base = sparrow::testing::dspark_block_logits(*m.drafter, drafter, cache, c, kBlock);
    ASSERT_EQ(base.shape(), c.base_logits.shape());
    Tokens previous = {c.bonus};
    for (int64_t i = 0; i < kBlock; ++i) {
      EXPECT_LT(model_test::relative_l2(base.row(i), c.base_logits.row(i), base.dim(1)), 2e-3) << "query " << i;
      Tensor logits = ops::select_rows(base, {i});
      ops::add_(logits, m.drafter->markov_bias({previous.back()}));
      EXPECT_LT(model_test::relative_l2(logits.row(0), c.markov_logits.row(i), base.dim(1)), 2e-3) << "query " << i;
      previous.push_back(m.drafter->target_token(model_test::argmax(logits.row(0), logits.dim(1))));
    }
    EXPECT_EQ(Tokens(previous.begin() + 1, previous.end()), c.drafts);
  }
}

TEST_P(DSparkFixtures, ProposerDraftsTheReferenceDrafts) {
  Loaded m(GetParam());
  ModelRunner target(*m.target);
  for (const Case& c : read_cases(GetParam())) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()));
    const int64_t n = int64_t(c.prompt.size());
    // One prefill step, then a prefill in chunks of 5: the context rows are written either way.
    for (int64_t chunk : {n, int64_t(5)}) {
      KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
      auto proposer = make_dspark_proposer(*m.drafter, false);
      Held held(cache, c.prompt);
      Sequence& seq = *held.seq;
      while (seq.num_computed() < n)
        target_step(target, cache, *proposer, seq, std::min(n, seq.num_computed() + chunk));
      ASSERT_EQ(seq.tokens.back(), c.bonus);
      EXPECT_EQ(propose(*proposer, cache, seq, kBlock), c.drafts) << "chunks of " << chunk;
      // A block cut short drafts fewer tokens (its own pass, so not necessarily a prefix of the others).
      EXPECT_EQ(propose(*proposer, cache, seq, 2).size(), 0u) << "no new step observed: nothing to draft";
      cache.free_sequence(seq.cache_id);
    }
  }
}

// vLLM's dspark_draft_topk (Qwen3 drafters): the Markov head corrects only each query's k best base logits. With
// k = 1 the drafts are the base argmaxes whatever the chain (the fixture's bases: top-1 margins 0.07-1.98); with k
// = the draft vocabulary, the reference drafts. Refused for K3's drafter and past the draft vocabulary.
TEST(DSpark, DraftTopKLimitsTheMarkovCandidates) {
  Loaded m(kMiniMax);
  ModelRunner target(*m.target);
  for (const Case& c : read_cases(kMiniMax)) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()));
    for (const int64_t k : {int64_t(1), m.drafter->draft_vocab}) {
      KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
      auto proposer = make_dspark_proposer(*m.drafter, false, k);
      Held held(cache, c.prompt);
      target_step(target, cache, *proposer, *held.seq, int64_t(c.prompt.size()));
      Tokens want = c.drafts;
      if (k == 1)
        for (size_t i = 0; i < want.size(); ++i) want[i] = m.drafter->target_token(c.base_argmax[i]);
      EXPECT_EQ(propose(*proposer, cache, *held.seq, kBlock), want) << "k " << k;
    }
  }
  using sparrow::testing::error_message, sparrow::testing::mentions;
  EXPECT_TRUE(mentions(error_message([&] { make_dspark_proposer(*m.drafter, false, 201); }),
                       {"dspark_draft_topk", "200"}));
  Loaded k3;
  EXPECT_TRUE(mentions(error_message([&] { make_dspark_proposer(*k3.drafter, false, 4); }),
                       {"dspark_draft_topk", "Qwen3"}));
  EXPECT_TRUE(mentions(error_message([] {
                         parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 2,
                                                      "dspark_draft_topk": 4})");
                       }),
                       {"dspark_draft_topk", "dspark"}));
  EXPECT_EQ(parse_speculative_config(R"({"method": "dspark", "model": "x", "num_speculative_tokens": 2,
                                         "dspark_draft_topk": 4})")
                .dspark_draft_topk,
            4);
}

// A prompt served from the prefix cache: the drafter's context rows came with the blocks.
TEST_P(DSparkFixtures, DraftsAfterAPrefixHitUseTheCachedRows) {
  Loaded m(GetParam());
  ModelRunner target(*m.target);
  const Case c = read_cases(GetParam()).back();
  ASSERT_GT(c.prompt.size(), 33u);
  KvCache cache(m.drafter->cache_spec(), roomy_cache(true));
  auto proposer = make_dspark_proposer(*m.drafter, false);
  Held first(cache, c.prompt);
  target_step(target, cache, *proposer, *first.seq, int64_t(c.prompt.size()));
  Held second(cache, c.prompt);
  const int64_t reused = cache.match_prefix(second.seq->cache_id, second.seq->tokens);
  ASSERT_GE(reused, 32);
  second.seq->state.length = reused;
  target_step(target, cache, *proposer, *second.seq, int64_t(c.prompt.size()));
  EXPECT_EQ(propose(*proposer, cache, *second.seq, kBlock), c.drafts);
}

TEST_P(DSparkFixtures, EngineGivesTheGreedyTokensItGivesWithout) {
  Loaded m(GetParam());
  std::vector<Tokens> prompts;
  for (const Case& c : read_cases(GetParam())) prompts.push_back(c.prompt);
  const std::vector<Request> requests = sparrow::testing::twice_each(prompts);
  const EngineConfig plain = sparrow::testing::roomy_engine();
  const auto want = sparrow::testing::engine_tokens(*m.target, requests, plain, nullptr);
  for (const char* sampling : {"greedy", "probabilistic"}) {  // greedy requests draft greedily either way
    for (bool squeezed : {false, true}) {
      SCOPED_TRACE(std::string(sampling) + (squeezed ? ", squeezed" : ", roomy"));
      EngineConfig config = plain;
      config.speculative = parse_speculative_config(
          R"({"method": "dspark", "model": ")" + fixture(GetParam().drafter).string() +
          R"(", "num_speculative_tokens": 4, "draft_sample_method": ")" + sampling + R"("})");
      config.draft_model = m.drafter.get();
      if (squeezed) sparrow::testing::squeeze(config);
      EngineStats stats;
      EXPECT_EQ(sparrow::testing::engine_tokens(*m.target, requests, config, &stats), want);
      EXPECT_GT(stats.spec_decode.drafts, 0);
      if (squeezed) EXPECT_GT(stats.preemptions + stats.prefix_hits, 0);
    }
  }
}

// Requests that sample draw their drafts from the drafter's distribution (kept for verification): a seeded
// request gives the same tokens on every run, and its drafts are verified against the target's distribution.
TEST_P(DSparkFixtures, ProbabilisticDraftsForSampledRequests) {
  Loaded m(GetParam());
  const Case c = read_cases(GetParam()).front();
  EngineConfig config;
  config.max_model_len = 160;
  config.cache = roomy_cache(false);
  config.speculative = parse_speculative_config(
      R"({"method": "dspark", "model": ")" + fixture(GetParam().drafter).string() +
      R"(", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"})");
  config.draft_model = m.drafter.get();
  auto run = [&] {
    EngineCore engine(*m.target, nullptr, config);
    Request r{"s", c.prompt, {}};
    r.params.temperature = 0.8f;
    r.params.seed = 7;
    r.params.max_tokens = 32;
    r.params.ignore_eos = true;
    Tokens out;
    engine.add(r, [&](const RequestOutput& e) { out.insert(out.end(), e.new_tokens.begin(), e.new_tokens.end()); });
    while (engine.step()) {
    }
    EXPECT_GT(engine.stats().spec_decode.draft_tokens, 0);
    return out;
  };
  const Tokens first = run();
  EXPECT_EQ(first.size(), 32u);
  EXPECT_EQ(run(), first);
}

TEST(DSpark, BadUsesAreOneLineErrors) {
  using sparrow::testing::error_message, sparrow::testing::mentions;
  auto target = load_model(fixture("kimi_k3_1_pro").string());
  // The drafters served as models.
  for (const char* drafter : {"kimi_k3_dspark", "minimax_m3_dspark"})
    EXPECT_TRUE(mentions(error_message([&] { load_model(fixture(drafter).string()); }),
                         {"DSpark drafter", "--speculative-config"}));
  // A folder that is not a DSpark drafter.
  EXPECT_TRUE(mentions(error_message([&] { load_dspark_drafter(fixture("kimi_k3_mtp").string(), *target); }),
                       {"model_type", "k3_dspark"}));
  // A drafter made for another target: a wider one (it shares the target's embedding), one of fewer layers.
  auto wider = load_model(fixture("kimi_k3_1_pro_gpu").string());
  EXPECT_TRUE(mentions(error_message([&] { load_dspark_drafter(fixture("kimi_k3_dspark").string(), *wider); }),
                       {"does not fit", "hidden 128"}));
  auto shallower = load_model(fixture("deepseek_v32").string());
  EXPECT_TRUE(mentions(error_message([&] { load_dspark_drafter(fixture("kimi_k3_dspark").string(), *shallower); }),
                       {"target_layer_ids", "0 .. 2"}));
  // The config without a drafter folder.
  EXPECT_TRUE(mentions(
      error_message([] { parse_speculative_config(R"({"method": "dspark", "num_speculative_tokens": 4})"); }),
      {"dspark", "model"}));
  // A drafter of one target in the engine of another.
  Loaded m;
  EngineConfig config;
  config.max_model_len = 64;
  config.cache = roomy_cache(false);
  config.speculative = parse_speculative_config(R"({"method": "dspark", "model": "x", "num_speculative_tokens": 2})");
  config.draft_model = m.drafter.get();
  auto minimax = load_model(fixture("minimax_m3").string());
  EXPECT_TRUE(mentions(error_message([&] { EngineCore(*minimax, nullptr, config); }), {"another model"}));
  // Qwen3 DSpark configs sparrow cannot serve as vLLM would: each a copy of the fixture with one key changed
  // (a JSON merge patch: null removes a key).
  const std::vector<std::pair<std::string, std::vector<std::string>>> changes = {
      {R"({"attention_bias": true})", {"attention_bias"}},
      {R"({"dflash_config": {"use_aux_hidden_state": false}})", {"use_aux_hidden_state"}},
      {R"({"dflash_config": {"target_layer_ids": [0, 5]}})", {"target_layer_ids", "0 .. 2"}},
      {R"({"dflash_config": {"swa_window_size": null}})", {"swa_window_size"}},
      {R"({"dflash_config": {"mask_token_id": null}})", {"mask token"}},
      {R"({"draft_vocab_size": 300})", {"draft_vocab_size"}},
      {R"({"architectures": ["Qwen3ForCausalLM"]})", {"model_type", "Qwen3DSparkModel"}},
      {R"({"hidden_act": "gelu"})", {"hidden_act", "silu"}},
      {R"({"dspark_draft_topk": 500})", {"dspark_draft_topk", "draft_vocab_size"}},
  };
  for (const auto& [patch, words] : changes) {
    SCOPED_TRACE(patch);
    const sparrow::testing::TempDir dir;
    fs::copy(fixture("minimax_m3_dspark") / "model.safetensors", dir.file("model.safetensors"));
    std::ifstream in(fixture("minimax_m3_dspark") / "config.json");
    nlohmann::json config_json = nlohmann::json::parse(in);
    config_json.merge_patch(nlohmann::json::parse(patch));
    dir.write("config.json", config_json.dump());
    const std::string message = error_message([&] { load_dspark_drafter(dir.path(), *minimax); });
    for (const std::string& word : words) EXPECT_TRUE(mentions(message, {word}));
  }
}

// `sparrow generate -sc '{"method": "dspark", ...}'`: the same completions. Under -tp / -dp the drafter runs
// whole on each group's rank 0 (its embedding and head read whole from the target's folder, its cache rows after
// the rank's share of the target's) while the target's verify steps run sharded: every layout gives the single
// process's tokens, and under -tp the same drafts are verified and accepted.
TEST_P(DSparkFixtures, GenerateCommandAloneAndSharded) {
  const Pair& pair = GetParam();
  const std::string base = "generate --model " + fixture(pair.target).string() + " --prompt-ids " +
                           (fixture(pair.target) / "prompts.json").string() +
                           " --max-tokens 20 --temperature 0 --ignore-eos";
  const std::string dspark = R"( -sc '{"method": "dspark", "model": ")" + fixture(pair.drafter).string() +
                             R"(", "num_speculative_tokens": 4}')";
  using sparrow::testing::speculation_line;
  const auto plain = sparrow::testing::run_sparrow(base);
  const auto single = sparrow::testing::run_sparrow(base + dspark);
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_EQ(single.status, 0) << single.err;
  ASSERT_EQ(single.out, plain.out);
  ASSERT_NE(speculation_line(single.err), "") << single.err;
  const std::vector<std::string> layouts =
      pair.drafter == kK3.drafter ? std::vector<std::string>{"-tp 2", "-tp 2 --enable-expert-parallel", "-tp 2 -dcp 2",
                                                             "-dp 2 -tp 2 --enable-expert-parallel"}
                                  : std::vector<std::string>{"-tp 2", "-dp 2 -tp 2 --enable-expert-parallel"};
  for (const std::string& layout : layouts) {
    SCOPED_TRACE(layout);
    const auto sharded = sparrow::testing::run_sparrow(base + " " + layout + dspark);
    EXPECT_EQ(sharded.status, 0) << sharded.err;
    EXPECT_EQ(sharded.out, plain.out);
    if (layout.find("-dp") == std::string::npos)
      EXPECT_EQ(speculation_line(sharded.err), speculation_line(single.err)) << sharded.err;
    else  // each group reports its own share of the prompts
      EXPECT_NE(sharded.err.find("speculative decoding (data-parallel group 1)"), std::string::npos) << sharded.err;
  }
}

// The bundled Kimi K3 model carries a DSpark drafter trained for it (tools/train_dspark_drafter.py,
// models/kimi_k3/README.md): greedy decoding with it gives the tokens decoding without it gives, and its drafts
// are accepted as often as its training left them (the README's figure, 1.6 here, with a margin: an untrained or
// misread drafter accepts almost nothing, 1.0-1.05), alone and with the target split over two ranks.
TEST(DSpark, BundledDrafterIsAccepted) {
  const fs::path model = fs::path(SPARROW_SOURCE_DIR) / "models/kimi_k3";
  const std::string base =
      "generate --model " + model.string() + " --prompt 'def fibonacci(n):' --max-tokens 96 --temperature 0";
  const std::string dspark = R"( -sc '{"method": "dspark", "model": ")" + (model / "dspark").string() +
                             R"(", "num_speculative_tokens": 4}')";
  for (const std::string layout : {"", " -tp 2"}) {
    SCOPED_TRACE(layout);
    const auto plain = sparrow::testing::run_sparrow(base + layout);
    ASSERT_EQ(plain.status, 0) << plain.err;
    const auto run = sparrow::testing::run_sparrow(base + layout + dspark);
    ASSERT_EQ(run.status, 0) << run.err;
    EXPECT_EQ(run.out, plain.out);
    const size_t at = run.err.find("mean acceptance length ");
    ASSERT_NE(at, std::string::npos) << run.err;
    EXPECT_GT(std::stod(run.err.substr(at + 23)), 1.35) << run.err;
  }
}

INSTANTIATE_TEST_SUITE_P(Drafters, DSparkFixtures, ::testing::Values(kK3, kMiniMax),
                         [](const ::testing::TestParamInfo<Pair>& info) {
                           return info.param.drafter == kK3.drafter ? std::string("K3") : std::string("MiniMax");
                         });
