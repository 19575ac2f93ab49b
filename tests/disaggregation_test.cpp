// Prefill/decode disaggregation in the engine (engine/kv_handoff.h), two engines in one process, each with
// its own model and its own UCX agent (the cross-process form, two servers and the proxy, is
// tests/server/test_disaggregation.py):
//   - every family (MLA + DSA, KDA + MLA, Kimi K3, GQA + MSA), prompts past the fixtures' sparse budgets: the
//     decode engine's tokens and logprobs, greedy and seeded sampling, are the ones one engine gives alone;
//     one message per block row (and one for the recurrent state), and the prefill engine's blocks come back;
//   - a decode engine's prefix-cache hit leaves its blocks out of the fetch;
//   - a dead prefill instance fails only its requests (or, with kv_load_failure_policy recompute, they are
//     prefilled where they are); an unfetched offer expires and frees its blocks; an abort mid-handoff leaks
//     nothing; mismatched caches and bad handoffs are refused with the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "core/error.h"
#include "distributed/ucx_kv_transfer.h"
#include "engine/engine_core.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;
using namespace std::chrono_literals;

fs::path fixture(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name; }

struct Output {
  Tokens tokens;
  std::vector<TokenLogprob> logprobs;
  std::string finish_reason;
  std::optional<KvHandoff> handoff;
  int64_t cached_tokens = 0;
  bool finished = false;
};

// One instance: a model, an agent (none for the reference), an engine.
struct Instance {
  std::unique_ptr<Model> model;
  std::unique_ptr<KvTransferAgent> agent;
  std::unique_ptr<EngineCore> engine;
  std::map<std::string, Output> outputs;

  Instance(const std::string& name, const std::string& role, int64_t block_size = 16,
           std::function<void(EngineConfig&)> adjust = {}) {
    model = load_model(fixture(name).string());
    EngineConfig config;
    config.max_model_len = 200;
    config.max_num_seqs = 4;
    config.max_num_batched_tokens = 4096;  // a prompt prefills in one step, as in the reference
    config.cache = sparrow::testing::cache_with_blocks(*model, block_size, 64, config.max_num_seqs);
    if (!role.empty()) {
      agent = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
      config.kv_transfer.agent = agent.get();
      config.kv_transfer.produces = role != "kv_consumer";
      config.kv_transfer.consumes = role != "kv_producer";
      config.kv_transfer.engine_id = role;
      config.kv_transfer.fetch_timeout = 10s;
    }
    if (adjust) adjust(config);
    engine = std::make_unique<EngineCore>(*model, nullptr, config);
  }
  void add(const Request& request) {
    engine->add(request, [this](const RequestOutput& event) {
      Output& o = outputs[event.request_id];
      o.tokens.insert(o.tokens.end(), event.new_tokens.begin(), event.new_tokens.end());
      o.logprobs.insert(o.logprobs.end(), event.logprobs.begin(), event.logprobs.end());
      if (event.finished) {
        o.finished = true;
        o.finish_reason = event.finish_reason;
        o.handoff = event.kv_handoff;
        o.cached_tokens = event.cached_tokens;
      }
    });
  }
  // Steps until the request finished (fetches run on the agents' threads; step() polls them).
  void run(const std::string& id) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (!outputs[id].finished) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << id << " does not finish";
      engine->step();
    }
  }
  // The prefill half, as the proxy asks for it: `request` with do_remote_decode, run to its first token; the
  // handoff its last event carries (empty, with a failure, when there is none).
  KvHandoff hand_off(Request request) {
    request.kv_transfer.remote_decode = true;
    add(request);
    run(request.id);
    const std::optional<KvHandoff>& handoff = outputs.at(request.id).handoff;
    if (!handoff) ADD_FAILURE() << request.id << ": the prefill engine gave no handoff";
    return handoff.value_or(KvHandoff{});
  }
  // Steps until every offer ended and every block is back (a few steps: the agent's thread sends meanwhile).
  void settle() {
    const auto until = std::chrono::steady_clock::now() + 10s;
    auto offers_open = [&] {
      const KvTransferStats s = engine->stats().kv_transfer;
      return s.offers > s.offers_fetched + s.offers_failed;
    };
    while ((offers_open() || engine->cache().num_free_blocks() != engine->cache().plan().num_blocks) &&
           std::chrono::steady_clock::now() < until) {
      engine->step();
      std::this_thread::sleep_for(1ms);
    }
  }
};

Tokens random_prompt(int64_t length, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Tokens t(static_cast<size_t>(length));
  for (int32_t& id : t) id = int32_t(2 + rng() % uint32_t(vocab - 2));
  return t;
}

Request make_request(const std::string& id, Tokens prompt, bool sampled) {
  Request r{id, std::move(prompt), {}};
  r.params.max_tokens = 12;
  r.params.logprobs = 2;
  if (sampled) {
    r.params.temperature = 0.9f;
    r.params.top_p = 0.95f;
    r.params.seed = 1234;
  } else {
    r.params.temperature = 0;
  }
  r.params.ignore_eos = true;  // the fixtures' random weights may draw EOS early
  return r;
}

// Prefill on `prefill`, decode on `decode`, as the proxy does it: the prefill request asks for one token.
Output disaggregated(Instance& prefill, Instance& decode, Request request) {
  request.kv_transfer.remote_prefill = prefill.hand_off(request);
  const Output& p = prefill.outputs.at(request.id);
  EXPECT_EQ(p.finish_reason, "length");
  EXPECT_EQ(p.tokens.size(), 1u);
  if (!p.handoff) return {};
  decode.add(request);
  decode.run(request.id);
  return decode.outputs.at(request.id);
}

void expect_same(const Output& got, const Output& want, const std::string& what) {
  EXPECT_EQ(got.finish_reason, want.finish_reason) << what;
  EXPECT_EQ(got.tokens, want.tokens) << what;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    EXPECT_EQ(got.logprobs[i].token, want.logprobs[i].token) << what << " token " << i;
    EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << what << " token " << i;  // the same bytes, the same math
    EXPECT_EQ(got.logprobs[i].top, want.logprobs[i].top) << what << " token " << i;
  }
}

class Disaggregation : public ::testing::TestWithParam<std::string> {};

TEST_P(Disaggregation, DecodeInstanceGivesTheTokensOfOneInstance) {
  Instance reference(GetParam(), "");
  Instance prefill(GetParam(), "kv_producer");
  Instance decode(GetParam(), "kv_consumer");
  const int64_t vocab = reference.model->vocab_size();
  const int64_t block = reference.engine->cache().plan().block_size;
  const bool recurrent = reference.engine->cache().plan().state_slot_bytes > 0;
  for (const bool sampled : {false, true}) {
    // 130 tokens: past every fixture's sparse budget (top-16 / top-64 keys, MSA's selected blocks), 9 blocks of 16.
    const Request request = make_request(sampled ? "seeded" : "greedy", random_prompt(130, vocab, sampled ? 7 : 3), sampled);
    reference.add(request);
    reference.run(request.id);
    const Output got = disaggregated(prefill, decode, request);
    expect_same(got, reference.outputs.at(request.id), GetParam() + (sampled ? " seeded" : " greedy"));
    const KvTransferStats& stats = decode.engine->stats().kv_transfer;
    EXPECT_EQ(stats.fetches_failed, 0);
    const int64_t rows = (130 + block - 1) / block;
    EXPECT_EQ(got.handoff, std::nullopt);  // only the prefill side's last event carries one
    EXPECT_EQ(stats.regions, (sampled ? 2 : 1) * (rows + (recurrent ? 1 : 0))) << "one message per block row";
    const CachePlan& plan = decode.engine->cache().plan();
    EXPECT_EQ(stats.bytes, (sampled ? 2 : 1) * (rows * plan.row_bytes + plan.state_slot_bytes));
  }
  // The prefill engine's blocks come back once its offers are fetched; the decode engine's with its requests.
  prefill.settle();
  EXPECT_EQ(prefill.engine->stats().kv_transfer.offers, 2);
  EXPECT_EQ(prefill.engine->stats().kv_transfer.offers_fetched, 2);
  EXPECT_EQ(prefill.engine->cache().num_free_blocks(), prefill.engine->cache().plan().num_blocks);
  EXPECT_EQ(decode.engine->cache().num_free_blocks(), decode.engine->cache().plan().num_blocks);
  EXPECT_FALSE(decode.engine->has_work());
}

// The path a GPU cache takes (KvTransferSettings::stage_through_host: rows copied out to host memory on the
// prefill side, which frees its blocks at once, and copied in on the decode side), here on CPU caches; either
// side may stage without the other.
TEST_P(Disaggregation, StagedThroughHostMemoryGivesTheSameTokens) {
  Instance reference(GetParam(), "");
  const Request request = make_request("staged", random_prompt(130, reference.model->vocab_size(), 5), true);
  reference.add(request);
  reference.run(request.id);
  for (const auto& [stage_prefill, stage_decode] : {std::pair{true, true}, {true, false}, {false, true}}) {
    const bool p = stage_prefill, d = stage_decode;
    Instance prefill(GetParam(), "kv_producer", 16, [p](EngineConfig& c) { c.kv_transfer.stage_through_host = p; });
    Instance decode(GetParam(), "kv_consumer", 16, [d](EngineConfig& c) { c.kv_transfer.stage_through_host = d; });
    Request second = request;
    second.kv_transfer.remote_prefill = prefill.hand_off(request);
    // A staging prefill engine holds no blocks for its offer.
    EXPECT_EQ(prefill.engine->cache().num_free_blocks() == prefill.engine->cache().plan().num_blocks, p);
    decode.add(second);
    decode.run(second.id);
    expect_same(decode.outputs.at(second.id), reference.outputs.at(request.id),
                GetParam() + " staged " + std::to_string(p) + std::to_string(d));
    prefill.settle();
    EXPECT_EQ(prefill.engine->stats().kv_transfer.offers_fetched, 1);
    EXPECT_EQ(decode.engine->cache().num_free_blocks(), decode.engine->cache().plan().num_blocks);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Disaggregation,
                         ::testing::Values("deepseek_v32", "kimi_linear", "kimi_k3", "minimax_m3"));

// A decode engine that holds the first blocks of a prompt already (an earlier request's, fetched and
// committed) fetches only the rest; the tokens stay the reference's.
TEST(DisaggregationPrefixCache, HitsOnTheDecodeSideStayOutOfTheFetch) {
  for (const std::string name : {"deepseek_v32", "minimax_m3"}) {
    Instance reference(name, "");
    Instance prefill(name, "kv_producer");
    Instance decode(name, "kv_consumer");
    const int64_t vocab = reference.model->vocab_size();
    const Tokens shared = random_prompt(96, vocab, 11);  // 6 full blocks of 16
    Tokens second = shared;
    for (int32_t t : random_prompt(40, vocab, 12)) second.push_back(t);
    Tokens first = shared;
    for (int32_t t : random_prompt(20, vocab, 13)) first.push_back(t);

    disaggregated(prefill, decode, make_request("first", first, false));
    const int64_t regions_before = decode.engine->stats().kv_transfer.regions;
    const Request request = make_request("second", second, false);
    reference.add(request);
    reference.run("second");
    const Output got = disaggregated(prefill, decode, request);
    expect_same(got, reference.outputs.at("second"), name);
    // 136 tokens = 9 rows; the 6 shared ones were there.
    EXPECT_EQ(decode.engine->stats().kv_transfer.regions - regions_before, 3) << name;
    EXPECT_EQ(got.cached_tokens, 96) << name;
    EXPECT_EQ(decode.engine->stats().kv_transfer.tokens_from_prefix_cache, 96) << name;
  }
}

// The prefill instance dies after answering: the decode engine fails that request (finish_reason "error"),
// frees its blocks and serves the next one; with kv_load_failure_policy recompute it prefills the request itself.
TEST(DisaggregationFaults, DeadPrefillInstanceFailsOnlyItsRequests) {
  for (const bool recompute : {false, true}) {
    Instance reference("kimi_linear", "");
    Instance decode("kimi_linear", "kv_consumer", 16,
                    [&](EngineConfig& c) { c.kv_transfer.recompute_on_failure = recompute; });
    const int64_t vocab = reference.model->vocab_size();
    const Request request = make_request("orphan", random_prompt(100, vocab, 21), false);
    KvHandoff handoff;
    {
      Instance prefill("kimi_linear", "kv_producer");
      handoff = prefill.hand_off(request);
    }  // the prefill instance, its engine and its agent are gone
    Request orphan = request;
    orphan.kv_transfer.remote_prefill = handoff;
    decode.add(orphan);
    decode.add(make_request("local", random_prompt(50, vocab, 22), false));
    decode.run("orphan");
    decode.run("local");
    reference.add(make_request("local", random_prompt(50, vocab, 22), false));
    reference.run("local");
    expect_same(decode.outputs.at("local"), reference.outputs.at("local"), "the request after the failure");
    if (recompute) {
      reference.add(request);
      reference.run("orphan");
      expect_same(decode.outputs.at("orphan"), reference.outputs.at("orphan"), "recomputed");
    } else {
      EXPECT_EQ(decode.outputs.at("orphan").finish_reason, "error");
      EXPECT_TRUE(decode.outputs.at("orphan").tokens.empty());
    }
    EXPECT_EQ(decode.engine->stats().kv_transfer.fetches_failed, 1);
    EXPECT_EQ(decode.engine->cache().num_free_blocks(), decode.engine->cache().plan().num_blocks);
    EXPECT_FALSE(decode.engine->has_work());
  }
}

TEST(DisaggregationFaults, UnfetchedOfferExpiresAndFreesItsBlocks) {
  Instance prefill("minimax_m3", "kv_producer", 16, [](EngineConfig& c) { c.kv_transfer.offer_expiry = 50ms; });
  const KvHandoff handoff =
      prefill.hand_off(make_request("never-fetched", random_prompt(70, prefill.model->vocab_size(), 31), false));
  ASSERT_TRUE(prefill.outputs.at("never-fetched").handoff);
  EXPECT_FALSE(handoff.transfer_id.empty());
  EXPECT_LT(prefill.engine->cache().num_free_blocks(), prefill.engine->cache().plan().num_blocks);  // held
  std::this_thread::sleep_for(200ms);
  prefill.settle();
  EXPECT_EQ(prefill.engine->cache().num_free_blocks(), prefill.engine->cache().plan().num_blocks);
  EXPECT_EQ(prefill.engine->stats().kv_transfer.offers_failed, 1);
}

TEST(DisaggregationFaults, AbortWhileWaitingForTheHandoffLeaksNothing) {
  Instance prefill("deepseek_v32", "kv_producer", 16, [](EngineConfig& c) { c.kv_transfer.offer_expiry = 500ms; });
  Instance decode("deepseek_v32", "kv_consumer");
  Request request = make_request("aborted", random_prompt(90, prefill.model->vocab_size(), 41), false);
  request.kv_transfer.remote_prefill = prefill.hand_off(request);
  decode.add(request);
  decode.engine->abort("aborted");  // before its fetch starts
  EXPECT_EQ(decode.outputs.at("aborted").finish_reason, "abort");
  // And one aborted after its fetch started (whether or not it finished, its blocks come back).
  Request again = make_request("aborted-later", random_prompt(90, prefill.model->vocab_size(), 42), false);
  again.kv_transfer.remote_prefill = prefill.hand_off(again);
  decode.add(again);
  decode.engine->step();  // starts the fetch
  decode.engine->abort("aborted-later");
  EXPECT_EQ(decode.outputs.at("aborted-later").finish_reason, "abort");
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (decode.engine->has_work() && std::chrono::steady_clock::now() < until) decode.engine->step();
  EXPECT_FALSE(decode.engine->has_work());
  EXPECT_EQ(decode.engine->cache().num_free_blocks(), decode.engine->cache().plan().num_blocks);
  prefill.settle();  // the first offer was never fetched: it expires
  EXPECT_EQ(prefill.engine->cache().num_free_blocks(), prefill.engine->cache().plan().num_blocks);
}

// A fetch under way holds its sequence slot: with max_num_seqs 1 a local request that arrives with it waits,
// and both get their reference tokens.
TEST(DisaggregationScheduling, FetchHoldsItsSequenceSlot) {
  Instance reference("deepseek_v32", "");
  Instance prefill("deepseek_v32", "kv_producer");
  Instance decode("deepseek_v32", "kv_consumer", 16, [](EngineConfig& c) { c.max_num_seqs = 1; });
  const int64_t vocab = reference.model->vocab_size();
  Request handed = make_request("handed", random_prompt(120, vocab, 61), false);
  const Request local = make_request("local", random_prompt(60, vocab, 62), false);
  for (const Request& r : {handed, local}) {
    reference.add(r);
    reference.run(r.id);
  }
  handed.kv_transfer.remote_prefill = prefill.hand_off(handed);
  decode.add(handed);
  decode.add(local);
  decode.run("handed");
  decode.run("local");
  expect_same(decode.outputs.at("handed"), reference.outputs.at("handed"), "handed");
  expect_same(decode.outputs.at("local"), reference.outputs.at("local"), "local");
}

TEST(DisaggregationValidation, MismatchedCachesAndBadHandoffsAreRefused) {
  Instance prefill("minimax_m3", "kv_producer");
  Instance decode_other_blocks("minimax_m3", "kv_consumer", 32);
  Instance plain("minimax_m3", "");
  Request request = make_request("r", random_prompt(40, prefill.model->vocab_size(), 51), false);
  Request first = request;
  first.kv_transfer.remote_decode = true;
  EXPECT_THROW(plain.engine->add(first, [](const RequestOutput&) {}), Error);  // no kv_producer role
  const KvHandoff handoff = prefill.hand_off(request);
  auto refused = [&](Instance& at, Request r, const std::string& expected) {
    try {
      at.engine->add(r, [](const RequestOutput&) {});
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  request.kv_transfer.remote_prefill = handoff;
  refused(decode_other_blocks, request, "differ from this instance's");
  refused(plain, request, "kv_consumer");
  Request shorter = request;
  shorter.prompt.pop_back();
  Instance decode("minimax_m3", "kv_consumer");
  refused(decode, shorter, "the prefill instance computed 40 prompt tokens");
  Request two = request;
  two.params.n = 2;
  refused(decode, two, "n = 1");
  Request bad_token = request;
  bad_token.kv_transfer.remote_prefill->first_token = int32_t(prefill.model->vocab_size());
  refused(decode, bad_token, "outside the vocabulary");
  Request no_logprob = request;
  no_logprob.kv_transfer.remote_prefill->first_logprob.reset();
  refused(decode, no_logprob, "logprobs");
  Request prompt_logprobs = request;
  prompt_logprobs.params.prompt_logprobs = 1;
  refused(decode, prompt_logprobs, "prompt_logprobs");
}

TEST(KvTransferConfigFlag, ReadsVllmsJsonAndRefusesWhatItCannotDo) {
  const KvTransferConfig c = parse_kv_transfer_config(
      R"({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0, "kv_buffer_device": "cpu",
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"abort_timeout_s": 2.5, "log_transfers": true}})");
  EXPECT_TRUE(c.settings.produces);
  EXPECT_TRUE(c.settings.consumes);
  EXPECT_EQ(c.port, 0);
  EXPECT_EQ(c.ip, "127.0.0.1");
  EXPECT_EQ(c.advertise_host, "127.0.0.1");
  EXPECT_EQ(c.settings.offer_expiry, 2500ms);
  EXPECT_TRUE(c.settings.log_transfers);
  EXPECT_TRUE(c.settings.recompute_on_failure);
  EXPECT_FALSE(c.settings.engine_id.empty());
  const KvTransferConfig producer = parse_kv_transfer_config(R"({"kv_connector": "UcxConnector", "kv_role": "kv_producer"})");
  EXPECT_TRUE(producer.settings.produces);
  EXPECT_FALSE(producer.settings.consumes);
  EXPECT_EQ(producer.port, 14579);
  for (const auto& [json, expected] : std::vector<std::pair<std::string, std::string>>{
           {R"({"kv_role": "kv_both"})", "kv_connector is required"},
           {R"({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})", "not one sparrow has"},
           {R"({"kv_connector": "NixlConnector", "kv_role": "prefill"})", "kv_role must be"},
           {R"({"kv_connector": "NixlConnector"})", "kv_role is required"},
           {R"({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 70000})", "kv_port"},
           {R"({"kv_connector": "NixlConnector", "kv_role": "kv_both", "colour": 1})", "unknown field 'colour'"},
           {R"({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": 1}})",
            "kv_connector_extra_config.x"},
           {R"({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"})",
            "kv_load_failure_policy"},
           {R"([1])", "expected a JSON object"},
           {R"({"kv_connector": )", "expected a JSON object"}}) {
    try {
      parse_kv_transfer_config(json);
      ADD_FAILURE() << json << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << json << ": " << e.what();
    }
  }
}

}  // namespace
