// Image decoding, resizing and the two families' processors against what the Python side makes of the same
// files (tests/data/images, written by tools/make_image_fixtures.py): PIL's decoding, torchvision's resize and
// transformers 5.17's MiniMax-M3-VL processor; PIL's resize and vLLM's Kimi K3 preprocessing (a reference
// written from vLLM's code). Byte for byte and bit for bit; and bad images refused with one-line errors.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/kimi_k3_processor.h"
#include "vision/minimax_m3_vl_processor.h"
#include "vision/resize.h"

namespace sparrow::vision {
namespace {

using testing::error_message;
using testing::mentions;
using testing::slurp;

const std::filesystem::path kImages = std::filesystem::path(SPARROW_SOURCE_DIR) / "tests" / "data" / "images";

struct Expected {
  std::shared_ptr<SafetensorsFile> file = SafetensorsFile::open((kImages / "expected.safetensors").string());
  nlohmann::json cases = nlohmann::json::parse(slurp(kImages / "cases.json"));
  const TensorInfo* find(const std::string& key) const {
    auto it = file->tensors().find(key);
    return it == file->tensors().end() ? nullptr : &it->second;
  }
};

const Expected& expected() {
  static const Expected e;
  return e;
}

// Where `image` differs from the uint8 [h, w, 3] tensor `key` ("" when it matches exactly).
std::string differences(const Image& image, const std::string& key) {
  const TensorInfo* want = expected().find(key);
  if (!want) return "no tensor " + key;
  if (want->dtype != DType::U8 || want->shape != Shape{image.height, image.width, 3})
    return key + ": " + std::to_string(image.width) + "x" + std::to_string(image.height) +
           " against the expected shape";
  int64_t wrong = 0, first = -1;
  for (size_t i = 0; i < image.rgb.size(); ++i)
    if (image.rgb[i] != want->data[i]) {
      if (first < 0) first = int64_t(i);
      ++wrong;
    }
  if (!wrong) return "";
  return key + ": " + std::to_string(wrong) + " of " + std::to_string(image.rgb.size()) + " bytes differ, first at " +
         std::to_string(first) + " (" + std::to_string(image.rgb[first]) + " against " +
         std::to_string(want->data[first]) + ")";
}

// `got` equals the fp32 tensor `key` bit for bit (the same float32 operations in the same order); nothing to
// check when the fixture stores no such tensor (pixel values are stored for two images).
void expect_same_floats(const Tensor& got, const std::string& key) {
  const TensorInfo* want = expected().find(key);
  if (!want) return;
  ASSERT_EQ(want->shape, got.shape()) << key;
  ASSERT_EQ(want->dtype, DType::F32) << key;
  int64_t wrong = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    float w;
    std::memcpy(&w, want->data + i * 4, 4);
    wrong += got.data()[i] != w;
  }
  EXPECT_EQ(wrong, 0) << key << ": of " << got.numel();
}

Image expected_image(const std::string& key) {
  const TensorInfo& t = *expected().find(key);
  Image image{t.shape[0], t.shape[1], std::vector<uint8_t>(t.data, t.data + t.nbytes)};
  return image;
}

class EveryImage : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryImage, DecodesAsPil) {
  const std::string name = GetParam();
  EXPECT_EQ(differences(decode_image(slurp(kImages / name)), name + ".rgb"), "");
}

// From PIL's pixels, so that a decoding difference does not hide or cause a resizing one.
TEST_P(EveryImage, ResizesAsTorchvision) {
  const std::string name = GetParam();
  const Image rgb = expected_image(name + ".rgb");
  const auto& settings = expected().cases.at(name);
  const auto [height, width] =
      smart_resize(rgb.height, rgb.width, 28, settings.at("min_pixels"), settings.at("max_pixels"));
  EXPECT_EQ(differences(resize_bicubic(rgb, height, width, ResizeKernel::Torch), name + ".resized"), "");
}

TEST_P(EveryImage, PatchesAsTheMiniMaxM3VlProcessor) {
  const std::string name = GetParam();
  const auto& settings = expected().cases.at(name);
  MiniMaxM3VlProcessorConfig config;
  config.rule = MiniMaxResizeRule::Transformers;  // what the fixtures were made with
  config.min_pixels = settings.at("min_pixels");
  config.max_pixels = settings.at("max_pixels");
  const MiniMaxM3VlImagePatches patches = minimax_m3_vl_patches(expected_image(name + ".rgb"), config);
  const TensorInfo& grid = *expected().find(name + ".grid");
  const auto* thw = reinterpret_cast<const int64_t*>(grid.data);
  EXPECT_EQ(patches.grid_t, thw[0]);
  EXPECT_EQ(patches.grid_h, thw[1]);
  EXPECT_EQ(patches.grid_w, thw[2]);
  EXPECT_EQ(patches.tokens(config.merge_size), thw[0] * thw[1] * thw[2] / 4);
  expect_same_floats(patches.pixel_values, name + ".pixel_values");
}

TEST_P(EveryImage, PatchesAsVllmsKimiK3Preprocessing) {
  const std::string name = GetParam();
  const auto& settings = expected().cases.at(name).at("kimi");
  KimiK3ProcessorConfig config;
  config.in_patch_limit = settings.at("in_patch_limit");
  config.patch_limit_on_one_side = settings.at("patch_limit_on_one_side");
  const Image rgb = expected_image(name + ".rgb");
  const NavitSize size = navit_resize(rgb.height, rgb.width, config);
  EXPECT_EQ(differences(resize_bicubic(rgb, size.new_height, size.new_width, ResizeKernel::Pillow),
                        name + ".kimi_resized"), "");
  const KimiK3ImagePatches patches = kimi_k3_patches(rgb, config);
  const auto* grid = reinterpret_cast<const int64_t*>(expected().find(name + ".kimi_grid")->data);
  EXPECT_EQ(patches.grid_h, grid[0]);
  EXPECT_EQ(patches.grid_w, grid[1]);
  EXPECT_EQ(patches.num_tokens, grid[2]);
  expect_same_floats(patches.pixel_values, name + ".kimi_pixel_values");
}

// The images of cases.json, read when the tests register: without the folder (a partial copy of the tree),
// none, so that the rest of the binary still runs; ImageFixtures.ArePresent then fails saying what is missing.
std::vector<std::string> image_names() {
  std::vector<std::string> names;
  std::error_code missing;
  if (!std::filesystem::exists(kImages / "cases.json", missing)) return names;
  for (const auto& [name, settings] : expected().cases.items()) names.push_back(name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Images, EveryImage, ::testing::ValuesIn(image_names()), [](const auto& info) {
  std::string id = info.param;
  for (char& c : id)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return id;
});

// vLLM 0.33.0's smart_resize (transformers_utils/processors/minimax_m3.py), worked by hand.
TEST(SmartResize, VllmsVariantAndTheLongSideRule) {
  // The area path: each side at least the factor before the area checks (transformers rounds 13 / 28 to 0,
  // then scales the whole image up to min_pixels: 28 x 812).
  EXPECT_EQ(smart_resize_vllm(13, 2600, 28, 451584), (std::pair<int64_t, int64_t>{28, 2604}));
  EXPECT_EQ(smart_resize(13, 2600, 28, 3136, 451584), (std::pair<int64_t, int64_t>{28, 812}));
  EXPECT_EQ(smart_resize_vllm(61, 97, 28, 451584), (std::pair<int64_t, int64_t>{56, 84}));
  EXPECT_EQ(smart_resize_vllm(30, 40, 28, 451584), (std::pair<int64_t, int64_t>{56, 84}));  // 28 x 28 up past 3136
  // The long-side rule: a long side over the limit shrinks to it; else a short side under 112 grows to 112.
  EXPECT_EQ(smart_resize_vllm(2000, 3000, 28, 451584, 1344), (std::pair<int64_t, int64_t>{896, 1344}));
  EXPECT_EQ(smart_resize_vllm(50, 80, 28, 451584, 1344), (std::pair<int64_t, int64_t>{112, 168}));  // 179.2 -> 168
  EXPECT_EQ(smart_resize_vllm(700, 500, 28, 451584, 1344), (std::pair<int64_t, int64_t>{700, 504}));  // as is
  EXPECT_TRUE(mentions(error_message([] { smart_resize_vllm(5000, 5000, 28, 451584, 10000); }), {"3584^2"}));
  EXPECT_TRUE(mentions(error_message([] { smart_resize_vllm(10, 2500, 28, 451584); }), {"aspect ratio", "200"}));
}

TEST(MiniMaxProcessorConfig, ReadsPreprocessorConfigJson) {
  testing::TempDir dir;
  EXPECT_EQ(MiniMaxM3VlProcessorConfig::from_folder(dir.path()).max_pixels, 451584);  // no file: the defaults
  dir.write("preprocessor_config.json",
            R"({"size": {"shortest_edge": 784, "longest_edge": 6272}, "max_long_side_pixel": 1344, "patch_size": 14,
                "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "MiniMaxM3VLImageProcessor"})");
  const MiniMaxM3VlProcessorConfig config = MiniMaxM3VlProcessorConfig::from_folder(dir.path());
  EXPECT_EQ(config.min_pixels, 784);
  EXPECT_EQ(config.max_pixels, 6272);
  EXPECT_EQ(config.max_long_side_pixel, 1344);
  EXPECT_EQ(config.mean[1], 0.5f);
  EXPECT_EQ(config.std[0], 0.26862954f);
  EXPECT_EQ(config.rule, MiniMaxResizeRule::Vllm);
  dir.write("preprocessor_config.json", R"({"max_pixels": "many"})");
  EXPECT_TRUE(mentions(error_message([&] { MiniMaxM3VlProcessorConfig::from_folder(dir.path()); }),
                       {"preprocessor_config.json", "max_pixels", "positive integer"}));
  dir.write("preprocessor_config.json", R"({"image_std": [1, 2]})");
  EXPECT_TRUE(mentions(error_message([&] { MiniMaxM3VlProcessorConfig::from_folder(dir.path()); }),
                       {"image_std", "three numbers"}));
  dir.write("preprocessor_config.json", "[1, 2");
  EXPECT_TRUE(mentions(error_message([&] { MiniMaxM3VlProcessorConfig::from_folder(dir.path()); }),
                       {"not a JSON object"}));
}

TEST(KimiProcessorConfig, ReadsMediaProcCfg) {
  testing::TempDir dir;
  EXPECT_EQ(KimiK3ProcessorConfig::from_folder(dir.path()).in_patch_limit, 16384);  // no file: the defaults
  dir.write("preprocessor_config.json",
            R"({"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 4096,
                "patch_limit_on_one_side": 256, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 0.5],
                "fixed_output_tokens": null, "temporal_merge_kernel_size": 4}})");
  const KimiK3ProcessorConfig config = KimiK3ProcessorConfig::from_folder(dir.path());
  EXPECT_EQ(config.merge_kernel_size, 2);
  EXPECT_EQ(config.in_patch_limit, 4096);
  EXPECT_EQ(config.patch_limit_on_one_side, 256);
  EXPECT_EQ(config.std[0], 0.25f);
  dir.write("preprocessor_config.json", R"({"media_proc_cfg": {"fixed_output_tokens": 256}})");
  EXPECT_TRUE(mentions(error_message([&] { KimiK3ProcessorConfig::from_folder(dir.path()); }),
                       {"media_proc_cfg", "fixed_output_tokens"}));
  dir.write("preprocessor_config.json", R"({"media_proc_cfg": {"merge_kernel_size": [0]}})");
  EXPECT_TRUE(mentions(error_message([&] { KimiK3ProcessorConfig::from_folder(dir.path()); }),
                       {"merge_kernel_size", "positive integer"}));
  dir.write("preprocessor_config.json", R"({"media_proc_cfg": 3})");
  EXPECT_TRUE(mentions(error_message([&] { KimiK3ProcessorConfig::from_folder(dir.path()); }),
                       {"media_proc_cfg must be an object"}));
}

TEST(ImageFixtures, ArePresent) {
  for (const char* file : {"cases.json", "expected.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(kImages / file)) << (kImages / file).string() << " is missing";
  EXPECT_FALSE(image_names().empty());
}

TEST(SmartResize, FollowsPythonsRoundingAndTheLimits) {
  // 70 / 28 = 2.5: Python's round is half-to-even, so 56, not 84.
  EXPECT_EQ(smart_resize(70, 280, 28, 3136, 451584), (std::pair<int64_t, int64_t>{56, 280}));
  EXPECT_EQ(smart_resize(126, 280, 28, 3136, 451584), (std::pair<int64_t, int64_t>{112, 280}));  // 4.5 -> 4
  // Over max_pixels: scaled down to fit, each side at least one factor.
  const auto [h, w] = smart_resize(3000, 4000, 28, 3136, 451584);
  EXPECT_LE(h * w, 451584);
  EXPECT_EQ(h % 28, 0);
  EXPECT_EQ(w % 28, 0);
  EXPECT_TRUE(mentions(error_message([] { smart_resize(10, 2500, 28, 3136, 451584); }), {"aspect ratio", "200"}));
}

TEST(DecodeImage, RefusesWhatItCannotReadInOneLine) {
  const std::string png = slurp(kImages / "rgb_97x61.png"), jpeg = slurp(kImages / "q85_420_101x75.jpg");
  const std::string webp = slurp(kImages / "lossy_83x59.webp");
  EXPECT_TRUE(mentions(error_message([] { decode_image("hello, world"); }), {"not an image", "PNG, JPEG or WebP"}));
  EXPECT_TRUE(mentions(error_message([] { decode_image(""); }), {"not an image"}));
  EXPECT_TRUE(mentions(error_message([] { decode_image(std::string("RIFF\x10\0\0\0WEBPVP8 ", 16)); }), {"WebP"}));
  EXPECT_TRUE(
      mentions(error_message([] { decode_image(slurp(kImages / "animated_11x9.webp")); }), {"WebP", "animated"}));
  for (size_t keep : {size_t(20), size_t(40), webp.size() / 2, webp.size() - 1})
    EXPECT_TRUE(mentions(error_message([&] { decode_image(webp.substr(0, keep)); }), {"WebP"})) << keep;
  EXPECT_TRUE(mentions(error_message([&] { decode_image(webp, DecodeLimits{1000}); }), {"83x59", "over the limit"}));
  // Truncated anywhere: in the header, in the pixels.
  for (size_t keep : {size_t(12), size_t(40), png.size() / 2, png.size() - 13})
    EXPECT_TRUE(mentions(error_message([&] { decode_image(png.substr(0, keep)); }), {"PNG"})) << keep;
  for (size_t keep : {size_t(4), size_t(200), jpeg.size() / 2, jpeg.size() - 2})
    EXPECT_TRUE(mentions(error_message([&] { decode_image(jpeg.substr(0, keep)); }), {"JPEG"})) << keep;
  // A corrupt chunk: PNG checks its CRCs.
  std::string flipped = png;
  flipped[png.size() / 2] ^= 0x55;
  EXPECT_TRUE(mentions(error_message([&] { decode_image(flipped); }), {"PNG"}));
  // Over the pixel limit: refused from the header.
  EXPECT_TRUE(
      mentions(error_message([&] { decode_image(png, DecodeLimits{1000}); }), {"97x61", "over the limit", "1000"}));
  EXPECT_TRUE(mentions(error_message([&] { decode_image(jpeg, DecodeLimits{1000}); }), {"101x75", "over the limit"}));
}

}  // namespace
}  // namespace sparrow::vision
