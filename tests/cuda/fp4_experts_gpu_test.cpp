// FP4 routed experts on the GPU, loaded as the releases store them and read in place (Checkpoint::
// take_fp4_experts, ops::moe_experts -> cuda::moe_experts_fp4): MXFP4 as Kimi K3 ships its experts
// (compressed-tensors: weight_packed, weight_scale E8M0 per 32) and NVFP4 as MiniMax-M3.1-Flash ships
// its experts (ModelOpt: weight, weight_scale E4M3 per 16, weight_scale_2, input_scale).
//
// Each test writes a copy of the kimi_k3_1_pro_gpu fixture (latent experts 64 x 64: widths the FP4
// kernel takes, multiples of 32) whose routed experts are encoded with the CPU codecs
// (kernels/cpu/fp4_codec.h) and every other weight is as it was. The CPU reference dequantizes those
// codes exactly (tests/quantized_weights_test.cpp checks that against an independent Python encoder),
// so the GPU, which never widens the codes in memory, must agree with the CPU on the same checkpoint:
//   - the loaded experts stay FP4 on the device (a quarter of bf16's bytes) and the experts of one layer
//     give the CPU's outputs within bf16 rounding;
//   - the whole model gives the CPU's logits within the GPU fixture's bf16 tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "formats/checkpoint.h"
#include "formats/safetensors.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "model_test_util.h"
#include "rt_test_util.h"
#include "runner/model_runner.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using namespace sparrow::model_test;

const fs::path kSource = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k3_1_pro_gpu";
const char* kExperts = "language_model.model.layers.1.block_sparse_moe.experts";
constexpr int64_t kNumExperts = 8, kInter = 64, kLatent = 64;  // the fixture's config
constexpr double kBf16Tolerance = 4e-2;                        // tests/cuda/kimi_gpu_test.cpp's
constexpr int64_t kIndexTopk = 64;

enum class Format { Mxfp4, Nvfp4 };

// The fixture with its routed experts stored in `format`, in a fresh folder under the test's temp dir.
fs::path write_fp4_copy(Format format) {
  const fs::path dir = fs::path(::testing::TempDir()) / (format == Format::Mxfp4 ? "k3_mxfp4" : "k3_nvfp4");
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto file = SafetensorsFile::open((kSource / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, info] : file->tensors()) {
    const Tensor w = to_float32(info, file);
    if (name.find(".experts.") == std::string::npos || !name.ends_with(".weight") || w.ndim() != 2) {
      out.emplace_back(name, w);
      continue;
    }
    const std::string base = name.substr(0, name.size() - 7);
    const int64_t rows = w.dim(0), cols = w.dim(1);
    Tensor codes = Tensor::empty({rows, cols / 2}, ScalarType::U8);
    if (format == Format::Mxfp4) {
      Tensor scales = Tensor::empty({rows, cols / 32}, ScalarType::F8E8M0);
      for (int64_t r = 0; r < rows; ++r)
        cpu::mxfp4_quantize(w.row(r), cols, codes.as<uint8_t>() + r * cols / 2, scales.as<uint8_t>() + r * cols / 32);
      out.emplace_back(base + ".weight_packed", codes);
      out.emplace_back(base + ".weight_scale", scales);
    } else {
      float amax = 0;
      for (int64_t i = 0; i < w.numel(); ++i) amax = std::max(amax, std::fabs(w.data()[i]));
      const float global = std::max(amax, 1e-6f) / (6.0f * 448.0f);  // ModelOpt's weight_scale_2
      Tensor scales = Tensor::empty({rows, cols / 16}, ScalarType::F8E4M3);
      for (int64_t r = 0; r < rows; ++r)
        cpu::nvfp4_quantize(w.row(r), cols, global, codes.as<uint8_t>() + r * cols / 2,
                            scales.as<uint8_t>() + r * cols / 16);
      Tensor scale_2 = Tensor::empty({1}), input_scale = Tensor::empty({1});
      scale_2.data()[0] = global;
      input_scale.data()[0] = 1.0f;
      out.emplace_back(name, codes);
      out.emplace_back(base + ".weight_scale", scales);
      out.emplace_back(base + ".weight_scale_2", scale_2);
      out.emplace_back(base + ".input_scale", input_scale);
    }
  }
  write_safetensors((dir / "model.safetensors").string(), out);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kSource / "config.json"));
  if (format == Format::Mxfp4) {
    config["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", "mxfp4-pack-quantized"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"re:.*experts.*"}},
            {"weights",
             {{"num_bits", 4}, {"type", "float"}, {"strategy", "group"}, {"group_size", 32}, {"symmetric", true},
              {"dynamic", false}}}}}}}};
  } else {
    std::ofstream(dir / "hf_quant_config.json")
        << nlohmann::json{{"producer", {{"name", "modelopt"}}},
                          {"quantization", {{"quant_algo", "NVFP4"}, {"group_size", 16}}}}
               .dump(2);
  }
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

class CudaFp4Experts : public ::testing::TestWithParam<Format> {
 protected:
  void SetUp() override {
    SPARROW_REQUIRE_GPU();
    dir_ = write_fp4_copy(GetParam());
  }
  fs::path dir_;
};

TEST_P(CudaFp4Experts, StayFp4AndMatchTheCpuDequantization) {
  auto gpu_checkpoint = Checkpoint::open(dir_.string());
  gpu_checkpoint->place_on(Device::Cuda);
  const Checkpoint::Experts gpu = gpu_checkpoint->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(gpu.gate_up.type(), ScalarType::E2M1x2);
  EXPECT_EQ(gpu.gate_up.shape(), (Shape{kNumExperts, 2 * kInter, kLatent / 2}));
  EXPECT_EQ(gpu.down.shape(), (Shape{kNumExperts, kLatent, kInter / 2}));
  const bool nvfp4 = GetParam() == Format::Nvfp4;
  EXPECT_EQ(gpu.gate_up.block_scales().type(), nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0);
  EXPECT_EQ(gpu.down.global_scales().defined(), nvfp4);
  auto cpu_checkpoint = Checkpoint::open(dir_.string());
  const Checkpoint::Experts cpu = cpu_checkpoint->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(cpu.gate_up.type(), ScalarType::F32);

  std::mt19937_64 rng(test::fresh_seed());
  for (const int64_t tokens : {1, 5, 40}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    Tensor x = Tensor::empty({tokens, kLatent});
    for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = test::round_bf16(std::normal_distribution<float>()(rng));
    ops::Routing routing{Tensor::empty({tokens, 4}, ScalarType::I32), Tensor::empty({tokens, 4})};
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> perm(kNumExperts);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < 4; ++j) {
        routing.experts.as<int32_t>()[t * 4 + j] = perm[j];
        routing.weights.data()[t * 4 + j] = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
      }
    }
    const Tensor want = ops::moe_experts(x, routing, cpu.gate_up, cpu.down, Glu::SiluGlu, 1.0f, 7.0f);
    const ops::Routing on_gpu{routing.experts.to(Device::Cuda), routing.weights.to(Device::Cuda)};
    const Tensor got = ops::moe_experts(x.to(Device::Cuda, ScalarType::BF16), on_gpu, gpu.gate_up, gpu.down,
                                        Glu::SiluGlu, 1.0f, 7.0f)
                           .to(Device::Cpu, ScalarType::F32);
    // bf16 activations, intermediates and outputs (2^-8 each), no weight rounding.
    EXPECT_LT(relative_l2(got, want), 1.5e-2);
  }
}

TEST_P(CudaFp4Experts, ModelLogitsMatchTheCpu) {
  const std::vector<Tokens> prompts = token_lists(kSource / "prompts.json", "prompts");
  std::unique_ptr<Model> gpu = load_model(dir_.string(), Device::Cuda);
  std::unique_ptr<Model> cpu = load_model(dir_.string(), Device::Cpu);
  auto logits = [](Model& model, Device device, const Tokens& prompt) {
    CacheConfig config;
    config.device = device;
    config.memory_bytes = int64_t(64) << 20;
    config.max_num_seqs = 2;
    KvCache cache(model.cache_spec(), config);
    ModelRunner runner(model);
    SequenceState s;
    s.cache = cache.view(cache.create_sequence());
    Batch batch = make_batch({{&s, prompt}});
    batch.all_logits = true;
    return runner.run(batch).to(Device::Cpu, ScalarType::F32);
  };
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Tensor want = logits(*cpu, Device::Cpu, prompts[i]);
    const Tensor got = logits(*gpu, Device::Cuda, prompts[i]);
    double worst = 0;
    for (int64_t t = 0; t < std::min<int64_t>(got.dim(0), kIndexTopk); ++t)
      worst = std::max(worst, relative_l2(got.row(t), want.row(t), got.dim(1)));
    std::printf("[ fp4 experts ] prompt %zu: worst relative L2, GPU vs CPU, within the index budget %.3g\n", i, worst);
    EXPECT_LE(worst, kBf16Tolerance) << "prompt " << i;
  }
}

// --load-format dummy with a config that declares FP4 (the release shapes in bench/shapes/): the experts
// are FP4 codes on the device, scaled so that the layer's outputs have about the size bf16 dummies give.
TEST_P(CudaFp4Experts, DummyExpertsAreFp4OfTheBf16DummiesSize) {
  auto fp4 = Checkpoint::open_dummy(dir_.string(), 7);
  fp4->place_on(Device::Cuda);
  const Checkpoint::Experts q = fp4->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(q.gate_up.type(), ScalarType::E2M1x2);
  auto bf16 = Checkpoint::open_dummy(kSource.string(), 7);
  bf16->place_on(Device::Cuda);
  const Checkpoint::Experts b = bf16->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(b.gate_up.type(), ScalarType::BF16);
  std::mt19937_64 rng(test::fresh_seed());
  const int64_t tokens = 16;
  Tensor x = Tensor::empty({tokens, kLatent});
  for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = std::normal_distribution<float>()(rng);
  ops::Routing routing{Tensor::empty({tokens, 2}, ScalarType::I32), Tensor::empty({tokens, 2})};
  for (int64_t i = 0; i < tokens * 2; ++i) {
    routing.experts.as<int32_t>()[i] = int32_t((i / 2 * 3 + i % 2) % kNumExperts);
    routing.weights.data()[i] = 0.5f;
  }
  const ops::Routing on_gpu{routing.experts.to(Device::Cuda), routing.weights.to(Device::Cuda)};
  const Tensor xg = x.to(Device::Cuda, ScalarType::BF16);
  auto rms = [](const Tensor& t) {
    const Tensor h = t.to(Device::Cpu, ScalarType::F32);
    double s = 0;
    for (int64_t i = 0; i < h.numel(); ++i) s += double(h.data()[i]) * h.data()[i];
    return std::sqrt(s / double(h.numel()));
  };
  const double r4 = rms(ops::moe_experts(xg, on_gpu, q.gate_up, q.down, Glu::SiluGlu, 1.0f, 7.0f));
  const double r16 = rms(ops::moe_experts(xg, on_gpu, b.gate_up, b.down, Glu::SiluGlu, 1.0f, 7.0f));
  EXPECT_TRUE(std::isfinite(r4));
  // MXFP4's scale is the power of two nearest the bf16 dummies' size (up to sqrt(2) off, per matrix and
  // through the GLU's near-quadratic small-value regime), NVFP4's exact.
  EXPECT_GT(r4, 0.25 * r16);
  EXPECT_LT(r4, 4.0 * r16);
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaFp4Experts, ::testing::Values(Format::Mxfp4, Format::Nvfp4),
                         [](const auto& info) { return info.param == Format::Mxfp4 ? "Mxfp4" : "Nvfp4"; });

}  // namespace
