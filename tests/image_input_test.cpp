// The small pieces an image passes through on its way into a prompt (issue 30, docs/vision.md): base64 both ways
// (core/base64.h), the placeholder checks and expansions (vision/image_input.h, vision/image_processor.h), the
// content hash, and the JPEG writer `bench serve --dataset-name random-mm` uses.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/base64.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/image_input.h"
#include "vision/image_processor.h"

using namespace sparrow;
using namespace sparrow::vision;
using sparrow::testing::error_message;

namespace {

ImageInput image_of(int64_t tokens) {
  ImageInput image;
  image.tokens = tokens;
  return image;
}

}  // namespace

TEST(Base64, RoundTripsEveryLengthAndRefusesMalformedText) {
  std::string bytes;
  for (int n = 0; n < 40; ++n) {
    if (n > 0) EXPECT_EQ(base64_decode(base64_encode(bytes)), bytes) << n;
    bytes += char(n * 37 + 200);
  }
  EXPECT_EQ(base64_encode("Man"), "TWFu");
  EXPECT_EQ(base64_encode("Ma"), "TWE=");
  EXPECT_EQ(base64_encode("M"), "TQ==");
  EXPECT_NE(error_message([] { base64_decode("TWE"); }).find("bad base64 length"), std::string::npos);
  EXPECT_NE(error_message([] { base64_decode("TW=u"); }).find("bad base64 character"), std::string::npos);
  EXPECT_NE(error_message([] { base64_decode("TQ==TWFu"); }).find("bad base64 padding"), std::string::npos);
  EXPECT_NE(error_message([] { base64_decode("TW-u"); }).find("bad base64 character"), std::string::npos);
}

TEST(ImagePlaceholders, ExpandedAsVllmDoesAndCheckedAgainstTheImages) {
  constexpr int32_t P = 9, B = 7, E = 8;
  std::vector<ImageInput> images = {image_of(2), image_of(3)};
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> around = {{{B}, {E}}, {{B}, {E}}};
  const std::vector<int32_t> ids = expand_placeholders({1, P, 2, P, 3}, images, P, P, around);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, B, P, P, E, 2, B, P, P, P, E, 3}));
  EXPECT_EQ(images[0].offset, 2);
  EXPECT_EQ(images[1].offset, 7);
  EXPECT_NO_THROW(check_image_placeholders(ids, images, P));
  EXPECT_NE(error_message([&] { expand_placeholders({1, P, 2}, images, P, P, around); }).find("1 image placeholder(s) for 2"),
            std::string::npos);
  // Kimi K3's form: the template's placeholder (K) becomes text that differs per image, then pads of another id (D).
  constexpr int32_t K = 20, D = 21;
  std::vector<ImageInput> kimi = {image_of(2), image_of(1)};
  const std::vector<int32_t> kimi_ids =
      expand_placeholders({1, K, 2, K}, kimi, K, D, {{{30, 31, 32}, {33}}, {{30, 34}, {33}}});
  EXPECT_EQ(kimi_ids, (std::vector<int32_t>{1, 30, 31, 32, D, D, 33, 2, 30, 34, D, 33}));
  EXPECT_EQ(kimi[0].offset, 4);
  EXPECT_EQ(kimi[1].offset, 10);
  EXPECT_NO_THROW(check_image_placeholders(kimi_ids, kimi, D));
  // Pre-expanded ids (prompt files): image i takes the i-th run.
  std::vector<ImageInput> placed = {image_of(2), image_of(3)};
  place_images(ids, placed, P);
  EXPECT_EQ(placed[0].offset, 2);
  EXPECT_EQ(placed[1].offset, 7);
  std::vector<ImageInput> short_run = {image_of(3), image_of(3)};
  EXPECT_NE(error_message([&] { place_images(ids, short_run, P); }).find("not the image placeholder"), std::string::npos);
  std::vector<ImageInput> one = {image_of(2)};
  EXPECT_NE(error_message([&] { place_images(ids, one, P); }).find("no image is there"), std::string::npos);
  std::vector<ImageInput> three = {image_of(2), image_of(3), image_of(1)};
  EXPECT_NE(error_message([&] { place_images(ids, three, P); }).find("for 2 of its 3 images"), std::string::npos);
}

TEST(ImageContentHash, SeesEveryValueAndTheGrid) {
  Tensor a = Tensor::zeros({4, 3});
  const uint64_t base = image_content_hash(a, {1, 2, 2});
  EXPECT_EQ(image_content_hash(a.clone(), {1, 2, 2}), base);
  EXPECT_NE(image_content_hash(a, {1, 1, 4}), base);  // the same values on another grid
  a.data()[11] = 1e-30f;
  EXPECT_NE(image_content_hash(a, {1, 2, 2}), base);
}

TEST(EncodeJpeg, DecodesBackToTheSizeAndNearlyThePixels) {
  Image image{21, 34, std::vector<uint8_t>(size_t(21 * 34 * 3))};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = uint8_t((i / 3 % 34) * 7 + i % 3 * 40);  // smooth
  const std::string jpeg = encode_jpeg(image, 95);
  EXPECT_EQ(image_format(jpeg), "jpeg");
  const Image back = decode_image(jpeg);
  ASSERT_EQ(back.height, 21);
  ASSERT_EQ(back.width, 34);
  double error = 0;
  for (size_t i = 0; i < image.rgb.size(); ++i) error += std::abs(int(back.rgb[i]) - int(image.rgb[i]));
  EXPECT_LT(error / double(image.rgb.size()), 6.0);
  EXPECT_NE(error_message([] { encode_jpeg(Image{2, 2, {}}); }).find("encode_jpeg"), std::string::npos);
}
