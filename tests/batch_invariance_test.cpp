// Batch invariance on the CPU (issue 29; tests/batch_invariance_util.h says what is checked): a request's
// tokens and log-probabilities are bitwise the same whatever else shares its steps. The CPU products run in
// fixed row tiles (kernels/cpu/reference_ops.cpp), attention, norms, the indexers and MoE work row by row,
// and KDA runs its exact token-serial recurrence, so nothing about a row's arithmetic depends on the batch:
// no mode is needed (tests/cuda/batch_invariance_gpu_test.cpp checks the GPU's batch-invariant mode).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "batch_invariance_util.h"
#include "lora_test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {
class BatchInvariance : public ::testing::TestWithParam<std::string> {};
}  // namespace

TEST_P(BatchInvariance, LogprobsAreTheSameAloneBatchedChunkedAndAfterAPrefixHit) {
  auto model = load_model((fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam()).string());
  const sparrow::testing::InvarianceReport report = sparrow::testing::batch_invariance_report(*model, 16);
  EXPECT_TRUE(report.invariant()) << report.batched << " batched, " << report.chunked << " chunked, "
                                  << report.prefix_hit << " after a prefix hit and " << report.scored
                                  << " scored sequences differ from their runs alone; first: " << report.first;
}

// With two LoRA adapters over every target (attention, indexers, shared and routed experts) mixed with the
// base model in every batch.
TEST_P(BatchInvariance, WithLoraAdaptersMixedInTheBatch) {
  const fs::path dir = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / GetParam();
  auto model = load_model(dir.string());
  const sparrow::testing::Adapter a = sparrow::testing::make_adapter(dir, 8, 61), b = sparrow::testing::make_adapter(dir, 4, 62);
  const sparrow::testing::InvarianceReport report = sparrow::testing::batch_invariance_report(
      *model, 16, {load_lora_adapter("a", a.dir(), dir.string(), Device::Cpu, 16),
                   load_lora_adapter("b", b.dir(), dir.string(), Device::Cpu, 16)});
  EXPECT_TRUE(report.invariant()) << report.batched << " batched, " << report.chunked << " chunked, "
                                  << report.prefix_hit << " after a prefix hit and " << report.scored
                                  << " scored sequences differ from their runs alone; first: " << report.first;
}

INSTANTIATE_TEST_SUITE_P(Families, BatchInvariance,
                         ::testing::Values("deepseek_v32", "kimi_linear", "kimi_k3", "kimi_k3_1_pro", "minimax_m3"));
