// Speculative decoding's "mtp" method on tests/fixtures/deepseek_v32_mtp (tools/make_mtp_fixture.py: the
// deepseek_v32 fixture with a multi-token-prediction layer, and an independent reference written from vLLM's
// DeepSeekMultiTokenPredictorLayer over transformers' modules) and tests/fixtures/kimi_k3_mtp
// (tools/kimi_k3_reference.py --variant k3_mtp: Kimi K3 with its MTP layer, vLLM's
// KimiK3MultiTokenPredictorLayer in float64; the target is recurrent, so verification rolls KDA states back)
// and tests/fixtures/minimax_m3_mtp (tools/make_mtp_fixture.py --family minimax_m3: vLLM's
// MiniMaxM3MultiTokenPredictorLayer, an MSA + MoE layer, over transformers' MiniMax-M3 modules):
//   - the MTP layer's logits at every prompt position equal the reference's;
//   - the proposer's drafts (after a whole prefill, after a chunked one, and after a prefix-cache hit whose
//     blocks carry the layer's rows) equal the reference's drafts;
//   - the engine with --speculative-config mtp gives the greedy tokens it gives without, alone and squeezed
//     (chunked prefill, preemption, prefix hits);
//   - bad uses are one-line errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "cuda/model_test_util.h"
#include "drafter_test_util.h"
#include "engine/engine_core.h"
#include "engine/mtp_proposer.h"
#include "engine/sequence.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"
#include "model/mtp.h"
#include "runner/model_runner.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::Held, sparrow::testing::roomy_cache, sparrow::testing::target_step;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

fs::path fixture(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name; }

struct MtpFixture {
  std::vector<Tokens> prompts, drafts;
  Tokens next;
  std::vector<Tensor> logits;  // the MTP logits at every prompt position
};

MtpFixture read_fixture(const std::string& name) {
  MtpFixture f;
  std::ifstream prompts(fixture(name) / "prompts.json"), mtp(fixture(name) / "mtp.json");
  f.prompts = nlohmann::json::parse(prompts)["prompts"].get<std::vector<Tokens>>();
  const nlohmann::json j = nlohmann::json::parse(mtp);
  f.drafts = j["drafts"].get<std::vector<Tokens>>();
  f.next = j["next"].get<Tokens>();
  std::shared_ptr<SafetensorsFile> file =
      SafetensorsFile::open((fixture(name) / "mtp_reference.safetensors").string());
  for (size_t i = 0; i < f.prompts.size(); ++i)
    f.logits.push_back(to_float32(file->tensors().at("mtp_logits." + std::to_string(i)), file));
  return f;
}

struct Loaded {
  explicit Loaded(const std::string& name)
      : target(load_model(fixture(name).string())), drafter(load_mtp_drafter(fixture(name).string(), Device::Cpu)) {}
  std::unique_ptr<Model> target;
  std::unique_ptr<MtpDrafter> drafter;
};

class MtpFamily : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(MtpFamily, LayerLogitsMatchTheReference) {
  Loaded m(GetParam());
  const MtpFixture f = read_fixture(GetParam());
  ModelRunner target(*m.target), drafter(*m.drafter);
  for (size_t i = 0; i < f.prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
    const SeqId id = cache.create_sequence();
    const int64_t n = int64_t(f.prompts[i].size());
    ASSERT_TRUE(cache.allocate(id, n));
    SequenceState state;
    state.cache = cache.view(id);
    Batch batch = make_batch({{&state, f.prompts[i]}});
    batch.keep_hidden_states = true;
    batch.all_logits = false;
    const Tensor logits = target.run(batch);
    EXPECT_EQ(model_test::argmax(logits.row(0), logits.dim(1)), f.next[i]);
    // The layer over (t_{p+1}, h_p) for every prompt position, t_n the greedy next token.
    Tokens next_tokens(f.prompts[i].begin() + 1, f.prompts[i].end());
    next_tokens.push_back(f.next[i]);
    SequenceState mtp_state;
    mtp_state.cache = cache.view(id);
    Batch mtp = make_batch({{&mtp_state, next_tokens}});
    mtp.all_logits = true;
    mtp.hidden_states_in = batch.hidden_states;
    const Tensor mtp_logits = drafter.run(mtp);
    ASSERT_EQ(mtp_logits.shape(), f.logits[i].shape());
    for (int64_t p = 0; p < n; ++p) {
      EXPECT_LT(model_test::relative_l2(mtp_logits.row(p), f.logits[i].row(p), mtp_logits.dim(1)), 2e-3) << "position " << p;
      EXPECT_EQ(model_test::argmax(mtp_logits.row(p), mtp_logits.dim(1)), model_test::argmax(f.logits[i].row(p), f.logits[i].dim(1)))
          << "position " << p;
    }
  }
}

TEST_P(MtpFamily, ProposerDraftsTheReferenceDrafts) {
  Loaded m(GetParam());
  const MtpFixture f = read_fixture(GetParam());
  ModelRunner target(*m.target);
  for (size_t i = 0; i < f.prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    const int64_t n = int64_t(f.prompts[i].size());
    // One prefill step, then a prefill in chunks of 5: the layer sees every position either way.
    for (int64_t chunk : {n, int64_t(5)}) {
      KvCache cache(m.drafter->cache_spec(), roomy_cache(false));
      auto proposer = make_mtp_proposer(*m.drafter);
      Held held(cache, f.prompts[i]);
      Sequence& seq = *held.seq;
      while (seq.num_computed() < n) target_step(target, cache, *proposer, seq, std::min(n, seq.num_computed() + chunk));
      ASSERT_EQ(seq.tokens.back(), f.next[i]);
      ASSERT_TRUE(cache.allocate(seq.cache_id, seq.num_computed() + proposer->rows_ahead(3)));
      Sequence* seqs[] = {&seq};
      const int64_t k[] = {3};
      proposer->propose(seqs, k);
      EXPECT_EQ(seq.draft, f.drafts[i]) << "chunks of " << chunk;
      cache.free_sequence(seq.cache_id);
    }
  }
}

// A prompt served from the prefix cache: the layer's rows came with the blocks.
TEST_P(MtpFamily, DraftsAfterAPrefixHitUseTheCachedRows) {
  Loaded m(GetParam());
  const MtpFixture f = read_fixture(GetParam());
  ModelRunner target(*m.target);
  const Tokens& prompt = f.prompts.back();
  ASSERT_GT(prompt.size(), 33u);
  KvCache cache(m.drafter->cache_spec(), roomy_cache(true));
  auto proposer = make_mtp_proposer(*m.drafter);
  Held first(cache, prompt);
  target_step(target, cache, *proposer, *first.seq, int64_t(prompt.size()));
  Held second(cache, prompt);
  const int64_t reused = cache.match_prefix(second.seq->cache_id, second.seq->tokens);
  ASSERT_GE(reused, 32);
  second.seq->state.length = reused;
  target_step(target, cache, *proposer, *second.seq, int64_t(prompt.size()));
  ASSERT_TRUE(cache.allocate(second.seq->cache_id, second.seq->num_computed() + proposer->rows_ahead(3)));
  Sequence* seqs[] = {second.seq.get()};
  const int64_t k[] = {3};
  proposer->propose(seqs, k);
  EXPECT_EQ(second.seq->draft, f.drafts.back());
}

TEST_P(MtpFamily, EngineGivesTheGreedyTokensItGivesWithout) {
  Loaded m(GetParam());
  const MtpFixture f = read_fixture(GetParam());
  const std::vector<Request> requests = sparrow::testing::twice_each(f.prompts);
  const EngineConfig plain = sparrow::testing::roomy_engine();
  const auto want = sparrow::testing::engine_tokens(*m.target, requests, plain, nullptr);
  for (bool squeezed : {false, true}) {
    SCOPED_TRACE(squeezed ? "squeezed" : "roomy");
    EngineConfig config = plain;
    config.speculative = parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 3})");
    config.draft_model = m.drafter.get();
    if (squeezed) sparrow::testing::squeeze(config);
    EngineStats stats;
    EXPECT_EQ(sparrow::testing::engine_tokens(*m.target, requests, config, &stats), want);
    EXPECT_GT(stats.spec_decode.drafts, 0);
    if (squeezed) EXPECT_GT(stats.preemptions + stats.prefix_hits, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpFamily, ::testing::Values("deepseek_v32_mtp", "kimi_k3_mtp", "minimax_m3_mtp"));

TEST(Mtp, BadUsesAreOneLineErrors) {
  // A family without an MTP layer in sparrow (transformers' Kimi Linear), and a checkpoint without the layer.
  using sparrow::testing::error_message, sparrow::testing::mentions;
  EXPECT_TRUE(mentions(error_message([] { load_mtp_drafter(fixture("kimi_linear").string(), Device::Cpu); }),
                       {"not built for"}));
  EXPECT_TRUE(mentions(error_message([] { load_mtp_drafter(fixture("deepseek_v32").string(), Device::Cpu); }),
                       {"eh_proj"}));
  // The layer of another model than the one served.
  Loaded m("deepseek_v32_mtp");
  auto other = load_model(fixture("minimax_m3").string());
  EngineConfig config;
  config.max_model_len = 64;
  config.cache = roomy_cache(false);
  config.speculative = parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 2})");
  config.draft_model = m.drafter.get();
  EXPECT_TRUE(mentions(error_message([&] { EngineCore(*other, nullptr, config); }), {"another model"}));
}

// `sparrow generate -sc '{"method": "mtp", ...}'`: the same completions; the refusals name the reason.
TEST(Mtp, GenerateCommand) {
  const std::string base = "generate --model " + fixture("deepseek_v32_mtp").string() + " --prompt-ids " +
                           (fixture("deepseek_v32_mtp") / "prompts.json").string() +
                           " --max-tokens 20 --temperature 0 --ignore-eos";
  const auto plain = sparrow::testing::run_sparrow(base);
  const auto mtp = sparrow::testing::run_sparrow(base + R"( -sc '{"method": "mtp", "num_speculative_tokens": 3}')");
  EXPECT_EQ(plain.status, 0) << plain.err;
  EXPECT_EQ(mtp.status, 0) << mtp.err;
  EXPECT_EQ(mtp.out, plain.out);
  // Dummy weights and simulated routing (benchmarks at real dimensions) reach the MTP layer too.
  const std::string dummy = base + " --load-format dummy --moe-routing-simulation uniform_random";
  const auto dummy_plain = sparrow::testing::run_sparrow(dummy);
  const auto dummy_mtp = sparrow::testing::run_sparrow(dummy + R"( -sc '{"method": "mtp", "num_speculative_tokens": 3}')");
  EXPECT_EQ(dummy_mtp.status, 0) << dummy_mtp.err;
  EXPECT_EQ(dummy_mtp.out, dummy_plain.out);
  EXPECT_NE(dummy_mtp.out, plain.out);
}

using sparrow::testing::speculation_line;

// Under -tp / -dp the MTP layer runs whole on each group's rank 0 (its cache rows after the target's share of
// the layers) while the target's verify steps run sharded: every layout gives the single process's tokens,
// and under -tp the same drafts are verified and accepted (the same counts).
TEST_P(MtpFamily, ShardedRunsDraftWithTheWholeLayer) {
  const std::string name = GetParam();
  const std::string base = "generate --model " + fixture(name).string() + " --prompt-ids " +
                           (fixture(name) / "prompts.json").string() + " --max-tokens 20 --temperature 0 --ignore-eos";
  const std::string mtp = R"( -sc '{"method": "mtp", "num_speculative_tokens": 3}')";
  const auto plain = sparrow::testing::run_sparrow(base);
  const auto single = sparrow::testing::run_sparrow(base + mtp);
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_EQ(single.status, 0) << single.err;
  ASSERT_EQ(single.out, plain.out);
  ASSERT_NE(speculation_line(single.err), "") << single.err;
  std::vector<std::string> layouts = {"-tp 2", "-tp 2 --enable-expert-parallel", "-dp 2 -tp 2 --enable-expert-parallel"};
  if (name != "minimax_m3_mtp") layouts.push_back("-tp 2 -dcp 2");  // MLA targets only
  for (const std::string& layout : layouts) {
    SCOPED_TRACE(layout);
    const auto sharded = sparrow::testing::run_sparrow(base + " " + layout + mtp);
    EXPECT_EQ(sharded.status, 0) << sharded.err;
    EXPECT_EQ(sharded.out, plain.out);
    if (layout.find("-dp") == std::string::npos)
      EXPECT_EQ(speculation_line(sharded.err), speculation_line(single.err)) << sharded.err;
    else  // each group reports its own share of the prompts
      EXPECT_NE(sharded.err.find("speculative decoding (data-parallel group 1)"), std::string::npos) << sharded.err;
  }
}

// The bundled DeepSeek-V3.2 and MiniMax-M3 models carry MTP layers trained for them (tools/train_mtp_drafter.py,
// their READMEs): greedy decoding with one gives the tokens decoding without it gives, and its drafts are
// accepted as often as its training left them (the README's figure, 1.9-2.1 here, with a wide margin: an
// untrained or misread layer accepts almost nothing), alone and with the target split over two ranks (the
// layer whole on rank 0).
class BundledMtp : public ::testing::TestWithParam<std::string> {};

TEST_P(BundledMtp, DraftsWithItsTrainedLayer) {
  const std::string model = (fs::path(SPARROW_SOURCE_DIR) / "models" / GetParam()).string();
  const std::string base = "generate --model " + model + " --prompt 'def fibonacci(n):' --max-tokens 96 --temperature 0";
  const std::string mtp = R"( -sc '{"method": "mtp", "num_speculative_tokens": 3}')";
  for (const std::string layout : {"", " -tp 2"}) {
    SCOPED_TRACE(layout);
    // Against the same layout without speculation: the CPU path is batch-invariant (docs/engine.md), so the
    // verify steps' logits are bitwise those of one-token steps; two ranks sum in another order than one.
    const auto plain = sparrow::testing::run_sparrow(base + layout);
    ASSERT_EQ(plain.status, 0) << plain.err;
    const auto run = sparrow::testing::run_sparrow(base + layout + mtp);
    ASSERT_EQ(run.status, 0) << run.err;
    EXPECT_EQ(run.out, plain.out);
    const std::string line = speculation_line(run.err);
    const size_t at = line.find("mean acceptance length ");
    ASSERT_NE(at, std::string::npos) << run.err;
    EXPECT_GT(std::stod(line.substr(at + 23)), 1.5) << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BundledMtp, ::testing::Values("deepseek_v32", "minimax_m3"));
