// deepseek_v32 end to end on the GPU against transformers (tests/fixtures/deepseek_v32_gpu: a tiny
// checkpoint with the real attention geometry, latent 512 + rope 64 and 32 index heads x 128, so the
// Hopper kernels run; prompts of 100 and 140 tokens exceed its top-64 budget, so selection happens).
//
// The GPU computes in bf16 and scores the indexer with FP8 keys and queries (DeepSeek's own inference
// format); transformers computes everything in fp32. On this random checkpoint the indexer does not
// discriminate: its scores are spread so evenly that rounding the index keys to FP8 — even on the CPU,
// which otherwise equals transformers to 1e-5 — already moves the logits of the 100- and 140-token
// prompts by 40-80% (printed below), and bf16 activations alone flip some selections. So:
//   - within the top-64 budget (the 40-token prompt and the first 24 steps of its continuation, where
//     every key is selected), logits and greedy tokens must equal transformers' within bf16 accuracy;
//   - beyond it the selection path runs and its logits are printed next to the FP8-indexed CPU's;
//     each kernel of that path is checked exactly against the CPU in its own test (dsa_indexer_test,
//     topk_test, mla_attention_test).
// Both latent formats of the paged cache run: bf16 and FlashMLA's FP8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "formats/safetensors.h"
#include "kernels/cpu/fp8_codec.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "gpu_test_util.h"
#include "model_test_util.h"
#include "model/model.h"
#include "runner/model_runner.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using namespace sparrow::model_test;

const fs::path kFixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/deepseek_v32_gpu";

// Relative L2 per row allowed against fp32 transformers: bf16 weights and activations through two
// layers give ~1e-2; a wrong key selection, cache slot or head offset gives O(1).
constexpr double kBf16Tolerance = 4e-2;
// FP8 latents (3 mantissa bits per value) move this random model's logits from transformers' by ~10%.
constexpr double kFp8LatentTolerance = 1.5e-1;
constexpr int64_t kTopk = 64;  // the fixture's index_topk
// Between two GPU paths over the same kernels (chunking, batching): only accumulation order differs.
constexpr double kGpuConsistency = 2e-2;
// Greedy steps whose reference top-2 margin is below this (in logits) may flip under bf16 rounding.
constexpr float kMarginNeeded = 0.1f;

// Sequences in a paged cache: on the GPU with the given latent format (index keys are FP8 there), or
// on the CPU with fp32 rows and FP8 index keys.
struct GpuCache {
  GpuCache(const Model& model, const std::string& dtype, Device device = Device::Cuda) {
    CacheConfig config;
    config.device = device;
    config.kv_cache_dtype = dtype;
    config.indexer_kv_dtype = "fp8";
    config.memory_bytes = int64_t(256) << 20;
    config.enable_prefix_caching = false;
    cache = std::make_unique<KvCache>(model.cache_spec(), config);
  }
  SequenceState sequence() {
    SequenceState s;
    s.cache = cache->view(cache->create_sequence());
    return s;
  }
  std::unique_ptr<KvCache> cache;
};

Tensor run(Model& model, const std::vector<std::pair<SequenceState*, Tokens>>& parts) {
  Batch batch = make_batch(parts);
  batch.all_logits = true;
  return ModelRunner(model).run(batch).to(Device::Cpu);
}

class CudaDeepseekV32 : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SPARROW_REQUIRE_GPU();
    prompts_ = token_lists(kFixture / "prompts.json", "prompts");
    completions_ = token_lists(kFixture / "greedy.json", "completions");
    auto file = SafetensorsFile::open((kFixture / "reference.safetensors").string());
    for (size_t i = 0; i < prompts_.size(); ++i)
      reference_.push_back(to_float32(file->tensors().at("logits." + std::to_string(i)), file));
    gpu_ = load_model(kFixture.string(), Device::Cuda);
    gpu_runner_ = std::make_unique<ModelRunner>(*gpu_);
    cache_ = std::make_unique<GpuCache>(*gpu_, GetParam());
    cpu_ = load_model(kFixture.string());
    // The CPU twin stores latents as the GPU does (fp32 standing in for bf16, or the same FP8 bytes).
    cpu_cache_ = std::make_unique<GpuCache>(*cpu_, fp8_latents() ? "fp8" : "float32", Device::Cpu);
  }

  bool fp8_latents() const { return GetParam() == "fp8"; }
  // Logit noise is ~1-3% with bf16 latents and ~10% with FP8 ones (logits here are a few units).
  float margin_needed() const { return fp8_latents() ? 0.5f : kMarginNeeded; }

  std::vector<Tokens> prompts_, completions_;
  std::vector<Tensor> reference_;
  std::unique_ptr<Model> gpu_, cpu_;
  std::unique_ptr<ModelRunner> gpu_runner_;  // the fixture model\'s steps (decode graphs persist)
  std::unique_ptr<GpuCache> cache_, cpu_cache_;  // cpu_cache_: fp32 rows, FP8 index keys
};

TEST_P(CudaDeepseekV32, LogitsMatchTransformersWithinTheBudget) {
  for (size_t i = 0; i < prompts_.size(); ++i) {
    SequenceState g = cache_->sequence(), c = cpu_cache_->sequence();
    const Tensor logits = run(*gpu_, {{&g, prompts_[i]}});
    const Tensor fp8_indexed = run(*cpu_, {{&c, prompts_[i]}});
    const double vs_transformers = worst_row_error(logits, reference_[i]);
    const double vs_cpu = worst_row_error(logits, fp8_indexed);
    std::printf("[ %s ] prompt %zu (%zu tokens): worst relative L2 vs transformers %.3g; vs the CPU with the same "
                "cache formats %.3g (which is %.3g from transformers)\n",
                GetParam().c_str(), i, prompts_[i].size(), vs_transformers, vs_cpu,
                worst_row_error(fp8_indexed, reference_[i]));
    for (int64_t k = 0; k < logits.numel(); ++k) ASSERT_TRUE(std::isfinite(logits.data()[k])) << "prompt " << i;
    if (int64_t(prompts_[i].size()) > kTopk) continue;
    // FP8 latents are themselves a rounding of the model (their quality cost is measured apart): the GPU
    // must equal the CPU storing the same bytes; with bf16 latents, transformers.
    // (The CPU codes FP8 from fp32 rows, the GPU from bf16 ones: codes near a rounding boundary differ,
    // which this random model amplifies to ~10%.)
    if (fp8_latents()) {
      EXPECT_LE(vs_cpu, kFp8LatentTolerance) << "prompt " << i;
      EXPECT_LE(vs_transformers, kFp8LatentTolerance) << "prompt " << i;
    } else {
      EXPECT_LE(vs_transformers, kBf16Tolerance) << "prompt " << i;
    }
  }
}

// Greedy decoding of the short prompt against the cache, one token at a time, while every key is still
// selected: transformers' tokens wherever its top-2 margin (read from the CPU path) exceeds bf16 noise.
TEST_P(CudaDeepseekV32, GreedyTokensMatchTransformersWithinTheBudget) {
  const Tokens& prompt = prompts_[0];
  ASSERT_LT(int64_t(prompt.size()), kTopk);
  SequenceState g = cache_->sequence(), c = cpu_cache_->sequence();
  Batch first_gpu = make_batch({{&g, prompt}}), first_cpu = make_batch({{&c, prompt}});
  first_gpu.all_logits = first_cpu.all_logits = false;
  Tensor lg = gpu_runner_->run(first_gpu).to(Device::Cpu), lc = ModelRunner(*cpu_).run(first_cpu);
  size_t checked = 0, steps = 0;
  for (size_t step = 0; int64_t(prompt.size() + step) < kTopk; ++step, ++steps) {
    const int64_t vocab = lc.dim(1);
    // transformers' token; with FP8 latents, the token of the CPU storing the same FP8 bytes.
    const int32_t expected = fp8_latents() ? argmax(lc.data(), vocab) : completions_[0][step];
    ASSERT_EQ(argmax(lc.data(), vocab), expected) << "the CPU path must equal transformers";
    if (top2_margin(lc.data(), vocab) >= margin_needed()) {
      EXPECT_EQ(argmax(lg.data(), vocab), expected) << "step " << step;
      ++checked;
    }
    Batch next_gpu = make_batch({{&g, {expected}}}), next_cpu = make_batch({{&c, {expected}}});
    next_gpu.all_logits = next_cpu.all_logits = false;
    lg = gpu_runner_->run(next_gpu).to(Device::Cpu);
    lc = ModelRunner(*cpu_).run(next_cpu);
  }
  std::printf("[ %s ] %zu of %zu greedy steps had a margin >= %.2f and were checked\n", GetParam().c_str(), checked,
              steps, margin_needed());
  EXPECT_GE(checked, steps / 2) << "too few confident steps to say anything";
}

// Within the budget, chunked prefill (decoding against what earlier chunks cached) and batching equal
// one prefill alone.
TEST_P(CudaDeepseekV32, ChunkedAndBatchedEqualOnePrefill) {
  const Tokens& prompt = prompts_[0];
  SequenceState whole = cache_->sequence();
  const Tensor one = run(*gpu_, {{&whole, prompt}});
  // Chunks of 13 tokens, decoding against the cache written by the earlier chunks.
  SequenceState chunked = cache_->sequence();
  std::vector<Tensor> pieces;
  for (size_t at = 0; at < prompt.size(); at += 13) {
    const size_t end = std::min(prompt.size(), at + 13);
    pieces.push_back(run(*gpu_, {{&chunked, Tokens(prompt.begin() + at, prompt.begin() + end)}}));
  }
  int64_t row = 0;
  double worst = 0;
  for (const Tensor& p : pieces)
    for (int64_t t = 0; t < p.dim(0); ++t, ++row)
      worst = std::max(worst, relative_l2(p.row(t), one.row(row), one.dim(1)));
  EXPECT_LE(worst, kGpuConsistency) << "chunked prefill";
  // The short prompt and the first 60 tokens of each other prompt, in one batch.
  std::vector<Tokens> pieces_in;
  for (const Tokens& p : prompts_) pieces_in.push_back(Tokens(p.begin(), p.begin() + std::min<size_t>(p.size(), 60)));
  std::vector<SequenceState> states;
  for (size_t i = 0; i < pieces_in.size(); ++i) states.push_back(cache_->sequence());
  std::vector<std::pair<SequenceState*, Tokens>> parts;
  for (size_t i = 0; i < pieces_in.size(); ++i) parts.push_back({&states[i], pieces_in[i]});
  const Tensor batched = run(*gpu_, parts);
  row = 0;
  for (size_t i = 0; i < pieces_in.size(); ++i) {
    SequenceState alone = cache_->sequence();
    const Tensor single = run(*gpu_, {{&alone, pieces_in[i]}});
    for (size_t t = 0; t < pieces_in[i].size(); ++t, ++row)
      EXPECT_LE(relative_l2(batched.row(row), single.row(int64_t(t)), single.dim(1)), kGpuConsistency)
          << "batched prompt " << i << " position " << t;
  }
}

// The selection path beyond the budget, made deterministic: with the indexer's head weights zeroed every
// score is exactly 0 on both devices, so every row beyond 64 keys selects positions 0..63 (ties go to
// the smaller position on the CPU and in the GPU's top-k alike). The GPU's index lists, paged reads of
// a strict subset of keys and sparse attention must then give the CPU's logits within bf16 accuracy.
TEST_P(CudaDeepseekV32, SparsePathMatchesTheCpuWhenTheSelectionIsDetermined) {
  const fs::path dir = fs::temp_directory_path() / "sparrow_dsv32_gpu_silent_indexer";
  fs::create_directories(dir);
  fs::copy_file(kFixture / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  auto file = SafetensorsFile::open((kFixture / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, info] : file->tensors()) {
    Tensor t = to_float32(info, file).clone();
    if (name.find("indexer.weights_proj") != std::string::npos) std::fill(t.data(), t.data() + t.numel(), 0.0f);
    tensors.push_back({name, t});
  }
  write_safetensors((dir / "model.safetensors").string(), tensors);
  auto gpu = load_model(dir.string(), Device::Cuda);
  auto cpu = load_model(dir.string());
  GpuCache gpu_cache(*gpu, GetParam()), cpu_cache(*cpu, fp8_latents() ? "fp8" : "float32", Device::Cpu);
  for (size_t i = 1; i < prompts_.size(); ++i) {
    SequenceState g = gpu_cache.sequence(), c = cpu_cache.sequence();
    const Tensor ours = run(*gpu, {{&g, prompts_[i]}}), cpu_logits = run(*cpu, {{&c, prompts_[i]}});
    const double error = worst_row_error(ours, cpu_logits);
    std::printf("[ %s ] silent indexer, prompt %zu (%zu tokens): worst relative L2 vs the CPU %.3g\n",
                GetParam().c_str(), i, prompts_[i].size(), error);
    EXPECT_LE(error, fp8_latents() ? kFp8LatentTolerance : kBf16Tolerance) << "prompt " << i;
  }
}

// Decode steps replayed from CUDA graphs equal the same steps launched directly: a batch of two
// sequences (40 and 120 tokens, the second beyond the top-64 budget so its selection path runs) decodes greedily for 24 steps, and
// the longer one crosses a graph bucket (128 keys) on the way, so a second graph is captured.
TEST_P(CudaDeepseekV32, GraphReplayEqualsEagerDecoding) {
  ASSERT_GE(prompts_[2].size(), 120u);
  const std::vector<Tokens> prompts = {prompts_[0], Tokens(prompts_[2].begin(), prompts_[2].begin() + 120)};
  auto decode = [&](bool eager, std::vector<Tensor>& logits_per_step) {
    gpu_runner_->set_enforce_eager(eager);
    std::vector<SequenceState> states(2);
    for (SequenceState& s : states) s = cache_->sequence();
    std::vector<std::pair<SequenceState*, Tokens>> parts = {{&states[0], prompts[0]}, {&states[1], prompts[1]}};
    for (int step = 0; step < 24; ++step) {
      Batch batch = make_batch(parts);
      batch.all_logits = false;
      const Tensor logits = gpu_runner_->run(batch).to(Device::Cpu);
      logits_per_step.push_back(logits);
      for (size_t s = 0; s < parts.size(); ++s) parts[s].second = {argmax(logits.row(int64_t(s)), logits.dim(1))};
    }
  };
  std::vector<Tensor> eager, graphed;
  decode(true, eager);
  const int64_t replays_before = gpu_runner_->graph_replays();
  decode(false, graphed);
  gpu_runner_->set_enforce_eager(false);
  EXPECT_GE(gpu_runner_->graph_replays() - replays_before, 18) << "most decode steps should replay a graph";
  for (size_t step = 0; step < eager.size(); ++step)
    for (int64_t s = 0; s < 2; ++s) {
      EXPECT_LE(relative_l2(graphed[step].row(s), eager[step].row(s), eager[step].dim(1)), 1e-5)
          << "step " << step << " sequence " << s;
      EXPECT_EQ(argmax(graphed[step].row(s), eager[step].dim(1)), argmax(eager[step].row(s), eager[step].dim(1)));
    }
}

INSTANTIATE_TEST_SUITE_P(CudaLatents, CudaDeepseekV32, ::testing::Values("bfloat16", "fp8"),
                         [](const auto& info) { return info.param; });

// The fixture as an FP8 checkpoint (DeepSeek-V3's format: e4m3 weights, one fp32 scale per 128x128
// block in <name>_scale_inv, quantization_config.weight_block_size). On the GPU the projections keep
// FP8 and multiply on the FP8 tensor cores with per-128-column activation scales (DeepSeek's act_quant);
// the CPU dequantises the same bytes. Both must agree within FP8 activation rounding, and the GPU must
// hold the weights in fewer bytes than the bf16 load of the same model.
TEST(CudaModel, Fp8CheckpointRunsAsFp8) {
  SPARROW_REQUIRE_GPU();
  const fs::path dir = fs::temp_directory_path() / "sparrow_dsv32_gpu_fp8";
  ASSERT_GT(write_fp8_checkpoint(kFixture, dir), 20);

  const size_t before = device::bytes_in_use();
  auto bf16_model = load_model(kFixture.string(), Device::Cuda);
  const size_t bf16_bytes = device::bytes_in_use() - before;
  bf16_model.reset();
  const size_t before_fp8 = device::bytes_in_use();
  auto gpu = load_model(dir.string(), Device::Cuda);
  const size_t fp8_bytes = device::bytes_in_use() - before_fp8;
  std::printf("weights on the GPU: %zu bytes from the bf16 checkpoint, %zu from the FP8 one\n", bf16_bytes, fp8_bytes);
  EXPECT_LT(fp8_bytes, bf16_bytes * 9 / 10) << "the FP8 projections should stay FP8 on the GPU";

  auto cpu = load_model(dir.string());
  GpuCache gpu_cache(*gpu, "bfloat16"), cpu_cache(*cpu, "float32", Device::Cpu);
  const Tokens prompt = token_lists(kFixture / "prompts.json", "prompts")[0];
  SequenceState g = gpu_cache.sequence(), c = cpu_cache.sequence();
  const Tensor ours = run(*gpu, {{&g, prompt}}), theirs = run(*cpu, {{&c, prompt}});
  const double error = worst_row_error(ours, theirs);
  std::printf("FP8 checkpoint, %zu tokens: worst relative L2 of the GPU's FP8 products vs the CPU's dequantised "
              "weights %.3g\n", prompt.size(), error);
  // The products themselves are checked against a CPU reference that quantises the activations the same
  // way (gemm_fp8_test); here the activations' FP8 rounding (3 mantissa bits, per 128 columns) runs
  // through every projection of this random model, which amplifies rounding (FP8 latents alone: ~10%).
  EXPECT_LE(error, 0.35);
}

// The CPU fixture's MLA has a 32-wide latent; the GPU kernels are built for DeepSeek's 512 + 64.
TEST(CudaModel, MlaGeometryWithoutGpuKernelsIsRefusedAtLoad) {
  SPARROW_REQUIRE_GPU();
  const fs::path kimi = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_linear";
  try {
    load_model(kimi.string(), Device::Cuda);
    FAIL() << "kimi_linear with kv_lora_rank 32 loaded on the GPU";
  } catch (const sparrow::Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv_lora_rank 512"), std::string::npos) << e.what();
  }
}

}  // namespace
