// Weights in the MX / NV formats on the GPU, loaded as the releases store them and read in place
// (Checkpoint::take_grouped_experts and take_linear; ops::moe_experts -> cuda::moe_experts_packed,
// ops::linear -> cuda::gemm_skinny or, above decode sizes, cuda::dequantize_grouped + cuBLASLt), in the
// layouts the releases use:
//   - Kimi K3: MXFP4 routed experts (compressed-tensors: weight_packed, weight_scale E8M0 per 32), the
//     rest bf16;
//   - MiniMax-M3.1-Flash: NVFP4 routed experts (ModelOpt: weight, weight_scale E4M3 per 16,
//     weight_scale_2, input_scale) and MXFP8 projections (weight E4M3, weight_scale E8M0 per 32);
//   - MiniMax-M3: MXFP8 experts and projections;
//   - NVFP4 everywhere (ModelOpt's NVFP4 recipe), whose differing per-matrix global scales make the
//     stacked q/k/v projections fall back to bf16 (ops::concat_rows).
//
// Each test writes a copy of the kimi_k3_1_pro_gpu fixture (latent experts 64 x 64, projections 64-4096
// wide: multiples of 32) with its weights encoded by the CPU codecs (kernels/cpu/fp4_codec.h,
// fp8_codec.h). The CPU reference dequantizes those codes exactly (tests/quantized_weights_test.cpp checks
// that against an independent Python encoder), so the GPU, which never widens the codes in memory but for
// the prefill-sized products, must agree with the CPU on the same checkpoint:
//   - the loaded weights stay in their format on the device, and one layer's experts and one projection
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
#include "kernels/cpu/fp8_codec.h"
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

enum class Format { Bf16, Mxfp4, Nvfp4, Mxfp8 };
const char* format_name(Format f) {
  return f == Format::Mxfp4 ? "Mxfp4" : f == Format::Nvfp4 ? "Nvfp4" : f == Format::Mxfp8 ? "Mxfp8" : "Bf16";
}
// How the copy stores its routed experts and its other projections.
struct Layout {
  Format experts, linears;
};
std::string layout_name(const Layout& l) {
  return std::string(format_name(l.experts)) + "Experts" + format_name(l.linears) + "Linears";
}

// MXFP8 (OCP MX v1.0 6.3): per 32 values X = 2^(floor(log2(amax)) - 8) (8: E4M3's largest exponent),
// codes e4m3(v / X), saturating at 448.
void mxfp8_quantize(const float* v, int64_t n, uint8_t* codes, uint8_t* scales) {
  for (int64_t g = 0; g < n / 32; ++g) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[32 * g + i]));
    int exponent = 0;
    std::frexp(amax, &exponent);  // amax = m 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    const int code = amax == 0.0f ? 0 : std::clamp(exponent - 1 - 8 + 127, 0, 254);
    scales[g] = uint8_t(code);
    const float x = cpu::e8m0_to_float(uint8_t(code));
    for (int i = 0; i < 32; ++i)
      codes[32 * g + i] = cpu::float_to_e4m3(std::clamp(v[32 * g + i] / x, -448.0f, 448.0f));
  }
}

// The projections ops::linear reads (take_linear) and the experts: 2-D weights, not the embeddings, the
// head, the norms or the 1-row AttnRes projections; a width the formats take.
bool is_expert(const std::string& name) { return name.find(".experts.") != std::string::npos; }
bool is_projection(const std::string& name, const Tensor& w) {
  return w.ndim() == 2 && name.ends_with(".weight") && w.dim(1) % 32 == 0 && w.dim(0) > 1 && !is_expert(name) &&
         name.find("embed_tokens") == std::string::npos && name.find("lm_head") == std::string::npos &&
         name.find("norm") == std::string::npos && name.find(".gate.") == std::string::npos;
}

// `w` stored as `format` under the release's names (appended to `out`).
void encode(const std::string& name, const Tensor& w, Format format, std::vector<std::pair<std::string, Tensor>>& out) {
  const std::string base = name.substr(0, name.size() - 7);
  const int64_t rows = w.dim(0), cols = w.dim(1);
  if (format == Format::Mxfp8) {
    Tensor codes = Tensor::empty({rows, cols}, ScalarType::F8E4M3);
    Tensor scales = Tensor::empty({rows, cols / 32}, ScalarType::F8E8M0);
    for (int64_t r = 0; r < rows; ++r)
      mxfp8_quantize(w.row(r), cols, codes.as<uint8_t>() + r * cols, scales.as<uint8_t>() + r * cols / 32);
    out.emplace_back(name, codes);
    out.emplace_back(base + ".weight_scale", scales);
    return;
  }
  Tensor codes = Tensor::empty({rows, cols / 2}, ScalarType::U8);
  if (format == Format::Mxfp4) {
    Tensor scales = Tensor::empty({rows, cols / 32}, ScalarType::F8E8M0);
    for (int64_t r = 0; r < rows; ++r)
      cpu::mxfp4_quantize(w.row(r), cols, codes.as<uint8_t>() + r * cols / 2, scales.as<uint8_t>() + r * cols / 32);
    out.emplace_back(base + ".weight_packed", codes);
    out.emplace_back(base + ".weight_scale", scales);
    return;
  }
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

// The fixture stored as `layout` says, in a fresh folder under the test's temp dir, with the config
// (quantization_config or hf_quant_config.json) a release of that layout has.
fs::path write_copy(const Layout& layout) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("k3_" + layout_name(layout));
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto file = SafetensorsFile::open((kSource / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, info] : file->tensors()) {
    const Tensor w = to_float32(info, file);
    const bool expert = is_expert(name) && name.ends_with(".weight") && w.ndim() == 2;
    const Format format = expert ? layout.experts : is_projection(name, w) ? layout.linears : Format::Bf16;
    if (format == Format::Bf16) out.emplace_back(name, w);
    else encode(name, w, format, out);
  }
  write_safetensors((dir / "model.safetensors").string(), out);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kSource / "config.json"));
  if (layout.experts == Format::Mxfp4) {
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
    auto algo = [](Format f) { return f == Format::Nvfp4 ? "NVFP4" : "MXFP8"; };
    nlohmann::json quantization = {{"quant_algo", algo(layout.experts)}};
    if (layout.linears != layout.experts)  // MiniMax-M3.1-Flash's recipe: one algo per layer
      quantization = {{"quant_algo", "MIXED_PRECISION"},
                      {"quantized_layers",
                       {{"model.layers.1.block_sparse_moe.experts.0.w1", {{"quant_algo", algo(layout.experts)}}},
                        {"model.layers.0.self_attn.q_proj", {{"quant_algo", algo(layout.linears)}}}}}};
    std::ofstream(dir / "hf_quant_config.json")
        << nlohmann::json{{"producer", {{"name", "modelopt"}}}, {"quantization", quantization}}.dump(2);
  }
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

ScalarType code_type(Format f) { return f == Format::Mxfp8 ? ScalarType::F8E4M3 : ScalarType::E2M1x2; }
ScalarType scale_type(Format f) { return f == Format::Nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0; }
int64_t per_byte(Format f) { return f == Format::Mxfp8 ? 1 : 2; }

class CudaGroupedWeights : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    SPARROW_REQUIRE_GPU();
    dir_ = write_copy(GetParam());
  }
  fs::path dir_;
};

TEST_P(CudaGroupedWeights, ExpertsStayAsStoredAndMatchTheCpuDequantization) {
  const Format format = GetParam().experts;
  auto gpu_checkpoint = Checkpoint::open(dir_.string());
  gpu_checkpoint->place_on(Device::Cuda);
  const Checkpoint::Experts gpu = gpu_checkpoint->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(gpu.gate_up.type(), code_type(format));
  EXPECT_EQ(gpu.gate_up.shape(), (Shape{kNumExperts, 2 * kInter, kLatent / per_byte(format)}));
  EXPECT_EQ(gpu.down.shape(), (Shape{kNumExperts, kLatent, kInter / per_byte(format)}));
  const bool nvfp4 = format == Format::Nvfp4;
  EXPECT_EQ(gpu.gate_up.block_scales().type(), scale_type(format));
  EXPECT_EQ(gpu.down.global_scales().defined(), nvfp4);
  auto cpu_checkpoint = Checkpoint::open(dir_.string());
  const Checkpoint::Experts cpu = cpu_checkpoint->take_experts(kExperts, kNumExperts, kInter, kLatent);
  // The CPU keeps them as stored too and widens one expert per product, exactly (kernels/cpu/stored_weights.h).
  ASSERT_EQ(cpu.gate_up.type(), code_type(format));

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

// One projection (the MLA layer's q_b-sized indexer wq_b, 4096 x 64, and a KDA o_proj, 128 x 128) at
// decode sizes (the skinny kernel) and above them (widened per call, then cuBLASLt): the CPU's product on
// the exact dequantization, within bf16 rounding; dequantize_weight is the CPU's dequantization rounded
// once to bf16, bit for bit.
TEST_P(CudaGroupedWeights, ProjectionsStayAsStoredAndMatchTheCpuDequantization) {
  const Format format = GetParam().linears;
  if (format == Format::Bf16) GTEST_SKIP() << "this layout keeps its projections in bf16";
  std::mt19937_64 rng(test::fresh_seed());
  for (const auto& [name, out, in] : {std::tuple<std::string, int64_t, int64_t>{
                                          "language_model.model.layers.2.self_attn.indexer.wq_b.weight", 4096, 64},
                                      {"language_model.model.layers.0.self_attn.o_proj.weight", 128, 128}}) {
    SCOPED_TRACE(name);
    auto gpu_checkpoint = Checkpoint::open(dir_.string());
    gpu_checkpoint->place_on(Device::Cuda);
    const Tensor gpu = gpu_checkpoint->take_linear(name, {out, in});
    ASSERT_EQ(gpu.type(), code_type(format));
    EXPECT_EQ(gpu.shape(), (Shape{out, in / per_byte(format)}));
    EXPECT_EQ(gpu.block_scales().type(), scale_type(format));
    auto cpu_checkpoint = Checkpoint::open(dir_.string());
    const Tensor cpu = cpu_checkpoint->take(name, {out, in});
    ASSERT_EQ(cpu.type(), ScalarType::F32);
    const Tensor wide = ops::dequantize_weight(gpu).to(Device::Cpu, ScalarType::F32);
    int64_t differ = 0;
    for (int64_t i = 0; i < cpu.numel(); ++i) differ += wide.data()[i] != test::round_bf16(cpu.data()[i]);
    EXPECT_EQ(differ, 0) << "dequantize_weight differs from the CPU's dequantization rounded to bf16";
    for (const int64_t tokens : {1, 3, 8, 40}) {
      SCOPED_TRACE("tokens " + std::to_string(tokens));
      Tensor x = Tensor::empty({tokens, in});
      for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = test::round_bf16(std::normal_distribution<float>()(rng));
      const Tensor want = ops::linear(x, cpu);
      const Tensor got = ops::linear(x.to(Device::Cuda, ScalarType::BF16), gpu).to(Device::Cpu, ScalarType::F32);
      // The output's bf16 rounding (2^-8); no weight rounding at decode sizes, one bf16 rounding above.
      EXPECT_LT(relative_l2(got, want), 1e-2);
    }
  }
}

TEST_P(CudaGroupedWeights, ModelLogitsMatchTheCpu) {
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
    std::printf("[ grouped weights ] prompt %zu: worst relative L2, GPU vs CPU, within the index budget %.3g\n", i,
                worst);
    EXPECT_LE(worst, kBf16Tolerance) << "prompt " << i;
  }
}

// --load-format dummy with a config that declares these formats (the release shapes in bench/shapes/):
// the experts and projections are codes on the device as the config says (QuantizationConfig::
// expert_packed, linear_packed), scaled so that the layer's outputs have about the size bf16 dummies give.
TEST_P(CudaGroupedWeights, DummyWeightsAreStoredAsDeclaredAtTheBf16DummiesSize) {
  auto fp4 = Checkpoint::open_dummy(dir_.string(), 7);
  fp4->place_on(Device::Cuda);
  const Checkpoint::Experts q = fp4->take_experts(kExperts, kNumExperts, kInter, kLatent);
  ASSERT_EQ(q.gate_up.type(), code_type(GetParam().experts));
  const Tensor projection = fp4->take_linear("language_model.model.layers.0.self_attn.o_proj.weight", {128, 128});
  // Only MXFP8 projections are declared apart from the experts (an FP4-only config quantizes the experts).
  EXPECT_EQ(projection.type(), GetParam().linears == Format::Mxfp8 ? ScalarType::F8E4M3 : ScalarType::BF16);
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
  // MX scales are the power of two nearest the bf16 dummies' size (up to sqrt(2) off, per matrix and
  // through the GLU's near-quadratic small-value regime), NVFP4's exact.
  EXPECT_GT(r4, 0.25 * r16);
  EXPECT_LT(r4, 4.0 * r16);
}

INSTANTIATE_TEST_SUITE_P(Releases, CudaGroupedWeights,
                         ::testing::Values(Layout{Format::Mxfp4, Format::Bf16}, Layout{Format::Nvfp4, Format::Mxfp8},
                                           Layout{Format::Mxfp8, Format::Mxfp8}, Layout{Format::Nvfp4, Format::Nvfp4}),
                         [](const auto& info) { return layout_name(info.param); });

}  // namespace
