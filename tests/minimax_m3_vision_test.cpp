// MiniMax-M3-VL's image encoder on the CPU (model/minimax_m3_vision.h, issue 30) against
// tools/make_minimax_vision_fixture.py's float64 reference written from vLLM 0.33.0's vision tower, on the
// tests/fixtures/minimax_m3_vl weights: the image file decoded and processed by src/vision, embedded, and
// compared row by row. transformers 5.17's tower (another RoPE) is 9-12 away on these embeddings, so the
// tolerance below tells the two apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "model/minimax_m3_vision.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/minimax_m3_vl_processor.h"

using namespace sparrow;
using namespace sparrow::vision;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3_vl";
const fs::path kImages = fs::path(SPARROW_SOURCE_DIR) / "tests/data/images";
const char* const kNames[] = {"rgb_97x61.png", "downscaled_203x151.jpg"};

// The image through src/vision with its case's processor settings (tests/data/images/cases.json).
MiniMaxM3VlImagePatches patches_of(const std::string& name) {
  const nlohmann::json cases = nlohmann::json::parse(sparrow::testing::slurp(kImages / "cases.json"));
  MiniMaxM3VlProcessorConfig config;
  config.rule = MiniMaxResizeRule::Transformers;  // the reference's patches are transformers' processor's
  config.min_pixels = cases.at(name).at("min_pixels").get<int64_t>();
  config.max_pixels = cases.at(name).at("max_pixels").get<int64_t>();
  return minimax_m3_vl_patches(decode_image(sparrow::testing::slurp(kImages / name)), config);
}

// The largest difference from the reference, over the reference's largest magnitude.
double relative_gap(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.shape(), want.shape());
  if (got.shape() != want.shape()) return INFINITY;
  double gap = 0, scale = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    gap = std::max(gap, double(std::fabs(got.data()[i] - want.data()[i])));
    scale = std::max(scale, double(std::fabs(want.data()[i])));
  }
  return gap / scale;
}

Tensor reference(const std::string& key) {
  auto file = SafetensorsFile::open((kFixture / "vision_reference.safetensors").string());
  return to_float32(file->tensors().at(key), file);
}

}  // namespace

TEST(MiniMaxM3Vision, EmbeddingsFollowVllmsTower) {
  auto encoder = MiniMaxM3VisionEncoder::load(kFixture.string());
  std::vector<Tensor> alone;
  for (const char* name : kNames) {
    const MiniMaxM3VlImagePatches p = patches_of(name);
    const Tensor got = encoder->embed(p.pixel_values, {{p.grid_t, p.grid_h, p.grid_w}});
    EXPECT_EQ(got.dim(0), p.tokens(encoder->merge_size()));
    const double gap = relative_gap(got, reference(std::string(name) + ".embeddings"));
    EXPECT_LT(gap, 1e-5) << name;
    std::printf("[ note ] %s: %lld image tokens, largest difference from the float64 reference %.2g of the largest "
                "value\n", name, static_cast<long long>(got.dim(0)), gap);
    alone.push_back(got);
  }
  // Both images in one call: each attends to itself only, so its rows are bit for bit those of its own call.
  const MiniMaxM3VlImagePatches a = patches_of(kNames[0]), b = patches_of(kNames[1]);
  Tensor both_patches = Tensor::empty({a.pixel_values.dim(0) + b.pixel_values.dim(0), encoder->patch_width()});
  std::copy_n(a.pixel_values.data(), a.pixel_values.numel(), both_patches.data());
  std::copy_n(b.pixel_values.data(), b.pixel_values.numel(), both_patches.data() + a.pixel_values.numel());
  const Tensor both =
      encoder->embed(both_patches, {{a.grid_t, a.grid_h, a.grid_w}, {b.grid_t, b.grid_h, b.grid_w}});
  EXPECT_LT(relative_gap(both, reference("both.embeddings")), 1e-5);
  ASSERT_EQ(both.dim(0), alone[0].dim(0) + alone[1].dim(0));
  EXPECT_TRUE(std::equal(alone[0].data(), alone[0].data() + alone[0].numel(), both.data()));
  EXPECT_TRUE(std::equal(alone[1].data(), alone[1].data() + alone[1].numel(), both.data() + alone[0].numel()));
}

TEST(MiniMaxM3Vision, BadInputIsAOneLineError) {
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  auto encoder = MiniMaxM3VisionEncoder::load(kFixture.string());
  const MiniMaxM3VlImagePatches p = patches_of(kNames[0]);
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(p.pixel_values, {{1, p.grid_h, p.grid_w + 2}}); }),
                       {"the grids hold"}));
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(p.pixel_values, {{1, 3, 8}}); }), {"2x2 windows"}));
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(Tensor::zeros({4, 10}), {{1, 2, 2}}); }),
                       {"patches must be fp32"}));
  const fs::path text_only = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3";
  EXPECT_TRUE(mentions(error_message([&] { MiniMaxM3VisionEncoder::load(text_only.string()); }), {"no vision_config"}));
}

// ---------------------------------------------------------------------------------------------
// The images in a prompt: the model loads its tower beside the text model (Model::vision), and the text model
// reads the tower's rows in place of the placeholders' embeddings (Batch::embedded_rows), against the reference's
// logits (transformers 5.17's text model in float64 on the reference embeddings; the prompt is 45 tokens, longer
// than the MSA budget of 3 blocks of 8).

namespace {

struct PromptImage {
  int64_t offset;
  Tensor embeddings;
};

// The prompt's logits, run chunk by chunk through one sequence, each chunk's image rows placed by ImageRows.
Tensor run_prompt(Model& model, const std::vector<int32_t>& ids, const std::vector<PromptImage>& images,
                  const std::vector<int64_t>& chunks) {
  SequenceState seq = sparrow::testing::new_sequence(model);
  Tensor all = Tensor::empty({int64_t(ids.size()), model.vocab_size()});
  int64_t done = 0;
  for (int64_t len : chunks) {
    Batch batch = make_batch({{&seq, {ids.begin() + done, ids.begin() + done + len}}});
    ImageRows rows;
    for (const PromptImage& image : images) rows.add(0, done, len, image.offset, image.embeddings);
    rows.attach_to(batch);
    const Tensor logits = sparrow::testing::run_step(model, batch);
    std::copy_n(logits.data(), logits.numel(), all.row(done));
    done += len;
  }
  EXPECT_EQ(done, int64_t(ids.size()));
  return all;
}

std::vector<int32_t> prompt_ids() {
  const Tensor ids = reference("prompt.ids");
  std::vector<int32_t> out;
  for (int64_t i = 0; i < ids.numel(); ++i) out.push_back(int32_t(ids.data()[i]));
  return out;
}

}  // namespace

TEST(MiniMaxM3VlImagePrompt, LogitsFollowTheReferenceWholeAndInChunksAcrossTheImages) {
  std::unique_ptr<Model> model = load_model(kFixture.string());
  const VisionEncoder* tower = model->vision();
  ASSERT_NE(tower, nullptr);
  EXPECT_EQ(tower->image_token_id(), 250);
  const std::vector<int32_t> ids = prompt_ids();
  const Tensor offsets = reference("prompt.image_offsets");
  std::vector<PromptImage> images;
  for (size_t i = 0; i < 2; ++i) {
    const MiniMaxM3VlImagePatches p = patches_of(kNames[i]);
    images.push_back({int64_t(offsets.data()[i]), tower->embed(p.pixel_values, {{p.grid_t, p.grid_h, p.grid_w}})});
  }
  ASSERT_EQ(images[0].offset, 12);
  ASSERT_EQ(images[1].offset, 29);
  const Tensor want = reference("prompt.logits");
  const Tensor whole = run_prompt(*model, ids, images, {45});
  const double gap = relative_gap(whole, want);
  EXPECT_LT(gap, 1e-4);
  std::printf("[ note ] 45-token prompt with 2 images: largest logit difference from the reference %.2g of the "
              "largest logit\n", gap);
  // Chunks that cut each image: 0-13 (2 of image 0's 6 rows), 14-31 (its other 4, 3 of image 1's), 32-44.
  EXPECT_LT(relative_gap(run_prompt(*model, ids, images, {14, 18, 13}), whole), 1e-5);
  // Without the images' rows (the placeholders' own embeddings) the logits are far from the reference: the test
  // sees where the rows go.
  EXPECT_GT(relative_gap(run_prompt(*model, ids, {}, {45}), want), 0.05);
  // Each image's rows at the other's place: far too.
  std::vector<PromptImage> swapped = {{12, images[1].embeddings}, {29, images[0].embeddings}};
  EXPECT_GT(relative_gap(run_prompt(*model, ids, swapped, {45}), want), 0.01);
}

TEST(MiniMaxM3VlImagePrompt, TextOnlyCheckpointsHaveNoTower) {
  EXPECT_EQ(load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3").string())->vision(), nullptr);
}
