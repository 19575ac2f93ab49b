// Checkpoint loading: config.json getters, safetensors parsing and dtype conversion, FP8 block
// dequantization, sharded indexes, expert layouts, and the one-line errors for every broken input.
// All inputs are built byte by byte in a temporary directory.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "formats/checkpoint.h"
#include "formats/config.h"
#include "formats/safetensors.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Every FP8 E4M3 ("fn") code as fp32, generated once with torch 2.11:
//   torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
// clang-format off
const float kE4M3[256] = {
    0.0, 0.001953125, 0.00390625, 0.005859375, 0.0078125, 0.009765625, 0.01171875, 0.013671875,
    0.015625, 0.017578125, 0.01953125, 0.021484375, 0.0234375, 0.025390625, 0.02734375, 0.029296875,
    0.03125, 0.03515625, 0.0390625, 0.04296875, 0.046875, 0.05078125, 0.0546875, 0.05859375,
    0.0625, 0.0703125, 0.078125, 0.0859375, 0.09375, 0.1015625, 0.109375, 0.1171875,
    0.125, 0.140625, 0.15625, 0.171875, 0.1875, 0.203125, 0.21875, 0.234375,
    0.25, 0.28125, 0.3125, 0.34375, 0.375, 0.40625, 0.4375, 0.46875,
    0.5, 0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875, 0.9375,
    1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
    2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 3.75,
    4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5,
    8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    16.0, 18.0, 20.0, 22.0, 24.0, 26.0, 28.0, 30.0,
    32.0, 36.0, 40.0, 44.0, 48.0, 52.0, 56.0, 60.0,
    64.0, 72.0, 80.0, 88.0, 96.0, 104.0, 112.0, 120.0,
    128.0, 144.0, 160.0, 176.0, 192.0, 208.0, 224.0, 240.0,
    256.0, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0, kNaN,
    -0.0, -0.001953125, -0.00390625, -0.005859375, -0.0078125, -0.009765625, -0.01171875, -0.013671875,
    -0.015625, -0.017578125, -0.01953125, -0.021484375, -0.0234375, -0.025390625, -0.02734375, -0.029296875,
    -0.03125, -0.03515625, -0.0390625, -0.04296875, -0.046875, -0.05078125, -0.0546875, -0.05859375,
    -0.0625, -0.0703125, -0.078125, -0.0859375, -0.09375, -0.1015625, -0.109375, -0.1171875,
    -0.125, -0.140625, -0.15625, -0.171875, -0.1875, -0.203125, -0.21875, -0.234375,
    -0.25, -0.28125, -0.3125, -0.34375, -0.375, -0.40625, -0.4375, -0.46875,
    -0.5, -0.5625, -0.625, -0.6875, -0.75, -0.8125, -0.875, -0.9375,
    -1.0, -1.125, -1.25, -1.375, -1.5, -1.625, -1.75, -1.875,
    -2.0, -2.25, -2.5, -2.75, -3.0, -3.25, -3.5, -3.75,
    -4.0, -4.5, -5.0, -5.5, -6.0, -6.5, -7.0, -7.5,
    -8.0, -9.0, -10.0, -11.0, -12.0, -13.0, -14.0, -15.0,
    -16.0, -18.0, -20.0, -22.0, -24.0, -26.0, -28.0, -30.0,
    -32.0, -36.0, -40.0, -44.0, -48.0, -52.0, -56.0, -60.0,
    -64.0, -72.0, -80.0, -88.0, -96.0, -104.0, -112.0, -120.0,
    -128.0, -144.0, -160.0, -176.0, -192.0, -208.0, -224.0, -240.0,
    -256.0, -288.0, -320.0, -352.0, -384.0, -416.0, -448.0, kNaN,
};
// clang-format on

// Equal as fp32 bit patterns (so -0 differs from +0), or both NaN.
::testing::AssertionResult same_float(float actual, float expected) {
  if (std::isnan(expected) && std::isnan(actual)) return ::testing::AssertionSuccess();
  if (std::bit_cast<uint32_t>(actual) == std::bit_cast<uint32_t>(expected)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << actual << ", expected " << expected;
}

// ---- Building safetensors files by hand ----

template <typename T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::string le64(uint64_t value) { return bytes_of(std::vector<uint64_t>{value}); }

// A file with exactly this header text and data (for corrupt files).
std::string file_bytes(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

struct RawTensor {
  std::string name;
  std::string dtype;  // as written in the header: "F32", "BF16", ...
  Shape shape;
  std::string bytes;  // raw little-endian data
};

// A well-formed file: the data follows the header in the order given. Like the files transformers
// writes, the header is padded with spaces to a multiple of 8 bytes unless `align` is false.
std::string file_bytes(const std::vector<RawTensor>& tensors, bool align = true) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const RawTensor& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  if (align) text.append((8 - text.size() % 8) % 8, ' ');
  return file_bytes(text, data);
}

RawTensor f32(const std::string& name, Shape shape, const std::vector<float>& values) {
  return {name, "F32", std::move(shape), bytes_of(values)};
}

// A tensor whose elements are 0, 1, 2, ... (enough to tell rows apart).
RawTensor iota_f32(const std::string& name, Shape shape, float start = 0) {
  std::vector<float> values(shape_numel(shape));
  for (size_t i = 0; i < values.size(); ++i) values[i] = start + static_cast<float>(i);
  return f32(name, std::move(shape), values);
}

// Opens `bytes` as a safetensors file in `dir` and converts its only tensor to fp32.
Tensor convert_single(const TempDir& dir, const std::string& bytes) {
  auto file = SafetensorsFile::open(dir.write("t.safetensors", bytes));
  EXPECT_EQ(file->tensors().size(), 1u);
  return to_float32(file->tensors().begin()->second, file);
}

std::string open_error(const TempDir& dir, const std::string& bytes) {
  std::string path = dir.write("bad.safetensors", bytes);
  return error_message([&] { SafetensorsFile::open(path); });
}

// True when `p` lies inside a memory mapping of the file at `path` (read from /proc/self/maps).
bool inside_mapping_of(const void* p, const std::string& path) {
  const std::string wanted = std::filesystem::canonical(path).string();
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms, offset, device, inode, file;
    fields >> range >> perms >> offset >> device >> inode >> file;
    if (file != wanted) continue;
    uintptr_t begin = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    uintptr_t end = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
    uintptr_t address = reinterpret_cast<uintptr_t>(p);
    if (address >= begin && address < end) return true;
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// config.json

TEST(FormatsConfig, TypedGetters) {
  Config config(nlohmann::json::parse(R"({
      "hidden_size": 64, "layers_as_float": 4.0, "rms_norm_eps": 1e-6, "scale": 2, "tie": true,
      "act": "silu", "names": ["a", "b"], "sizes": [1, 2.0, 3], "nothing": null,
      "text_config": {"vocab_size": 10}})"),
                "config.json");
  EXPECT_EQ(config.get_int("hidden_size"), 64);
  EXPECT_EQ(config.get_int("layers_as_float"), 4);  // integral float accepted
  EXPECT_DOUBLE_EQ(config.get_float("rms_norm_eps"), 1e-6);
  EXPECT_DOUBLE_EQ(config.get_float("scale"), 2.0);  // ints are floats too
  EXPECT_TRUE(config.get_bool("tie"));
  EXPECT_EQ(config.get_string("act"), "silu");
  EXPECT_EQ(config.get_string_list("names"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(config.get_int_list("sizes"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(config.has("act"));
  EXPECT_FALSE(config.has("nothing"));  // null counts as absent
  EXPECT_FALSE(config.has("absent"));
  EXPECT_EQ(config.get_int("absent", 7), 7);
  EXPECT_EQ(config.get_int("nothing", 8), 8);
  EXPECT_EQ(config.get_int("hidden_size", 7), 64);
  EXPECT_DOUBLE_EQ(config.get_float("absent", 0.5), 0.5);
  EXPECT_FALSE(config.get_bool("absent", false));
  EXPECT_EQ(config.get_string("absent", "x"), "x");
  Config text = config.get_object("text_config");
  EXPECT_EQ(text.get_int("vocab_size"), 10);
  EXPECT_EQ(text.where(), "config.json: text_config");
}

TEST(FormatsConfig, ErrorsNameTheField) {
  Config config(nlohmann::json::parse(R"({
      "hidden_size": "abc", "half": 64.5, "flag": 1, "huge": 1e30, "names": ["a", 1], "act": "gelu",
      "heads": -3, "text_config": {"x": true}})"),
                "config.json");
  auto error = [&](auto f) { return error_message(f); };
  EXPECT_EQ(error([&] { config.get_int("missing"); }), "config.json: missing field 'missing'");
  EXPECT_EQ(error([&] { config.get_int("hidden_size"); }),
            "config.json: field 'hidden_size' must be an integer, found \"abc\"");
  EXPECT_TRUE(mentions(error([&] { config.get_int("half"); }), {"'half'", "integer", "64.5"}));
  EXPECT_TRUE(mentions(error([&] { config.get_int("huge"); }), {"'huge'", "integer"}));
  EXPECT_TRUE(
      mentions(error([&] { config.get_bool("flag", false); }), {"'flag'"}));  // present but wrong: not the default
  EXPECT_TRUE(mentions(error([&] { config.get_bool("flag"); }), {"'flag'", "true or false", "found 1"}));
  EXPECT_TRUE(mentions(error([&] { config.get_float("hidden_size"); }), {"'hidden_size'", "number"}));
  EXPECT_TRUE(mentions(error([&] { config.get_string("flag"); }), {"'flag'", "string"}));
  EXPECT_TRUE(mentions(error([&] { config.get_string_list("names"); }), {"'names'", "list of strings"}));
  EXPECT_TRUE(mentions(error([&] { config.get_int_list("names"); }), {"'names'", "list of integers"}));
  EXPECT_TRUE(mentions(error([&] { config.get_object("act"); }), {"'act'", "object"}));
  EXPECT_TRUE(
      mentions(error([&] { config.get_object("text_config").get_int("x"); }), {"config.json: text_config: field 'x'"}));
  EXPECT_EQ(error([&] { config.unsupported("hidden_act", "gelu", "silu"); }),
            "config.json: unsupported hidden_act 'gelu' (supported: silu)");
  EXPECT_EQ(error([&] { config.require(config.get_int("heads") > 0, "heads", "positive"); }),
            "config.json: field 'heads' must be positive, found -3");
  EXPECT_EQ(error([&] { config.require(true, "heads", "positive"); }), "");
}

TEST(FormatsConfig, LoadErrorsNameTheFile) {
  TempDir dir;
  EXPECT_TRUE(mentions(error_message([&] { Config::load(dir.file("config.json")); }), {"config.json", "cannot open"}));
  std::string bad = dir.write("config.json", "{\"hidden_size\": 4,");
  EXPECT_TRUE(mentions(error_message([&] { Config::load(bad); }), {"config.json", "not valid JSON"}));
  std::string list = dir.write("config.json", "[1, 2]");
  EXPECT_TRUE(mentions(error_message([&] { Config::load(list); }), {"config.json", "expected a JSON object"}));
  std::string good = dir.write("config.json", R"({"hidden_size": 4})");
  EXPECT_EQ(Config::load(good).get_int("hidden_size"), 4);
}

// The expectations follow transformers 5.17's modeling_rope_utils.py (convert_rope_params_to_dict,
// standardize_rope_params) step by step, one rule per config.
TEST(FormatsConfig, RopeParametersAsTransformersStandardizesThem) {
  auto rope = [](const char* text, double theta = 10000.0, int64_t max_positions = 4096) {
    return Config(nlohmann::json::parse(text), "config.json").rope_parameters(theta, max_positions);
  };
  // Nothing given: the family's default theta.
  EXPECT_EQ(rope("{}", 5e6), nlohmann::json::parse(R"({"rope_type": "default", "rope_theta": 5000000.0})"));
  // The top-level rope_theta and partial_rotary_factor move into the dict; values in it win.
  EXPECT_EQ(rope(R"({"rope_theta": 1e6, "partial_rotary_factor": 0.5})"),
            nlohmann::json::parse(R"({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})"));
  EXPECT_EQ(rope(R"({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})")["rope_theta"], 7.0);
  // rope_scaling (the legacy name) wins over rope_parameters unless it is empty; its `type` is rope_type.
  auto yarn = rope(R"({"rope_scaling": {"type": "yarn", "factor": 40}, "rope_parameters": {"rope_type": "default"},
                       "max_position_embeddings": 163840})", 10000.0, 163840);
  EXPECT_EQ(yarn["rope_type"], "yarn");
  EXPECT_EQ(yarn["factor"], 40);
  EXPECT_EQ(yarn["original_max_position_embeddings"], 163840);  // absent everywhere: max_position_embeddings
  EXPECT_EQ(rope(R"({"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 3.0}})")["rope_theta"], 3.0);
  // A scaled type keeps its own original_max_position_embeddings, but the top-level field wins over it
  // (Phi-3's exception in standardize_rope_params); an unscaled type gets none.
  EXPECT_EQ(rope(R"({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 4096}})")
                ["original_max_position_embeddings"], 4096);
  EXPECT_EQ(rope(R"({"original_max_position_embeddings": 8192,
                     "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 4096}})")
                ["original_max_position_embeddings"], 8192);
  EXPECT_FALSE(rope(R"({"original_max_position_embeddings": 8192})").contains("original_max_position_embeddings"));
  // Malformed fields are one-line errors naming the field.
  EXPECT_TRUE(mentions(error_message([&] { rope(R"({"rope_parameters": [1]})"); }), {"rope_parameters", "an object"}));
  EXPECT_TRUE(mentions(error_message([&] { rope(R"({"rope_scaling": {"type": 3}})"); }), {"rope_scaling.type' must be a string"}));
  EXPECT_TRUE(mentions(error_message([&] { rope(R"({"rope_theta": "x"})"); }), {"rope_theta"}));
}

// ---------------------------------------------------------------------------------------------------
// dtype conversions: exact, including subnormals, infinities and NaN

TEST(FormatsDType, Bf16IsTheTopHalfOfFp32) {
  TempDir dir;
  std::vector<uint16_t> codes = {0x3F80, 0xC020, 0x4049, 0x0001, 0x8001, 0x007F,
                                 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x8000};
  std::vector<float> expected = {1.0f,
                                 -2.5f,
                                 3.140625f,
                                 std::ldexp(1.0f, -133),  // smallest bf16 subnormal
                                 -std::ldexp(1.0f, -133),
                                 std::ldexp(127.0f, -133),  // largest subnormal
                                 std::ldexp(255.0f, 120),   // largest finite
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 kNaN,
                                 -0.0f};
  Tensor t = convert_single(dir, file_bytes({{"x", "BF16", {static_cast<int64_t>(codes.size())}, bytes_of(codes)}}));
  ASSERT_EQ(t.numel(), static_cast<int64_t>(codes.size()));
  for (size_t i = 0; i < codes.size(); ++i) EXPECT_TRUE(same_float(t.data()[i], expected[i])) << "code " << codes[i];
}

TEST(FormatsDType, F16EveryCodeMatchesTheCompilersHalf) {
#if defined(__clang__) && __clang_major__ < 15
  GTEST_SKIP() << "clang 14 (the sanitizer build's compiler) has no _Float16 on x86; the g++ build runs this test";
#else
  TempDir dir;
  std::vector<uint16_t> codes(65536);
  for (int i = 0; i < 65536; ++i) codes[i] = static_cast<uint16_t>(i);
  Tensor t = convert_single(dir, file_bytes({{"x", "F16", {65536}, bytes_of(codes)}}));
  for (int i = 0; i < 65536; ++i) {
    float expected = static_cast<float>(std::bit_cast<_Float16>(codes[i]));
    ASSERT_TRUE(same_float(t.data()[i], expected)) << "code " << i;
  }
  // A few by hand, so the test does not rest on the compiler alone.
  EXPECT_EQ(t.data()[0x0001], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(t.data()[0x03FF], std::ldexp(1023.0f, -24));
  EXPECT_EQ(t.data()[0x0400], std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(t.data()[0x3C00], 1.0f);
  EXPECT_EQ(t.data()[0x7BFF], 65504.0f);
  EXPECT_EQ(t.data()[0xC000], -2.0f);
  EXPECT_EQ(t.data()[0xFC00], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(t.data()[0x7E00]));
#endif
}

TEST(FormatsDType, E4M3EveryCodeMatchesTorch) {
  TempDir dir;
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>(i);
  Tensor t = convert_single(dir, file_bytes({{"x", "F8_E4M3", {256}, bytes_of(codes)}}));
  for (int i = 0; i < 256; ++i) EXPECT_TRUE(same_float(t.data()[i], kE4M3[i])) << "code " << i;
}

TEST(FormatsDType, E8M0IsAPowerOfTwo) {
  TempDir dir;
  std::vector<uint8_t> codes = {127, 0, 128, 120, 254, 255};
  Tensor t = convert_single(dir, file_bytes({{"s", "F8_E8M0", {6}, bytes_of(codes)}}));
  EXPECT_EQ(t.data()[0], 1.0f);
  EXPECT_EQ(t.data()[1], std::ldexp(1.0f, -127));
  EXPECT_EQ(t.data()[2], 2.0f);
  EXPECT_EQ(t.data()[3], 1.0f / 128);
  EXPECT_EQ(t.data()[4], std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(t.data()[5]));
}

TEST(FormatsDType, UnsupportedDtypeNamesTensorAndDtype) {
  TempDir dir;
  auto file = SafetensorsFile::open(
      dir.write("t.safetensors", file_bytes({{"ids", "I32", {2}, bytes_of(std::vector<int32_t>{1, 2})}})));
  const TensorInfo& info = file->tensors().at("ids");
  EXPECT_TRUE(mentions(error_message([&] { to_float32(info, file); }), {"'ids'", "I32", "t.safetensors"}));
}

// ---------------------------------------------------------------------------------------------------
// safetensors files

TEST(FormatsSafetensors, WriteReadRoundTrip) {
  TempDir dir;
  Tensor a = Tensor::empty({2, 3});
  for (int i = 0; i < 6; ++i) a.data()[i] = 0.5f * i - 1.0f;
  Tensor b = Tensor::empty({1});
  b.data()[0] = -7.25f;
  std::string path = dir.file("out.safetensors");
  write_safetensors(path, {{"alpha", a}, {"beta", b}, {"empty", Tensor::empty({0, 4})}});

  // The header is padded with spaces so that the data starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_length;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_length + 7 * sizeof(float));

  auto file = SafetensorsFile::open(path);
  ASSERT_EQ(file->tensors().size(), 3u);
  const TensorInfo& alpha = file->tensors().at("alpha");
  EXPECT_EQ(alpha.dtype, DType::F32);
  EXPECT_EQ(alpha.shape, (Shape{2, 3}));
  Tensor read = to_float32(alpha, file);
  EXPECT_EQ(read.data(), reinterpret_cast<const float*>(alpha.data));  // zero copy
  for (int i = 0; i < 6; ++i) EXPECT_EQ(read.data()[i], a.data()[i]);
  EXPECT_EQ(to_float32(file->tensors().at("beta"), file).data()[0], -7.25f);
  EXPECT_EQ(file->tensors().at("empty").shape, (Shape{0, 4}));

  EXPECT_TRUE(mentions(error_message([&] { write_safetensors(path, {{"a", a}, {"a", b}}); }), {"'a'"}));
}

// Each tensor is written in its own dtype, as releases store them (FP4 codes as U8 pairs).
TEST(FormatsSafetensors, WritesEachTensorsOwnDtype) {
  TempDir dir;
  const std::string path = dir.file("typed.safetensors");
  Tensor codes = Tensor::empty({2, 4}, ScalarType::E2M1x2), e8m0 = Tensor::empty({2, 1}, ScalarType::F8E8M0);
  Tensor e4m3 = Tensor::empty({3}, ScalarType::F8E4M3), bf16 = Tensor::empty({2}, ScalarType::BF16);
  for (int i = 0; i < 8; ++i) codes.as<uint8_t>()[i] = uint8_t(17 * i + 3);
  e8m0.as<uint8_t>()[0] = 120, e8m0.as<uint8_t>()[1] = 127;
  for (int i = 0; i < 3; ++i) e4m3.as<uint8_t>()[i] = uint8_t(0x38 + i);
  bf16.as<uint16_t>()[0] = 0x3F80, bf16.as<uint16_t>()[1] = 0xC000;  // 1, -2
  write_safetensors(path, {{"codes", codes}, {"e8m0", e8m0}, {"e4m3", e4m3}, {"bf16", bf16}});
  auto file = SafetensorsFile::open(path);
  const auto& t = file->tensors();
  EXPECT_EQ(t.at("codes").dtype, DType::U8);
  EXPECT_EQ(t.at("codes").shape, (Shape{2, 4}));
  EXPECT_EQ(std::memcmp(t.at("codes").data, codes.raw(), 8), 0);
  EXPECT_EQ(t.at("e8m0").dtype, DType::F8_E8M0);
  EXPECT_EQ(t.at("e8m0").data[1], 127);
  EXPECT_EQ(t.at("e4m3").dtype, DType::F8_E4M3);
  EXPECT_EQ(t.at("e4m3").data[2], 0x3A);
  EXPECT_EQ(t.at("bf16").dtype, DType::BF16);
  const Tensor widened = to_float32(t.at("bf16"), file);
  EXPECT_EQ(widened.data()[0], 1.0f);
  EXPECT_EQ(widened.data()[1], -2.0f);
}

TEST(FormatsSafetensors, MetadataIsIgnored) {
  TempDir dir;
  std::string header =
      R"({"__metadata__": {"format": "pt"}, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  auto file = SafetensorsFile::open(dir.write("m.safetensors", file_bytes(header, bytes_of(std::vector<float>{3.0f}))));
  ASSERT_EQ(file->tensors().size(), 1u);
  EXPECT_EQ(to_float32(file->tensors().at("x"), file).data()[0], 3.0f);
}

TEST(FormatsSafetensors, TruncatedFiles) {
  TempDir dir;
  EXPECT_TRUE(mentions(open_error(dir, ""), {"bad.safetensors", "truncated"}));
  EXPECT_TRUE(mentions(open_error(dir, std::string("\x05\0\0\0\0", 5)), {"bad.safetensors", "truncated"}));
  const std::string header = R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  EXPECT_TRUE(mentions(open_error(dir, le64(header.size() + 1) + header), {"truncated", "header length"}));
  EXPECT_TRUE(mentions(open_error(dir, le64(uint64_t{1} << 63) + header), {"truncated", "header length"}));
  EXPECT_TRUE(mentions(open_error(dir, le64(~uint64_t{0}) + header), {"truncated", "header length"}));
  // Data offsets beyond the end of the file.
  EXPECT_TRUE(mentions(open_error(dir, file_bytes(header, std::string(4, '\0'))), {"truncated", "'x'"}));
  EXPECT_TRUE(mentions(error_message([&] { SafetensorsFile::open(dir.file("absent.safetensors")); }),
                       {"absent.safetensors", "cannot open"}));
}

TEST(FormatsSafetensors, CorruptHeaders) {
  TempDir dir;
  const std::string four_floats(16, '\0');
  struct Case {
    std::string header;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"not json", {"corrupt", "not valid JSON"}},
      {"[1, 2]", {"corrupt", "not a JSON object"}},
      {R"({"x": 3})", {"corrupt", "'x'", "object"}},
      {R"({"x": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "dtype", "F33"}},
      {R"({"x": {"dtype": 4, "shape": [4], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "dtype"}},
      {R"({"x": {"dtype": "F32", "data_offsets": [0, 16]}})", {"corrupt", "'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "shape", "integers"}},
      {R"({"x": {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "shape", "integers"}},
      {R"({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [-1, 16]}})", {"corrupt", "'x'", "data_offsets"}},
      {R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}})", {"corrupt", "'x'", "data_offsets"}},
      {R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0]}})", {"corrupt", "'x'", "data_offsets"}},
      {R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1.5e1]}})", {"corrupt", "'x'", "data_offsets"}},
      // Offsets that disagree with shape x dtype size.
      {R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "16 bytes", "12"}},
      {R"({"x": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}})", {"corrupt", "'x'", "BF16"}},
      // Shapes whose element count or byte count overflows 64 bits.
      {R"({"x": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})",
       {"corrupt", "'x'", "too large"}},
      {R"({"x": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 16]}})",
       {"corrupt", "'x'", "too large"}},
      {R"({"x": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 16]}})",
       {"corrupt", "'x'", "shape"}},
      {R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 18446744073709551615]}})",
       {"corrupt", "'x'", "data_offsets"}},
      // Two tensors sharing bytes.
      {R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       {"corrupt", "'x'", "'y'", "overlap"}},
  };
  for (const Case& c : cases) {
    std::string message = open_error(dir, file_bytes(c.header, four_floats));
    EXPECT_FALSE(message.empty()) << c.header;
    for (const std::string& word : c.words) EXPECT_TRUE(mentions(message, {word, "bad.safetensors"})) << c.header;
  }
}

// ---------------------------------------------------------------------------------------------------
// Checkpoint folders

namespace {

const char* kPlainConfig = R"({"model_type": "test", "hidden_size": 4})";

// Writes config.json and model.safetensors into `dir`.
void write_checkpoint(const TempDir& dir, const std::vector<RawTensor>& tensors,
                      const std::string& config = kPlainConfig) {
  dir.write("config.json", config);
  dir.write("model.safetensors", file_bytes(tensors));
}

// A deterministic pseudo-random stream of E4M3 codes, skipping the two NaN codes.
std::vector<uint8_t> fp8_codes(int64_t n, uint32_t seed) {
  std::vector<uint8_t> codes(n);
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    uint8_t code = static_cast<uint8_t>(seed >> 24);
    codes[i] = (code & 0x7F) == 0x7F ? 0x3C : code;
  }
  return codes;
}

// The dequantized weight computed independently: table value times the scale of its block.
std::vector<float> dequantized(const std::vector<uint8_t>& codes, const std::vector<float>& scales, int64_t rows,
                               int64_t cols, int64_t block_rows, int64_t block_cols) {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  std::vector<float> out(codes.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[i * cols + j] = kE4M3[codes[i * cols + j]] * scales[(i / block_rows) * scale_cols + j / block_cols];
  return out;
}

}  // namespace

TEST(FormatsCheckpoint, TakesF32AsZeroCopyViewOfTheMapping) {
  TempDir dir;
  write_checkpoint(dir, {iota_f32("a.weight", {2, 3}), iota_f32("b.weight", {4}, 10)});
  auto checkpoint = Checkpoint::open(dir.path());
  EXPECT_EQ(checkpoint->config().get_int("hidden_size"), 4);
  EXPECT_TRUE(checkpoint->has("a.weight"));
  EXPECT_FALSE(checkpoint->has("c.weight"));
  Tensor a = checkpoint->take("a.weight", {2, 3});
  Tensor b = checkpoint->take("b.weight", {4});
  EXPECT_TRUE(inside_mapping_of(a.data(), dir.file("model.safetensors")));
  EXPECT_TRUE(inside_mapping_of(b.data(), dir.file("model.safetensors")));
  EXPECT_EQ(a.row(1)[2], 5.0f);
  EXPECT_EQ(b.data()[3], 13.0f);
  checkpoint->finish();
  // The view keeps the mapping alive after the checkpoint is gone.
  checkpoint.reset();
  EXPECT_EQ(a.row(1)[0], 3.0f);
}

TEST(FormatsCheckpoint, UnalignedF32IsCopied) {
  // The format does not promise aligned data; a float that does not start on a 4-byte boundary is
  // copied out rather than read in place.
  TempDir dir;
  std::string header = R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  header.append((8 - header.size() % 8) % 8 + 1, ' ');  // 1 byte past alignment
  dir.write("config.json", kPlainConfig);
  dir.write("model.safetensors", file_bytes(header, bytes_of(std::vector<float>{1.5f, -2.0f})));
  auto checkpoint = Checkpoint::open(dir.path());
  Tensor x = checkpoint->take("x", {2});
  EXPECT_FALSE(inside_mapping_of(x.data(), dir.file("model.safetensors")));
  EXPECT_EQ(x.data()[0], 1.5f);
  EXPECT_EQ(x.data()[1], -2.0f);
}

TEST(FormatsCheckpoint, MissingTensorAndWrongShape) {
  TempDir dir;
  write_checkpoint(dir, {iota_f32("w", {3, 2})});
  auto checkpoint = Checkpoint::open(dir.path());
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->take("v", {3, 2}); }), {"missing tensor 'v'"}));
  EXPECT_TRUE(mentions(error_message([&] {
                         checkpoint->take("w", {2, 3});
                       }),
                       {"tensor 'w': expected shape [2, 3], found [3, 2]", "model.safetensors"}));
}

TEST(FormatsCheckpoint, FolderErrors) {
  TempDir dir;
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"missing config.json"}));
  dir.write("config.json", "{not json");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"config.json", "not valid JSON"}));
  dir.write("config.json", kPlainConfig);
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"missing model.safetensors"}));
  dir.write("model.safetensors", "abc");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"model.safetensors", "truncated"}));
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.file("nowhere")); }), {"nowhere", "not a directory"}));
}

TEST(FormatsCheckpoint, ConvertsHalfPrecisionWeights) {
  TempDir dir;
  write_checkpoint(dir, {{"h", "F16", {2}, bytes_of(std::vector<uint16_t>{0x3C00, 0x0001})},
                         {"b", "BF16", {2}, bytes_of(std::vector<uint16_t>{0xC020, 0x0001})},
                         {"ids", "I64", {1}, bytes_of(std::vector<int64_t>{5})}});
  auto checkpoint = Checkpoint::open(dir.path());
  Tensor h = checkpoint->take("h", {2});
  EXPECT_EQ(h.data()[0], 1.0f);
  EXPECT_EQ(h.data()[1], std::ldexp(1.0f, -24));
  Tensor b = checkpoint->take("b", {2});
  EXPECT_EQ(b.data()[0], -2.5f);
  EXPECT_EQ(b.data()[1], std::ldexp(1.0f, -133));
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->take("ids", {1}); }), {"'ids'", "unsupported dtype I64"}));
}

TEST(FormatsCheckpoint, Fp8BlockScalesWithPartialEdgeBlocks) {
  // 130 x 260 with the default 128 x 128 blocks: a 2 x 3 scale grid whose last row and column of
  // blocks are partial (2 rows, 4 columns).
  const int64_t rows = 130, cols = 260;
  const std::vector<uint8_t> codes = fp8_codes(rows * cols, 1);
  const std::vector<float> scales = {0.5f, 3.0f, 0.1f, 1e-3f, 7.0f, 0.3f};
  TempDir dir;
  write_checkpoint(
      dir, {{"q.weight", "F8_E4M3", {rows, cols}, bytes_of(codes)}, f32("q.weight_scale_inv", {2, 3}, scales)},
      R"({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}})");
  auto checkpoint = Checkpoint::open(dir.path());
  Tensor w = checkpoint->take("q.weight", {rows, cols});
  const std::vector<float> expected = dequantized(codes, scales, rows, cols, 128, 128);
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(w.data()[i], expected[i]) << "element " << i;
  EXPECT_EQ(w.row(129)[259], kE4M3[codes[129 * cols + 259]] * 0.3f);  // the corner of the partial block
  checkpoint->finish();                                               // the scale was taken with its weight
}

TEST(FormatsCheckpoint, Fp8BlockSizeFromConfig) {
  // weight_block_size [2, 3] on a 3 x 4 weight: scale grid 2 x 2.
  const std::vector<uint8_t> codes = fp8_codes(12, 7);
  const std::vector<float> scales = {2.0f, 0.25f, -1.5f, 10.0f};
  TempDir dir;
  write_checkpoint(dir, {{"w", "F8_E4M3", {3, 4}, bytes_of(codes)}, f32("w_scale_inv", {2, 2}, scales)},
                   R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 3]}})");
  auto checkpoint = Checkpoint::open(dir.path());
  Tensor w = checkpoint->take("w", {3, 4});
  const std::vector<float> expected = dequantized(codes, scales, 3, 4, 2, 3);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(w.data()[i], expected[i]) << "element " << i;
}

TEST(FormatsCheckpoint, Fp8ScaleErrors) {
  TempDir dir;
  write_checkpoint(dir, {{"w", "F8_E4M3", {3, 4}, bytes_of(fp8_codes(12, 3))},
                         {"v", "F8_E4M3", {3, 4}, bytes_of(fp8_codes(12, 4))},
                         f32("v_scale_inv", {2, 1}, {1.0f, 2.0f})});
  auto checkpoint = Checkpoint::open(dir.path());
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->take("w", {3, 4}); }), {"'w'", "w_scale_inv", "missing"}));
  EXPECT_TRUE(mentions(error_message([&] {
                         checkpoint->take("v", {3, 4});
                       }),
                       {"tensor 'v_scale_inv': expected shape [1, 1], found [2, 1]"}));

  dir.write("config.json", R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"weight_block_size"}));
}

TEST(FormatsCheckpoint, ShardedIndex) {
  TempDir dir;
  dir.write("config.json", kPlainConfig);
  dir.write("model-00001-of-00002.safetensors", file_bytes({iota_f32("a", {2}), iota_f32("b", {3}, 5)}));
  dir.write("model-00002-of-00002.safetensors", file_bytes({iota_f32("c", {1, 2}, 20)}));
  dir.write("model.safetensors.index.json", R"({"metadata": {"total_size": 24}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
      "c": "model-00002-of-00002.safetensors"}})");
  auto checkpoint = Checkpoint::open(dir.path());
  EXPECT_EQ(checkpoint->take("b", {3}).data()[2], 7.0f);
  Tensor c = checkpoint->take("c", {1, 2});
  EXPECT_EQ(c.data()[1], 21.0f);
  EXPECT_TRUE(inside_mapping_of(c.data(), dir.file("model-00002-of-00002.safetensors")));
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->finish(); }),
                       {"unexpected tensor 'a'", "model-00001-of-00002.safetensors"}));
  checkpoint->take("a", {2});
  checkpoint->finish();
}

TEST(FormatsCheckpoint, ShardedIndexErrors) {
  TempDir dir;
  dir.write("config.json", kPlainConfig);
  dir.write("shard1.safetensors", file_bytes({iota_f32("a", {2})}));

  dir.write("model.safetensors.index.json",
            R"({"weight_map": {"a": "shard1.safetensors", "b": "shard2.safetensors"}})");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }),
                       {"model.safetensors.index.json", "shard2.safetensors", "'b'", "does not exist"}));

  // A shard name the filesystem cannot look up (longer than NAME_MAX) is missing too, not a crash.
  const std::string long_name(300, 'm');
  dir.write("model.safetensors.index.json",
            R"({"weight_map": {"a": "shard1.safetensors", "b": ")" + long_name + R"("}})");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"'b'", "does not exist"}));

  dir.write("model.safetensors.index.json",
            R"({"weight_map": {"a": "shard1.safetensors", "z": "shard1.safetensors"}})");
  EXPECT_TRUE(
      mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"'z'", "missing from shard1.safetensors"}));

  dir.write("model.safetensors.index.json", R"({"weight_map": )");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }),
                       {"model.safetensors.index.json", "not valid JSON"}));

  dir.write("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_TRUE(mentions(error_message([&] { Checkpoint::open(dir.path()); }), {"weight_map"}));
}

TEST(FormatsCheckpoint, FinishReportsTensorsNeverTaken) {
  TempDir dir;
  write_checkpoint(
      dir, {iota_f32("model.norm.weight", {2}), iota_f32("model.extra", {2}), iota_f32("model.mtp.0.weight", {2}),
            iota_f32("lm_head.weight", {2}), f32("lm_head.weight_scale_inv", {1}, {1.0f})});
  auto checkpoint = Checkpoint::open(dir.path());
  checkpoint->take("model.norm.weight", {2});
  checkpoint->take("lm_head.weight", {2});  // F32, so its scale is unused, yet belongs to a taken weight
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->finish({"model.mtp."}); }),
                       {"unexpected tensor 'model.extra' in", "model.safetensors"}));
  EXPECT_TRUE(mentions(error_message([&] { checkpoint->finish(); }), {"unexpected tensor", "1 more"}));
  checkpoint->take("model.extra", {2});
  checkpoint->finish({"model.mtp."});
}

// Tensors from memory in place of the folder's (the Python API's update_weights from host buffers): taken as
// the folder's would be, in any plain dtype where the folder's is plain; a name, shape or dtype that does not
// fit is refused naming the tensor.
TEST(FormatsCheckpoint, ReplacedTensorsAreTakenInsteadOfTheFolders) {
  TempDir dir;
  std::vector<uint8_t> fp8_codes = {0x38, 0x40};  // two e4m3 codes
  write_checkpoint(dir, {iota_f32("a.weight", {2, 2}), iota_f32("b.weight", {3}),
                         {"q.weight", "F8_E4M3", {1, 2}, std::string(fp8_codes.begin(), fp8_codes.end())},
                         f32("q.weight_scale_inv", {1, 1}, {1.0f})});
  auto memory = std::make_shared<std::vector<float>>(std::vector<float>{-1, -2, -3, -4});
  auto bf16 = std::make_shared<std::vector<uint16_t>>(std::vector<uint16_t>{0x3f80, 0x4000, 0x4040});  // 1, 2, 3
  auto info = [](const std::string& name, DType dtype, Shape shape, const void* data, size_t bytes) {
    TensorInfo t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data = static_cast<const uint8_t*>(data);
    t.nbytes = bytes;
    return t;
  };
  auto checkpoint = Checkpoint::open(dir.path());
  checkpoint->replace_tensors({{info("a.weight", DType::F32, {2, 2}, memory->data(), 16),
                                info("b.weight", DType::BF16, {3}, bf16->data(), 6)},
                               std::make_shared<std::pair<decltype(memory), decltype(bf16)>>(memory, bf16)});
  const Tensor a = checkpoint->take("a.weight", {2, 2}), b = checkpoint->take("b.weight", {3});
  EXPECT_EQ(std::vector<float>(a.data(), a.data() + 4), (std::vector<float>{-1, -2, -3, -4}));
  EXPECT_EQ(std::vector<float>(b.data(), b.data() + 3), (std::vector<float>{1, 2, 3}));
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  auto refused = [&](const TensorInfo& t) {
    return error_message([&] { Checkpoint::open(dir.path())->replace_tensors({{t}, memory}); });
  };
  EXPECT_TRUE(mentions(refused(info("c.weight", DType::F32, {1}, memory->data(), 4)), {"'c.weight'", "not a tensor"}));
  EXPECT_TRUE(mentions(refused(info("a.weight", DType::F32, {4}, memory->data(), 16)), {"'a.weight'", "[4]", "[2, 2]"}));
  EXPECT_TRUE(mentions(refused(info("q.weight", DType::BF16, {1, 2}, bf16->data(), 4)), {"'q.weight'", "F8_E4M3"}));
  EXPECT_TRUE(mentions(refused(info("a.weight", DType::F32, {2, 2}, memory->data(), 12)), {"'a.weight'", "12 bytes"}));
}

TEST(FormatsCheckpoint, ExpertLayoutsAgree) {
  const int64_t E = 2, I = 2, H = 3;
  // Per-expert layout, with expert 1 stored as FP8 with (partial, single) block scales.
  std::vector<RawTensor> per_expert;
  std::vector<float> gate_up(E * 2 * I * H), down(E * H * I);
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = cat("mlp.experts.", e, ".");
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const bool is_down = std::string(proj) == "down_proj";
      const Shape shape = is_down ? Shape{H, I} : Shape{I, H};
      std::vector<float> values(I * H);
      if (e == 0) {
        for (size_t k = 0; k < values.size(); ++k)
          values[k] = static_cast<float>(100 * (is_down ? 3 : proj[0] == 'g' ? 1 : 2) + k);
        per_expert.push_back(f32(p + proj + ".weight", shape, values));
      } else {
        std::vector<uint8_t> codes = fp8_codes(I * H, static_cast<uint32_t>(proj[0]));
        const float scale = 0.75f;
        for (size_t k = 0; k < values.size(); ++k) values[k] = kE4M3[codes[k]] * scale;
        per_expert.push_back({p + proj + ".weight", "F8_E4M3", shape, bytes_of(codes)});
        per_expert.push_back(f32(p + proj + ".weight_scale_inv", {1, 1}, {scale}));
      }
      // Where these values must land: gate rows first, then up rows, within expert e.
      float* target = is_down ? &down[e * H * I] : &gate_up[e * 2 * I * H + (proj[0] == 'u' ? I * H : 0)];
      std::copy(values.begin(), values.end(), target);
    }
  }
  TempDir split_dir, fused_dir;
  write_checkpoint(split_dir, per_expert);
  write_checkpoint(fused_dir, {f32("mlp.experts.gate_up_proj", {E, 2 * I, H}, gate_up),
                               f32("mlp.experts.down_proj", {E, H, I}, down)});

  for (const TempDir* dir : {&split_dir, &fused_dir}) {
    auto checkpoint = Checkpoint::open(dir->path());
    Checkpoint::Experts experts = checkpoint->take_experts("mlp.experts", E, I, H);
    ASSERT_EQ(experts.gate_up.shape(), (Shape{E, 2 * I, H}));
    ASSERT_EQ(experts.down.shape(), (Shape{E, H, I}));
    for (int64_t k = 0; k < E * 2 * I * H; ++k)
      EXPECT_EQ(experts.gate_up.data()[k], gate_up[k]) << dir->path() << " " << k;
    for (int64_t k = 0; k < E * H * I; ++k) EXPECT_EQ(experts.down.data()[k], down[k]) << dir->path() << " " << k;
    EXPECT_EQ(experts.gate_up.row(0)[I * H], 200.0f);  // expert 0's up_proj starts after its gate rows
    checkpoint->finish();

    EXPECT_TRUE(mentions(error_message([&] { checkpoint->take_experts("mlp.other", E, I, H); }),
                         {"missing experts 'mlp.other'"}));
    EXPECT_TRUE(
        mentions(error_message([&] { checkpoint->take_experts("mlp.experts", E, I + 1, H); }), {"expected shape"}));
  }
}

TEST(FormatsCheckpoint, FusedFp8ExpertsHaveScalesPerExpert) {
  // A fused [E, R, C] FP8 tensor carries one [ceil(R/128), ceil(C/128)] scale grid per expert.
  const int64_t E = 2, I = 1, H = 2;
  const std::vector<uint8_t> gate_up_codes = fp8_codes(E * 2 * I * H, 11), down_codes = fp8_codes(E * H * I, 12);
  TempDir dir;
  write_checkpoint(dir, {{"x.gate_up_proj", "F8_E4M3", {E, 2 * I, H}, bytes_of(gate_up_codes)},
                         f32("x.gate_up_proj_scale_inv", {E, 1, 1}, {2.0f, 0.5f}),
                         {"x.down_proj", "F8_E4M3", {E, H, I}, bytes_of(down_codes)},
                         f32("x.down_proj_scale_inv", {E, 1, 1}, {4.0f, 8.0f})});
  auto checkpoint = Checkpoint::open(dir.path());
  Checkpoint::Experts experts = checkpoint->take_experts("x", E, I, H);
  for (int64_t k = 0; k < E * 2 * I * H; ++k)
    EXPECT_EQ(experts.gate_up.data()[k], kE4M3[gate_up_codes[k]] * (k < 2 * I * H ? 2.0f : 0.5f));
  for (int64_t k = 0; k < E * H * I; ++k)
    EXPECT_EQ(experts.down.data()[k], kE4M3[down_codes[k]] * (k < H * I ? 4.0f : 8.0f));
  checkpoint->finish();
}
