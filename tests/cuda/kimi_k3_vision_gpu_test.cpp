// Kimi K3 with images on the GPU (issue 30): MoonViT on the GPU (model/kimi_k3_vision.h) and its rows copied over
// the placeholders' embeddings (Batch::embedded_rows), against the reference's logits
// (tools/make_kimi_k3_vision_fixture.py's kimi_k3_vl_gpu: tools/kimi_k3_reference.py's text model in float64 on the
// reference tower's embeddings). The text model is tests/fixtures/kimi_k3_1_pro_gpu's (the GPU MLA kernels' widths),
// merged at run time with the fixture's vision weights and config into one checkpoint folder. As in
// minimax_m3_vision_gpu_test.cpp, the rows before the indexer's top-64 budget is exceeded (positions < 64, both
// images among them) must match within bf16 accuracy; beyond it this random checkpoint's close indexer calls may
// flip under bf16, so those rows are printed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "formats/safetensors.h"
#include "gpu_test_util.h"
#include "model/model.h"
#include "model/vision_encoder.h"
#include "model_test_util.h"
#include "runner/model_runner.h"
#include "../test_util.h"
#include "vision/image_processor.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using namespace sparrow::model_test;

const fs::path kFixtures = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures";
const fs::path kFixture = kFixtures / "kimi_k3_vl_gpu";
const fs::path kImages = fs::path(SPARROW_SOURCE_DIR) / "tests/data/images";
constexpr double kBf16Tolerance = 4e-2;
constexpr int64_t kBudget = 64;  // index_topk

// kimi_k3_1_pro_gpu's text model and config with the fixture's tower: config.json with vision_config and the
// placeholder id, a safetensors index naming each weight's file, kimi_k3_vl's preprocessor settings.
void write_model_folder(const sparrow::testing::TempDir& dir) {
  const fs::path text = kFixtures / "kimi_k3_1_pro_gpu";
  nlohmann::json config = nlohmann::json::parse(sparrow::testing::slurp(text / "config.json"));
  const nlohmann::json vision = nlohmann::json::parse(sparrow::testing::slurp(kFixture / "vision_config.json"));
  for (const auto& [key, value] : vision.items()) config[key] = value;
  dir.write("config.json", config.dump());
  fs::copy_file(kFixtures / "kimi_k3_vl" / "preprocessor_config.json", fs::path(dir.path()) / "preprocessor_config.json");
  fs::create_symlink(text / "model.safetensors", fs::path(dir.path()) / "text.safetensors");
  fs::create_symlink(kFixture / "vision.safetensors", fs::path(dir.path()) / "vision.safetensors");
  nlohmann::json index;
  for (const char* file : {"text.safetensors", "vision.safetensors"})
    for (const auto& [name, info] : SafetensorsFile::open((fs::path(dir.path()) / file).string())->tensors())
      index["weight_map"][name] = file;
  dir.write("model.safetensors.index.json", index.dump());
}

}  // namespace

TEST(CudaKimiK3Vl, PromptWithImagesMatchesTheReferenceWithinTheBudget) {
  SPARROW_REQUIRE_GPU();
  if (!fs::exists(kImages / "rgb_97x61.png")) GTEST_SKIP() << "tests/data/images is not in this copy of the tree";
  sparrow::testing::TempDir dir;
  write_model_folder(dir);
  std::unique_ptr<Model> model = load_model(dir.path(), Device::Cuda);
  const VisionEncoder* tower = model->vision();
  ASSERT_NE(tower, nullptr);
  auto file = SafetensorsFile::open((kFixture / "vision_reference.safetensors").string());
  const Tensor want = to_float32(file->tensors().at("prompt.logits"), file);
  const TensorInfo& ids_info = file->tensors().at("prompt.ids");
  std::vector<int64_t> ids64(ids_info.nbytes / 8);
  std::memcpy(ids64.data(), ids_info.data, ids_info.nbytes);
  const Tokens ids(ids64.begin(), ids64.end());
  const vision::ImageProcessor processor = vision::ImageProcessor::for_model(dir.path());
  std::vector<vision::ImageInput> images;
  for (const char* name : {"rgb_97x61.png", "downscaled_203x151.jpg"})
    images.push_back(processor.process(sparrow::testing::slurp(kImages / name)));
  vision::place_images(ids, images, tower->image_token_id());
  std::vector<std::pair<int64_t, Tensor>> rows_of;
  for (const vision::ImageInput& image : images)
    rows_of.push_back({image.offset, tower->embed(image.pixel_values, {image.grid})});
  ModelRunner runner(*model);
  CacheConfig config;
  config.device = Device::Cuda;
  config.memory_bytes = int64_t(128) << 20;
  config.enable_prefix_caching = false;
  KvCache cache(model->cache_spec(), config);
  auto run = [&](bool with_images) {
    SequenceState s;
    s.cache = cache.view(cache.create_sequence());
    Batch batch = make_batch({{&s, ids}});
    ImageRows rows;
    if (with_images)
      for (const auto& [offset, embeddings] : rows_of) rows.add(0, 0, int64_t(ids.size()), offset, embeddings);
    rows.attach_to(batch);
    return runner.run(batch).to(Device::Cpu);
  };
  const Tensor got = run(true), without = run(false);
  int64_t good_within = 0, good_beyond = 0, far_without = 0;
  const int64_t first_image = images[0].offset;
  for (int64_t t = 0; t < got.dim(0); ++t) {
    const bool good = relative_l2(got.row(t), want.row(t), got.dim(1)) <= kBf16Tolerance;
    (t < kBudget ? good_within : good_beyond) += good;
    if (t >= first_image && t < kBudget) far_without += relative_l2(without.row(t), want.row(t), got.dim(1)) > 0.2;
  }
  std::printf("[ note ] 100-token prompt with 2 images on the GPU: %lld of %lld rows within the budget and %lld of %lld "
              "beyond within bf16 accuracy of the reference; without the images %lld of the %lld rows from the first "
              "image to the budget are far from it\n", (long long)good_within, (long long)kBudget,
              (long long)good_beyond, (long long)(got.dim(0) - kBudget), (long long)far_without,
              (long long)(kBudget - first_image));
  EXPECT_GE(good_within * 10, kBudget * 9);
  EXPECT_GE(far_without * 10, (kBudget - first_image) * 7);
}
