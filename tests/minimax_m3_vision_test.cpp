// MiniMax-M3-VL's image encoder on the CPU (model/minimax_m3_vision.h, issue 30) against
// tools/make_minimax_vision_fixture.py's float64 reference written from vLLM 0.33.0's vision tower, on the
// tests/fixtures/minimax_m3_vl weights: the image file decoded and processed by src/vision, embedded, and
// compared row by row. transformers 5.17's tower (another RoPE) is 9-12 away on these embeddings, so the
// tolerance below tells the two apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_core.h"
#include "engine/remote_groups.h"
#include "formats/safetensors.h"
#include "model/minimax_m3_vision.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "test_util.h"
#include "vision_test_util.h"
#include "vision/image.h"
#include "vision/minimax_m3_vl_processor.h"

using namespace sparrow;
using namespace sparrow::vision;
using namespace sparrow::vision_test;
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

// ---------------------------------------------------------------------------------------------
// Through the engine (Request::images): the encoder cache, chunked prefill across the images, and the prefix cache
// keyed on the images' content.

namespace {

std::vector<vision::ImageInput> fixture_images(const VisionEncoder& tower, bool swapped = false) {
  std::vector<vision::ImageInput> images;
  const int64_t offsets[2] = {12, 29};
  for (size_t i = 0; i < 2; ++i) {
    const MiniMaxM3VlImagePatches p = patches_of(kNames[swapped ? 1 - i : i]);
    vision::ImageInput image;
    image.offset = offsets[i];
    image.grid = {p.grid_t, p.grid_h, p.grid_w};
    image.tokens = tower.tokens(image.grid);
    image.pixel_values = p.pixel_values;
    images.push_back(std::move(image));
  }
  return images;
}

Request image_request(const std::string& id, const VisionEncoder& tower, bool swapped, bool prompt_logprobs) {
  Request request{id, prompt_ids(), {}, nullptr};
  request.params.temperature = 0;
  request.params.max_tokens = 2;
  request.params.logprobs = 0;
  if (prompt_logprobs) request.params.prompt_logprobs = 0;
  request.images = fixture_images(tower, swapped);
  return request;
}

// Engine steps of at most 10 tokens (so every image is cut by a chunk), blocks of 8, prefix caching on.
EngineConfig image_engine_config(const Model& model) {
  EngineConfig config;
  config.max_model_len = 64;
  config.max_num_seqs = 4;
  config.max_num_batched_tokens = 10;
  config.cache = sparrow::testing::cache_with_blocks(model, 8, 40, config.max_num_seqs);
  return config;
}

void run_all(EngineCore& engine) {
  for (int steps = 0; engine.step(); ++steps) ASSERT_LT(steps, 1000);
}

}  // namespace

TEST(MiniMaxM3VlImagePrompt, EngineRunsImagesInChunksAndKeysThePrefixCacheOnThem) {
  std::unique_ptr<Model> model = load_model(kFixture.string());
  const VisionEncoder& tower = *model->vision();
  const std::vector<int32_t> ids = prompt_ids();
  const Tensor want = reference("prompt.logits");
  using sparrow::testing::GatheredOutputs;
  GatheredOutputs out;
  EngineCore engine(*model, nullptr, image_engine_config(*model));

  // The prompt's log-probabilities, prefilled 10 tokens a step, against the reference's logits.
  sparrow::testing::add_gathering(engine, image_request("a", tower, false, true), out);
  run_all(engine);
  ASSERT_EQ(out["a"].prompt_logprobs.size(), ids.size());
  double worst = 0;
  for (size_t p = 1; p < ids.size(); ++p) {
    const float* row = want.row(int64_t(p) - 1);
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < want.dim(1); ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < want.dim(1); ++v) sum += std::exp(double(row[v]) - mx);
    const double logprob = double(row[ids[p]]) - mx - std::log(sum);
    worst = std::max(worst, std::fabs(double(out["a"].prompt_logprobs[p]->logprob) - logprob));
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_EQ(engine.encoder_cache_misses(), 2);  // each image embedded once, though three chunks cut them

  // The same prompt and images again: every full block before the last token comes from the prefix cache (5 of 8
  // tokens), and the same images' embeddings from the encoder cache.
  sparrow::testing::add_gathering(engine, image_request("b", tower, false, false), out);
  run_all(engine);
  EXPECT_EQ(out["b"].cached_tokens, 40);
  EXPECT_EQ(out["b"].tokens, out["a"].tokens);
  EXPECT_EQ(engine.encoder_cache_misses(), 2);

  // The same ids with the images swapped: only the block before the first image matches, and the answer is the one
  // an engine that never saw the first request gives.
  sparrow::testing::add_gathering(engine, image_request("c", tower, true, false), out);
  run_all(engine);
  EXPECT_EQ(out["c"].cached_tokens, 8);
  GatheredOutputs fresh;
  EngineCore clean(*model, nullptr, image_engine_config(*model));
  sparrow::testing::add_gathering(clean, image_request("c", tower, true, false), fresh);
  run_all(clean);
  EXPECT_EQ(out["c"].tokens, fresh["c"].tokens);
  ASSERT_EQ(out["c"].logprobs.size(), fresh["c"].logprobs.size());
  for (size_t i = 0; i < fresh["c"].logprobs.size(); ++i)
    EXPECT_NEAR(out["c"].logprobs[i].logprob, fresh["c"].logprobs[i].logprob, 1e-5);
  EXPECT_NE(out["c"].logprobs[0].logprob, out["b"].logprobs[0].logprob);
}

TEST(MiniMaxM3VlImagePrompt, EngineRefusesImagesThatDoNotFitTheirPlaceholders) {
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  std::unique_ptr<Model> model = load_model(kFixture.string());
  const VisionEncoder& tower = *model->vision();
  EngineCore engine(*model, nullptr, image_engine_config(*model));
  auto refused = [&](const std::function<void(Request&)>& spoil) {
    Request request = image_request("bad", tower, false, false);
    spoil(request);
    return error_message([&] { engine.add(request, [](const RequestOutput&) {}); });
  };
  EXPECT_TRUE(mentions(refused([](Request& r) { r.images[1].offset = 30; }), {"image 1 starts at 30", "no image is there"}));
  EXPECT_TRUE(mentions(refused([](Request& r) { r.images.pop_back(); }), {"no image is there"}));
  EXPECT_TRUE(mentions(refused([](Request& r) { r.images[0].tokens = 5; }), {"image 0", "takes 6"}));
  EXPECT_TRUE(mentions(refused([](Request& r) { r.images[0].pixel_values = Tensor::zeros({24, 10}); }),
                       {"do not fit the model's vision tower"}));
  EXPECT_TRUE(mentions(refused([](Request& r) { r.images[1].offset = 40; }), {"do not fit a prompt"}));
  std::unique_ptr<Model> text = load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3").string());
  EngineCore text_engine(*text, nullptr, image_engine_config(*text));
  Request request = image_request("text", tower, false, false);
  EXPECT_TRUE(mentions(error_message([&] { text_engine.add(request, [](const RequestOutput&) {}); }),
                       {"takes no images"}));
  EXPECT_EQ(engine.stats().waiting, 0);
}

// `sparrow score` with a prompt file naming the images (one path relative to the file): the reference's logits.
TEST(MiniMaxM3VlImagePrompt, ScoreTakesImagesFromThePromptFile) {
  sparrow::testing::TempDir dir;
  fs::copy_file(kImages / kNames[1], fs::path(dir.path()) / "second.jpg");
  nlohmann::json prompt = {{"ids", prompt_ids()}, {"images", {(kImages / kNames[0]).string(), "second.jpg"}}};
  const std::string prompts = dir.write("prompts.json", nlohmann::json({{"prompts", {prompt}}}).dump());
  const std::string out = (fs::path(dir.path()) / "logits.safetensors").string();
  const auto run = sparrow::testing::run_sparrow("score --model " + kFixture.string() + " --prompt-ids " + prompts +
                                                 " --out " + out);
  ASSERT_EQ(run.status, 0) << run.err;
  auto file = SafetensorsFile::open(out);
  EXPECT_LT(relative_gap(to_float32(file->tensors().at("logits.0"), file), reference("prompt.logits")), 1e-4);
  // A prompt whose placeholders do not fit its images: a one-line error naming the prompt.
  prompt["images"] = {"second.jpg"};
  dir.write("one.json", nlohmann::json({{"prompts", {prompt}}}).dump());
  const auto bad = sparrow::testing::run_sparrow("score --model " + kFixture.string() + " --prompt-ids " +
                                                 dir.path() + "/one.json --out " + out);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("prompt 0"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("no image is there"), std::string::npos) << bad.err;
}

// `sparrow generate` with the same prompt file: the engine's greedy first token is the reference's argmax after the
// prompt (58, 0.018 ahead of the next); a text-only model refuses the file.
TEST(MiniMaxM3VlImagePrompt, GenerateTakesImagesFromThePromptFile) {
  sparrow::testing::TempDir dir;
  const nlohmann::json prompt = {{"ids", prompt_ids()},
                                 {"images", {(kImages / kNames[0]).string(), (kImages / kNames[1]).string()}}};
  const std::string prompts = dir.write("prompts.json", nlohmann::json({{"prompts", {prompt}}}).dump());
  const auto run = sparrow::testing::run_sparrow("generate --model " + kFixture.string() + " --prompt-ids " + prompts +
                                                 " --max-tokens 1 --temperature 0 --ignore-eos");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(nlohmann::json::parse(run.out)["completions"], nlohmann::json::parse("[[58]]")) << run.out;
  const auto text = sparrow::testing::run_sparrow("generate --model " + (fs::path(SPARROW_SOURCE_DIR) /
                                                  "tests/fixtures/minimax_m3").string() + " --prompt-ids " + prompts);
  EXPECT_NE(text.status, 0);
  EXPECT_NE(text.err.find("has no vision tower"), std::string::npos) << text.err;
}

// Under data parallelism rank 0 hands requests to the other groups' engines over the wire (engine/remote_groups.h):
// the images go with them, every patch and the hash.
TEST(MiniMaxM3VlImagePrompt, ImagesCrossToOtherDataParallelGroups) {
  std::unique_ptr<Model> model = load_model(kFixture.string());
  Request request = image_request("dp", *model->vision(), false, false);
  request.images[0].hash = 7;
  const Request back = decode_request(encode_request(request));
  ASSERT_EQ(back.images.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const vision::ImageInput &a = request.images[i], &b = back.images[i];
    EXPECT_EQ(b.offset, a.offset);
    EXPECT_EQ(b.tokens, a.tokens);
    EXPECT_EQ(b.hash, a.hash);
    EXPECT_EQ(b.grid.h, a.grid.h);
    EXPECT_EQ(b.grid.w, a.grid.w);
    EXPECT_EQ(b.pixel_values.shape(), a.pixel_values.shape());
    EXPECT_TRUE(std::equal(a.pixel_values.data(), a.pixel_values.data() + a.pixel_values.numel(), b.pixel_values.data()));
  }
  EXPECT_EQ(back.prompt, request.prompt);
}
