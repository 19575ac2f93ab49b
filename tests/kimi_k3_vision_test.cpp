// Kimi K3's image encoder on the CPU (model/kimi_k3_vision.h, issue 30) against
// tools/make_kimi_k3_vision_fixture.py's float64 reference, written from vLLM 0.33.0's MoonViT3d and projector
// (model_executor/models/kimi_k25_vit.py), on two tiny checkpoints: tests/fixtures/kimi_k3_vl (K3's vision
// settings: RMSNorm, no biases, head_dim wider than hidden / heads, bilinear position table, tanh GELU, the v2
// projector, with the K3.1 Pro text model) and tests/fixtures/kimi_k25_vision (the other switches: LayerNorm,
// biases, bicubic, erf GELU, the v1 projector). The image files go through src/vision's decoder and Kimi's
// processor (vision::ImageProcessor, the checkpoints' preprocessor_config.json) first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_core.h"
#include "formats/safetensors.h"
#include "model/kimi_k3_vision.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "test_util.h"
#include "vision_test_util.h"
#include "vision/image_processor.h"

using namespace sparrow;
using namespace sparrow::vision;
using namespace sparrow::vision_test;
namespace fs = std::filesystem;

namespace {

const fs::path kK3 = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k3_vl";
const fs::path kK25 = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k25_vision";
const fs::path kImages = fs::path(SPARROW_SOURCE_DIR) / "tests/data/images";
const char* const kNames[] = {"rgb_97x61.png", "downscaled_203x151.jpg"};

ImageInput processed(const fs::path& fixture, const std::string& name) {
  return ImageProcessor::for_model(fixture.string()).process(sparrow::testing::slurp(kImages / name));
}

struct Reference {
  std::shared_ptr<SafetensorsFile> file;
  explicit Reference(const fs::path& fixture)
      : file(SafetensorsFile::open((fixture / "vision_reference.safetensors").string())) {}
  Tensor floats(const std::string& key) const { return to_float32(file->tensors().at(key), file); }
  std::vector<int64_t> ints(const std::string& key) const {
    const TensorInfo& info = file->tensors().at(key);
    EXPECT_EQ(info.dtype, DType::I64) << key;
    std::vector<int64_t> out(info.nbytes / 8);
    std::memcpy(out.data(), info.data, info.nbytes);
    return out;
  }
};

bool same_bits(const Tensor& a, const float* b) { return std::equal(a.data(), a.data() + a.numel(), b); }

void check_tower(const fs::path& fixture) {
  const Reference ref(fixture);
  auto encoder = KimiK3VisionEncoder::load(fixture.string());
  std::vector<ImageInput> images;
  std::vector<Tensor> alone;
  for (const char* name : kNames) {
    ImageInput image = processed(fixture, name);
    // The processor's patches are the reference's, bit for bit (src/vision's own tests pin the processor).
    const Tensor want_patches = ref.floats(std::string(name) + ".pixel_values");
    ASSERT_EQ(image.pixel_values.shape(), want_patches.shape()) << name;
    EXPECT_TRUE(same_bits(image.pixel_values, want_patches.data())) << name;
    EXPECT_EQ(ref.ints(std::string(name) + ".grid"), (std::vector<int64_t>{image.grid.t, image.grid.h, image.grid.w}));
    const Tensor got = encoder->embed(image.pixel_values, {image.grid});
    EXPECT_EQ(got.dim(0), encoder->tokens(image.grid));
    EXPECT_EQ(got.dim(0), image.tokens);
    const double gap = relative_gap(got, ref.floats(std::string(name) + ".embeddings"));
    EXPECT_LT(gap, 1e-5) << name;
    std::printf("[ note ] %s, %s: grid %lld x %lld, %lld image tokens, largest difference from the float64 "
                "reference %.2g of the largest value\n", fixture.filename().c_str(), name,
                static_cast<long long>(image.grid.h), static_cast<long long>(image.grid.w),
                static_cast<long long>(got.dim(0)), gap);
    alone.push_back(got);
    images.push_back(std::move(image));
  }
  // Both images in one call: each attends to itself only, so its rows are bit for bit those of its own call.
  const Tensor &a = images[0].pixel_values, &b = images[1].pixel_values;
  Tensor both_patches = Tensor::empty({a.dim(0) + b.dim(0), encoder->patch_width()});
  std::copy_n(a.data(), a.numel(), both_patches.data());
  std::copy_n(b.data(), b.numel(), both_patches.data() + a.numel());
  const Tensor both = encoder->embed(both_patches, {images[0].grid, images[1].grid});
  EXPECT_LT(relative_gap(both, ref.floats("both.embeddings")), 1e-5);
  ASSERT_EQ(both.dim(0), alone[0].dim(0) + alone[1].dim(0));
  EXPECT_TRUE(same_bits(alone[0], both.data()));
  EXPECT_TRUE(same_bits(alone[1], both.data() + alone[0].numel()));
}

}  // namespace

TEST(KimiK3Vision, EmbeddingsFollowVllmsTowerWithK3sSettings) { check_tower(kK3); }

TEST(KimiK3Vision, EmbeddingsFollowVllmsTowerWithK25sSettings) { check_tower(kK25); }

TEST(KimiK3Vision, BadInputIsAOneLineError) {
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  auto encoder = KimiK3VisionEncoder::load(kK3.string());
  const ImageInput image = processed(kK3, kNames[0]);
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(image.pixel_values, {{1, 6, 10}}); }), {"the grids hold"}));
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(image.pixel_values, {{1, 3, 16}}); }), {"2x2 windows"}));
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(image.pixel_values, {{5, 2, 2}}); }),
                       {"init_pos_emb_time 4"}));
  EXPECT_TRUE(mentions(error_message([&] { encoder->embed(Tensor::zeros({4, 10}), {{1, 2, 2}}); }),
                       {"patches must be fp32"}));
  // A config the tower does not take, and a text-only checkpoint.
  sparrow::testing::TempDir dir;
  nlohmann::json config = nlohmann::json::parse(sparrow::testing::slurp(kK3 / "config.json"));
  config["vision_config"]["pos_emb_interpolation_mode"] = "nearest";
  dir.write("config.json", config.dump());
  fs::copy_file(kK3 / "model.safetensors", fs::path(dir.path()) / "model.safetensors");
  EXPECT_TRUE(mentions(error_message([&] { KimiK3VisionEncoder::load(dir.path()); }),
                       {"pos_emb_interpolation_mode", "nearest", "bilinear, bicubic"}));
  const fs::path text_only = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k3_1_pro";
  EXPECT_TRUE(mentions(error_message([&] { KimiK3VisionEncoder::load(text_only.string()); }), {"no vision_config"}));
  EXPECT_EQ(load_model(text_only.string())->vision(), nullptr);
}

// ---------------------------------------------------------------------------------------------
// The images in a prompt: load_model gives the K3 checkpoint its tower (Model::vision), and the text model reads
// the tower's rows in place of the placeholders' embeddings (Batch::embedded_rows), against the reference's logits
// (tools/kimi_k3_reference.py's text model in float64 on the reference embeddings; a 50-token prompt with two
// images, longer than the indexer's top-16).

namespace {

std::vector<int32_t> prompt_ids() {
  std::vector<int32_t> out;
  for (int64_t id : Reference(kK3).ints("prompt.ids")) out.push_back(int32_t(id));
  return out;
}

}  // namespace

TEST(KimiK3ImagePrompt, LogitsFollowTheReferenceWholeAndInChunksAcrossTheImages) {
  std::unique_ptr<Model> model = load_model(kK3.string());
  const VisionEncoder* tower = model->vision();
  ASSERT_NE(tower, nullptr);
  EXPECT_EQ(tower->image_token_id(), 250);
  const Reference ref(kK3);
  const std::vector<int32_t> ids = prompt_ids();
  ASSERT_EQ(ids.size(), 50u);
  const std::vector<int64_t> offsets = ref.ints("prompt.image_offsets");
  ASSERT_EQ(offsets, (std::vector<int64_t>{7, 25}));
  std::vector<PromptImage> images;
  for (size_t i = 0; i < 2; ++i) {
    const ImageInput image = processed(kK3, kNames[i]);
    images.push_back({offsets[i], tower->embed(image.pixel_values, {image.grid})});
  }
  const Tensor want = ref.floats("prompt.logits");
  const Tensor whole = run_prompt(*model, ids, images, {50});
  const double gap = relative_gap(whole, want);
  EXPECT_LT(gap, 1e-4);
  std::printf("[ note ] 50-token prompt with 2 images: largest logit difference from the reference %.2g of the "
              "largest logit\n", gap);
  // Chunks that cut each image: 0-11 (5 of image 0's 12 rows), 12-29 (its other 7, 5 of image 1's), 30-49.
  EXPECT_LT(relative_gap(run_prompt(*model, ids, images, {12, 18, 20}), whole), 1e-5);
  // Without the images' rows the logits are far from the reference; with each image at the other's place too.
  EXPECT_GT(relative_gap(run_prompt(*model, ids, {}, {50}), want), 0.05);
  ASSERT_EQ(images[0].embeddings.dim(0), 12);
  ASSERT_EQ(images[1].embeddings.dim(0), 20);
}

// Through the engine (Request::images) at 8-token steps, the prompt's log-probabilities against the reference, each
// image embedded once; and `sparrow score` with a prompt file naming the image files.
TEST(KimiK3ImagePrompt, EngineAndScoreTakeTheImages) {
  std::unique_ptr<Model> model = load_model(kK3.string());
  const std::vector<int32_t> ids = prompt_ids();
  const Reference ref(kK3);
  const Tensor want = ref.floats("prompt.logits");
  Request request{"a", ids, {}, nullptr};
  request.params.temperature = 0;
  request.params.max_tokens = 1;
  request.params.prompt_logprobs = 0;
  for (const char* name : kNames) request.images.push_back(processed(kK3, name));
  place_images(ids, request.images, model->vision()->image_token_id());
  EXPECT_EQ(request.images[1].offset, 25);
  EngineConfig config;
  config.max_model_len = 64;
  config.max_num_seqs = 2;
  config.max_num_batched_tokens = 8;
  config.cache = sparrow::testing::cache_with_blocks(*model, 16, 16, config.max_num_seqs);
  EngineCore engine(*model, nullptr, config);
  sparrow::testing::GatheredOutputs out;
  sparrow::testing::add_gathering(engine, request, out);
  for (int steps = 0; engine.step(); ++steps) ASSERT_LT(steps, 1000);
  ASSERT_EQ(out["a"].prompt_logprobs.size(), ids.size());
  double worst = 0;
  for (size_t p = 1; p < ids.size(); ++p) {
    const float* row = want.row(int64_t(p) - 1);
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < want.dim(1); ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < want.dim(1); ++v) sum += std::exp(double(row[v]) - mx);
    worst = std::max(worst, std::fabs(double(out["a"].prompt_logprobs[p]->logprob) -
                                      (double(row[ids[p]]) - mx - std::log(sum))));
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_EQ(engine.encoder_cache_misses(), 2);

  sparrow::testing::TempDir dir;
  const nlohmann::json prompt = {{"ids", ids},
                                 {"images", {(kImages / kNames[0]).string(), (kImages / kNames[1]).string()}}};
  const std::string prompts = dir.write("prompts.json", nlohmann::json({{"prompts", {prompt}}}).dump());
  const std::string logits = (fs::path(dir.path()) / "logits.safetensors").string();
  const auto run = sparrow::testing::run_sparrow("score --model " + kK3.string() + " --prompt-ids " + prompts +
                                                 " --out " + logits);
  ASSERT_EQ(run.status, 0) << run.err;
  auto file = SafetensorsFile::open(logits);
  EXPECT_LT(relative_gap(to_float32(file->tensors().at("logits.0"), file), want), 1e-4);
}
