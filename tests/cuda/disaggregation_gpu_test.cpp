// Prefill/decode disaggregation with GPU caches (docs/disaggregation.md): two engines on the GPU in one process,
// each with its own UCX agent; the rows go through host memory on both sides (KvCache::copy_out / copy_in). The
// decode engine's greedy tokens are a single GPU engine's, the prefill engine holds no blocks for its offer, and
// the decode engine's blocks come back. The CPU test of every case is tests/disaggregation_test.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "gpu_test_util.h"
#include "distributed/ucx_kv_transfer.h"
#include "engine/engine_core.h"
#include "model/model.h"

using namespace sparrow;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

struct GpuInstance {
  std::unique_ptr<KvTransferAgent> agent;
  std::unique_ptr<EngineCore> engine;
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::vector<float>> logprobs;
  std::map<std::string, std::optional<KvHandoff>> handoffs;
  std::map<std::string, bool> finished;

  GpuInstance(Model& model, const std::string& role) {
    EngineConfig config;
    config.max_model_len = 256;
    config.max_num_seqs = 4;
    config.max_num_batched_tokens = 4096;
    config.cache.block_size = 64;
    config.cache.max_num_seqs = 4;
    config.cache.memory_bytes = int64_t(256) << 20;
    if (!role.empty()) {
      agent = make_ucx_kv_transfer("127.0.0.1", 0, "127.0.0.1");
      config.kv_transfer.agent = agent.get();
      config.kv_transfer.produces = role == "kv_producer";
      config.kv_transfer.consumes = role == "kv_consumer";
    }
    engine = std::make_unique<EngineCore>(model, nullptr, config);
  }
  void run(const Request& request) {
    engine->add(request, [this](const RequestOutput& e) {
      auto& t = tokens[e.request_id];
      t.insert(t.end(), e.new_tokens.begin(), e.new_tokens.end());
      for (const TokenLogprob& l : e.logprobs) logprobs[e.request_id].push_back(l.logprob);
      if (e.finished) {
        finished[e.request_id] = true;
        handoffs[e.request_id] = e.kv_handoff;
      }
    });
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (!finished[request.id]) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << request.id << " does not finish";
      engine->step();
    }
  }
};

TEST(CudaDisaggregation, GpuCachesThroughHostMemoryGiveOneEnginesTokens) {
  SPARROW_REQUIRE_GPU();
  for (const std::string name : {"deepseek_v32_gpu", "kimi_k3_1_pro_gpu"}) {
    const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name;
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << dir << " is not in this copy of the tree";
    auto model = load_model(dir.string(), Device::Cuda);
    GpuInstance reference(*model, ""), prefill(*model, "kv_producer"), decode(*model, "kv_consumer");
    std::mt19937 rng(3);
    Request request{"r", std::vector<int32_t>(150), {}};
    for (int32_t& t : request.prompt) t = int32_t(2 + rng() % uint32_t(model->vocab_size() - 2));
    request.params.temperature = 0;
    request.params.max_tokens = 16;
    request.params.logprobs = 0;
    request.params.ignore_eos = true;
    reference.run(request);

    Request first = request;
    first.kv_transfer.remote_decode = true;
    prefill.run(first);
    ASSERT_TRUE(prefill.handoffs["r"]) << name;
    EXPECT_EQ(prefill.engine->cache().num_free_blocks(), prefill.engine->cache().plan().num_blocks)
        << "a GPU cache's offer is staged in host memory, its blocks freed";
    Request second = request;
    second.kv_transfer.remote_prefill = *prefill.handoffs["r"];
    decode.run(second);
    EXPECT_EQ(decode.tokens["r"], reference.tokens["r"]) << name;
    ASSERT_EQ(decode.logprobs["r"].size(), reference.logprobs["r"].size());
    for (size_t i = 0; i < decode.logprobs["r"].size(); ++i)
      EXPECT_NEAR(decode.logprobs["r"][i], reference.logprobs["r"][i], 1e-3) << name << " token " << i;
    EXPECT_EQ(decode.engine->stats().kv_transfer.fetches_failed, 0);
    EXPECT_EQ(decode.engine->cache().num_free_blocks(), decode.engine->cache().plan().num_blocks);
  }
}

}  // namespace
