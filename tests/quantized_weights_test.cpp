// Quantized weights as releases ship them (formats/quantization.h): each fixture written by
// tools/make_quantized_fixtures.py holds a tiny checkpoint in a release's layout and its dequantized twin
// (twin/: the same model, every quantized weight as the Python encoder's float32 dequantization).
//   minimax_m3_nvfp4:   ModelOpt NVFP4 routed experts, MXFP8 everywhere else, MIXED_PRECISION in
//                       hf_quant_config.json (MiniMax-M3.1-Flash's layout)
//   deepseek_v32_mxfp4: compressed-tensors MXFP4 routed experts (Kimi K3's format)
// Every weight must dequantize to the twin's value bit for bit, and the two checkpoints give the same logits.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "formats/checkpoint.h"
#include "formats/quantization.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace fs = std::filesystem;

namespace {

fs::path fixture(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name; }

class QuantizedFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedFixture, EveryWeightDequantizesToTheTwinBitForBit) {
  auto quantized = Checkpoint::open(fixture(GetParam()).string());
  auto twin_file = SafetensorsFile::open((fixture(GetParam()) / "twin/model.safetensors").string());
  int64_t compared = 0, quantized_weights = 0;
  for (const auto& [name, info] : twin_file->tensors()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(quantized->has(name));
    const Tensor got = quantized->take(name, info.shape);
    const Tensor want = to_float32(info, nullptr);
    ASSERT_EQ(got.numel(), want.numel());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * size_t(got.numel())), 0);
    quantized_weights += info.dtype == DType::F32 && info.shape.size() == 2;
    ++compared;
  }
  EXPECT_GT(quantized_weights, 10);
  EXPECT_GT(compared, 20);
  quantized->finish();  // every scale, second-level scale and input scale went with its weight
}

// On the CPU the projections stay as stored (kernels/cpu/stored_weights.h widens one per product), so a
// model needs its checkpoint's size in memory, not 2-4x it: take_linear hands out bf16 views, or the codes
// with their scales (MXFP8 in minimax_m3_nvfp4), and their exact widening is the twin's value bit for bit.
TEST_P(QuantizedFixture, TheCpuKeepsProjectionsAsStored) {
  auto quantized = Checkpoint::open(fixture(GetParam()).string());
  auto twin_file = SafetensorsFile::open((fixture(GetParam()) / "twin/model.safetensors").string());
  int64_t kept = 0, codes = 0;
  for (const auto& [name, info] : twin_file->tensors()) {
    if (info.shape.size() != 2 || name.find(".experts.") != std::string::npos) continue;
    SCOPED_TRACE(name);
    const Tensor got = quantized->take_linear(name, info.shape);
    const Tensor want = to_float32(info, nullptr);
    if (got.type() == ScalarType::F32) continue;  // stored in fp32, or in a shape the codes do not cover
    const Tensor widened = ops::dequantize_weight(got);
    ASSERT_EQ(widened.shape(), want.shape());
    EXPECT_EQ(std::memcmp(widened.data(), want.data(), sizeof(float) * size_t(want.numel())), 0);
    ++kept;
    codes += got.type() == ScalarType::F8E4M3 || got.type() == ScalarType::E2M1x2;
  }
  EXPECT_GT(kept, 3);
  if (GetParam() == "minimax_m3_nvfp4") EXPECT_GT(codes, 3);  // its MXFP8 projections
}

TEST_P(QuantizedFixture, LogitsEqualTheDequantizedTwins) {
  const std::unique_ptr<Model> quantized = load_model(fixture(GetParam()).string());
  const std::unique_ptr<Model> twin = load_model((fixture(GetParam()) / "twin").string());
  const std::vector<int32_t> tokens = {3, 17, 42, 9, 100, 7, 7, 64, 200, 5, 11, 250, 33, 2, 90, 18, 77, 1, 4, 60};
  SequenceState a = sparrow::testing::new_sequence(*quantized), b = sparrow::testing::new_sequence(*twin);
  const Tensor got = sparrow::testing::run_step(*quantized, make_batch({{&a, tokens}}));
  const Tensor want = sparrow::testing::run_step(*twin, make_batch({{&b, tokens}}));
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * size_t(got.numel())), 0);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizedFixture, ::testing::Values("minimax_m3_nvfp4", "deepseek_v32_mxfp4"));

// A small checkpoint folder holding `tensors` (name, dtype, shape, raw bytes) and the given config files.
struct Raw {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
};

template <typename T>
std::string bytes_of(std::initializer_list<T> values) {
  std::vector<T> v(values);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

void write_folder(const TempDir& dir, const std::vector<Raw>& tensors, const std::string& config) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const Raw& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  const std::string text = header.dump();
  const uint64_t n = text.size();
  std::string file(reinterpret_cast<const char*>(&n), 8);
  dir.write("model.safetensors", file + text + data);
  dir.write("config.json", config);
}

const char* kMxfp8Config = R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}})";

}  // namespace

// Hand-computed values: E4M3 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0; E8M0 127 + k = 2^k; E2M1 codes 1 = 0.5,
// 7 = 6, 0xA = -1; NVFP4's w = e2m1 * (e4m3(scale) * scale_2).
// bf16 checkpoints (the bundled models) stay bf16 views of the mapped file on the CPU: the projections
// and the experts (stacked) hold 2 bytes a weight, widened exactly per product; a bf16 tensor's elements
// are not fp32 and Tensor::data() says so rather than reinterpret them.
TEST(QuantizedWeights, TheCpuKeepsBf16WeightsAsStored) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "models/deepseek_v32";
  auto stored = Checkpoint::open(dir.string());
  auto widened = Checkpoint::open(dir.string());
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  const Tensor b = stored->take_linear(name, {192, 4 * 32});
  ASSERT_EQ(b.type(), ScalarType::BF16);
  EXPECT_THROW(b.data(), Error);
  const Tensor f = widened->take(name, {192, 4 * 32});
  const Tensor w = ops::dequantize_weight(b);
  EXPECT_EQ(std::memcmp(w.data(), f.data(), sizeof(float) * size_t(f.numel())), 0);
  const Checkpoint::Experts experts = stored->take_experts("model.layers.1.mlp.experts", 8, 32, 192);
  EXPECT_EQ(experts.gate_up.type(), ScalarType::BF16);
  EXPECT_EQ(experts.down.type(), ScalarType::BF16);
}

TEST(QuantizedWeights, HandComputedValues) {
  {
    TempDir dir;
    std::string codes(64, char(0x38));
    codes[0] = char(0x40), codes[33] = char(0xB8);
    write_folder(
        dir,
        {{"w.weight", "F8_E4M3", {1, 64}, codes}, {"w.weight_scale_inv", "U8", {1, 2}, bytes_of<uint8_t>({130, 124})}},
        kMxfp8Config);
    auto c = Checkpoint::open(dir.path());
    const Tensor w = c->take("w.weight", {1, 64});
    EXPECT_EQ(w.data()[0], 16.0f);      // 2 * 2^3
    EXPECT_EQ(w.data()[1], 8.0f);       // 1 * 2^3
    EXPECT_EQ(w.data()[33], -0.125f);   // -1 * 2^-3
    c->finish();
  }
  {
    TempDir dir;
    // 32 values: bytes 0x71 = (element 0: code 1 = 0.5, element 1: code 7 = 6), then 0xA0 (0, -1).
    std::string packed(16, char(0));
    packed[0] = char(0x71), packed[15] = char(0xA0);
    const std::string config = R"({"quantization_config": {"quant_method": "compressed-tensors", "config_groups":
        {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}}})";
    write_folder(
        dir, {{"e.weight_packed", "U8", {1, 16}, packed}, {"e.weight_scale", "U8", {1, 1}, bytes_of<uint8_t>({128})}},
        config);
    auto c = Checkpoint::open(dir.path());
    ASSERT_TRUE(c->has("e.weight"));
    const Tensor w = c->take("e.weight", {1, 32});
    EXPECT_EQ(w.data()[0], 1.0f);
    EXPECT_EQ(w.data()[1], 12.0f);
    EXPECT_EQ(w.data()[31], -2.0f);
    EXPECT_EQ(w.data()[30], 0.0f);
    c->finish();
  }
  {
    TempDir dir;
    std::string packed(8, char(0));
    packed[0] = char(0x27);  // element 0: code 7 = 6; element 1: code 2 = 1
    const std::string config =
        R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}})";
    write_folder(dir,
                 {{"x.weight", "U8", {1, 8}, packed},
                  {"x.weight_scale", "F8_E4M3", {1, 1}, bytes_of<uint8_t>({0x40})},
                  {"x.weight_scale_2", "F32", {}, bytes_of<float>({0.1f})},
                  {"x.input_scale", "F32", {1}, bytes_of<float>({1.0f})}},
                 config);
    auto c = Checkpoint::open(dir.path());
    const Tensor w = c->take("x.weight", {1, 16});
    EXPECT_EQ(w.data()[0], 6.0f * (2.0f * 0.1f));
    EXPECT_EQ(w.data()[1], 1.0f * (2.0f * 0.1f));
    c->finish();
  }
}

TEST(QuantizedWeights, ConfigsAreReadOnceAndCheckedAgainstTheTensors) {
  TempDir dir;
  dir.write("config.json", R"({"quantization_config": {"quant_method": "awq", "bits": 4}})");
  EXPECT_TRUE(mentions(error_message([&] { read_quantization(dir.path(), Config::load(dir.file("config.json"))); }),
                       {"quant_method", "'awq'", "fp8, modelopt, compressed-tensors"}));
  dir.write("config.json",
            R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}})");
  EXPECT_TRUE(mentions(error_message([&] { read_quantization(dir.path(), Config::load(dir.file("config.json"))); }),
                       {"group_size 16"}));
  dir.write("config.json", R"({"quantization_config": {"quant_method": "compressed-tensors", "config_groups":
      {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}})");
  EXPECT_TRUE(mentions(error_message([&] { read_quantization(dir.path(), Config::load(dir.file("config.json"))); }),
                       {"num_bits", "'int'", "MXFP4"}));

  // hf_quant_config.json wins; MIXED_PRECISION declares the union of its layers' formats.
  dir.write("config.json", "{}");
  dir.write("hf_quant_config.json", R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
      "a": {"quant_algo": "NVFP4", "group_size": 16}, "b": {"quant_algo": "FP8_PB_WO", "group_size": 128}}}})");
  const QuantizationConfig q = read_quantization(dir.path(), Config::load(dir.file("config.json")));
  EXPECT_TRUE(q.declares(WeightFormat::Nvfp4) && q.declares(WeightFormat::Fp8Block));
  EXPECT_FALSE(q.declares(WeightFormat::Mxfp8) || q.declares(WeightFormat::Mxfp4));
  EXPECT_EQ(q.describe(), "modelopt (hf_quant_config.json): FP8 block-scaled, NVFP4");

  // How the GPU stores what a config declares when no tensor says (dummy weights, the roofline): the
  // releases' layouts.
  auto storage = [&](const char* hf_quant_config) {
    dir.write("hf_quant_config.json", hf_quant_config);
    const QuantizationConfig r = read_quantization(dir.path(), Config::load(dir.file("config.json")));
    return std::pair{r.expert_packed(), r.linear_packed()};
  };
  // MiniMax-M3.1-Flash: NVFP4 experts, MXFP8 projections.
  EXPECT_EQ(storage(R"({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
      "e": {"quant_algo": "NVFP4"}, "p": {"quant_algo": "MXFP8"}}}})"),
            std::pair(WeightFormat::Nvfp4, WeightFormat::Mxfp8));
  // MiniMax-M3: MXFP8 everywhere; an NVFP4-only recipe: the experts only.
  EXPECT_EQ(storage(R"({"quantization": {"quant_algo": "MXFP8"}})"),
            std::pair(WeightFormat::Mxfp8, WeightFormat::Mxfp8));
  EXPECT_EQ(storage(R"({"quantization": {"quant_algo": "NVFP4"}})"),
            std::pair(WeightFormat::Nvfp4, WeightFormat::Dense));
  EXPECT_EQ(storage(R"({"quantization": {"quant_algo": "FP8_PB_WO"}})"),
            std::pair(WeightFormat::Dense, WeightFormat::Dense));
}

// MXFP8 codes carry E8M0 scales per 32 values as FP4 codes do (Tensor::with_group_scales); a scale grid of
// another shape or type is refused where it is attached.
TEST(QuantizedWeights, GroupScalesAreCheckedWhereAttached) {
  const Tensor mx8 = Tensor::empty({4, 64}, ScalarType::F8E4M3), fp4 = Tensor::empty({4, 32}, ScalarType::E2M1x2);
  const Tensor e8m0 = Tensor::empty({4, 2}, ScalarType::F8E8M0), e4m3 = Tensor::empty({4, 4}, ScalarType::F8E4M3);
  const Tensor scaled = mx8.with_group_scales(e8m0, Tensor());
  EXPECT_EQ(scaled.block_scales().type(), ScalarType::F8E8M0);
  EXPECT_FALSE(scaled.global_scales().defined());
  EXPECT_NO_THROW(fp4.with_group_scales(e8m0, Tensor()));                        // MXFP4
  EXPECT_NO_THROW(fp4.with_group_scales(e4m3, Tensor::empty({1})));             // NVFP4
  EXPECT_THROW(mx8.with_group_scales(e4m3, Tensor::empty({1})), Error);         // MXFP8 has E8M0 scales only
  EXPECT_THROW(mx8.with_group_scales(Tensor::empty({4, 4}, ScalarType::F8E8M0), Tensor()), Error);  // per 16
  EXPECT_THROW(fp4.with_group_scales(e4m3, Tensor()), Error);                   // NVFP4 without its global scale
  EXPECT_THROW(Tensor::empty({4, 64}, ScalarType::BF16).with_group_scales(e8m0, Tensor()), Error);
}

TEST(QuantizedWeights, BadTensorsAreOneLineErrors) {
  TempDir dir;
  // MXFP8 codes stored without a declaration.
  write_folder(dir, {{"w.weight", "F8_E4M3", {1, 32}, std::string(32, char(0x38))},
                     {"w.weight_scale_inv", "U8", {1, 1}, bytes_of<uint8_t>({127})}},
               "{}");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path())->take("w.weight", {1, 32}); }),
                       {"'w.weight' is stored as MXFP8", "does not declare", "no quantization"}));
  // A scale grid of the wrong shape.
  write_folder(dir, {{"w.weight", "F8_E4M3", {1, 64}, std::string(64, char(0x38))},
                     {"w.weight_scale_inv", "U8", {1, 1}, bytes_of<uint8_t>({127})}},
               kMxfp8Config);
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path())->take("w.weight", {1, 64}); }),
                       {"'w.weight_scale_inv': expected shape [1, 2]", "one scale per 32 values"}));
  // NVFP4 without its second-level scale; packed data of the wrong width.
  const std::string nvfp4 = R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})";
  write_folder(dir, {{"x.weight", "U8", {1, 8}, std::string(8, char(0))},
                     {"x.weight_scale", "F8_E4M3", {1, 1}, bytes_of<uint8_t>({0x38})}},
               nvfp4);
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path())->take("x.weight", {1, 16}); }),
                       {"'x.weight_scale_2'", "missing"}));
  write_folder(dir, {{"x.weight", "U8", {1, 8}, std::string(8, char(0))},
                     {"x.weight_scale", "F8_E4M3", {1, 1}, bytes_of<uint8_t>({0x38})},
                     {"x.weight_scale_2", "F32", {1}, bytes_of<float>({1.0f})}},
               nvfp4);
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path())->take("x.weight", {1, 32}); }),
                       {"'x.weight' (NVFP4): expected packed shape [1, 16]", "found [1, 8]"}));
}
