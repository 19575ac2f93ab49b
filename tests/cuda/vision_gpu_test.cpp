// The vision towers on the GPU (issue 30): the ops they are built from (ops::gelu_, softmax_rows, rotate_pairs_)
// against their CPU versions, and both towers (model/minimax_m3_vision.h, model/kimi_k3_vision.h) loaded to the GPU
// and embedding the fixtures' images (bf16 activations, fp32 attention scores) against the float64 references the
// CPU tests use (tools/make_minimax_vision_fixture.py, tools/make_kimi_k3_vision_fixture.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "formats/safetensors.h"
#include "gpu_test_util.h"
#include "kernels/ops.h"
#include "model/kimi_k3_vision.h"
#include "model/minimax_m3_vision.h"
#include "model_test_util.h"
#include "../test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using namespace sparrow::model_test;

const fs::path kFixtures = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures";
const fs::path kImages = fs::path(SPARROW_SOURCE_DIR) / "tests/data/images";

Tensor random_tensor(std::mt19937& rng, Shape shape, float scale) {
  Tensor t = Tensor::empty(shape);
  std::normal_distribution<float> normal(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = normal(rng);
  return t;
}

Tensor on_gpu(const Tensor& t) { return t.to(Device::Cuda, ScalarType::BF16); }
Tensor back(const Tensor& t) { return t.to(Device::Cpu, ScalarType::F32); }

// The GPU op on the bf16-rounded input against the CPU op on the same values.
double gap_to_cpu(const Tensor& gpu, const Tensor& cpu) { return relative_l2(back(gpu), cpu); }

}  // namespace

TEST(CudaVisionOps, GeluSoftmaxAndRotationFollowTheirCpuVersions) {
  SPARROW_REQUIRE_GPU();
  std::mt19937 rng(7);
  for (bool tanh_form : {false, true}) {
    const Tensor x = back(on_gpu(random_tensor(rng, {37, 96}, 2.0f)));  // bf16 values, so both start equal
    Tensor cpu = x.clone(), gpu = on_gpu(x);
    ops::gelu_(cpu, tanh_form);
    ops::gelu_(gpu, tanh_form);
    EXPECT_LT(gap_to_cpu(gpu, cpu), 4e-3) << tanh_form;
  }
  const Tensor scores = random_tensor(rng, {50, 333}, 3.0f);
  const Tensor cpu_probs = ops::softmax_rows(scores, 0.7f);
  const Tensor gpu_probs = ops::softmax_rows(scores.to(Device::Cuda), 0.7f);
  EXPECT_EQ(gpu_probs.type(), ScalarType::BF16);
  EXPECT_LT(gap_to_cpu(gpu_probs, cpu_probs), 4e-3);
  for (bool interleaved : {false, true}) {
    const Tensor x = back(on_gpu(random_tensor(rng, {29, 3 * 40}, 1.0f)));
    const Tensor cos = random_tensor(rng, {29, 18}, 1.0f), sin = random_tensor(rng, {29, 18}, 1.0f);
    Tensor cpu = x.clone(), gpu = on_gpu(x);
    ops::rotate_pairs_(cpu, cos, sin, 40, interleaved);
    ops::rotate_pairs_(gpu, cos.to(Device::Cuda), sin.to(Device::Cuda), 40, interleaved);
    EXPECT_LT(gap_to_cpu(gpu, cpu), 4e-3) << interleaved;
    EXPECT_GT(relative_l2(cpu, x), 0.1);  // the rotation did something
  }
}

namespace {

// The patches and grid of an image: Kimi's from the fixture's reference, MiniMax's from tests/data/images (the
// transformers processor's, which the MiniMax reference embeds).
struct Patches {
  Tensor values;
  vision::VisionGrid grid;
};
Patches patches_of(const fs::path& file_path, const std::string& name) {
  auto file = SafetensorsFile::open(file_path.string());
  const TensorInfo& grid = file->tensors().at(name + ".grid");
  std::vector<int64_t> g(grid.nbytes / 8);
  std::memcpy(g.data(), grid.data, grid.nbytes);
  return {to_float32(file->tensors().at(name + ".pixel_values"), file), {g.at(0), g.at(1), g.at(2)}};
}

// Each image embedded by the tower on the GPU, against the reference: every row within bf16 accuracy.
void check_gpu_tower(const VisionEncoder& encoder, const std::string& fixture, const fs::path& patches_file) {
  auto file = SafetensorsFile::open((kFixtures / fixture / "vision_reference.safetensors").string());
  for (const char* name : {"rgb_97x61.png", "downscaled_203x151.jpg"}) {
    const Patches p = patches_of(patches_file, name);
    const Tensor got = encoder.embed(p.values, {p.grid});
    const Tensor want = to_float32(file->tensors().at(std::string(name) + ".embeddings"), file);
    const double worst = worst_row_error(got, want);
    std::printf("[ note ] %s, %s on the GPU: %lld rows, worst row's relative L2 distance from the float64 reference "
                "%.2g\n", fixture.c_str(), name, static_cast<long long>(got.dim(0)), worst);
    EXPECT_LT(worst, 4e-2) << fixture << " " << name;
  }
}

}  // namespace

TEST(CudaVisionTowers, MiniMaxAndKimiTowersOnTheGpuFollowTheReferences) {
  SPARROW_REQUIRE_GPU();
  if (!fs::exists(kImages / "rgb_97x61.png")) GTEST_SKIP() << "tests/data/images is not in this copy of the tree";
  for (const char* kimi : {"kimi_k3_vl", "kimi_k25_vision"})
    check_gpu_tower(*KimiK3VisionEncoder::load((kFixtures / kimi).string(), Device::Cuda), kimi,
                    kFixtures / kimi / "vision_reference.safetensors");
  check_gpu_tower(*MiniMaxM3VisionEncoder::load((kFixtures / "minimax_m3_vl").string(), Device::Cuda), "minimax_m3_vl",
                  kImages / "expected.safetensors");
}
