#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/reference_ops.h"
#include "model/rope.h"

using namespace sparrow;

// Expected values printed by transformers 5.17 (ROPE_INIT_FUNCTIONS["yarn"] on a DeepseekV32Config
// with qk_rope_head_dim 16).
TEST(Rope, YarnMatchesTransformers) {
  auto params = nlohmann::json::parse(R"({"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":64,
      "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0,"rope_theta":10000.0})");
  Rope rope = Rope::from_config(params, 16, 512);
  const double expected[8] = {1.0, 0.23717081546783447, 0.04999999701976776, 0.007905694656074047,
                              0.0024999999441206455, 0.0007905694656074047, 0.0002500000118743628,
                              7.905694656074047e-05};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(rope.inv_freq[i], expected[i], 1e-6 * expected[i]) << i;
  EXPECT_FLOAT_EQ(rope.attention_scaling, 1.0f);

  auto deepseek = nlohmann::json::parse(R"({"rope_type":"yarn","factor":40.0,"original_max_position_embeddings":4096,
      "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":0.707,"rope_theta":10000.0})");
  Rope ds = Rope::from_config(deepseek, 16, 512);
  const double expected_ds[8] = {1.0, 0.3162277638912201, 0.10000000149011612, 0.023914724588394165,
                                 0.005124999675899744, 0.0008498621755279601, 2.499999936844688e-05,
                                 7.905694474175107e-06};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(ds.inv_freq[i], expected_ds[i], 1e-6 * expected_ds[i]) << i;
  EXPECT_NEAR(ds.attention_scaling, 1.0857263992561355, 1e-6);
}

TEST(Rope, DefaultFrequenciesAndRotation) {
  Rope rope = Rope::from_config(nlohmann::json{{"rope_theta", 100.0}}, 4, 128);
  EXPECT_FLOAT_EQ(rope.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(rope.inv_freq[1], 0.1f);
  float cos[2], sin[2];
  rope.angles(3, cos, sin);
  float x[4] = {1, 2, 3, 4};
  apply_rope_neox(x, cos, sin, 4);  // pairs (0, 2) and (1, 3)
  EXPECT_NEAR(x[0], 1 * std::cos(3.0f) - 3 * std::sin(3.0f), 1e-6);
  EXPECT_NEAR(x[2], 3 * std::cos(3.0f) + 1 * std::sin(3.0f), 1e-6);
  float y[4] = {1, 2, 3, 4};
  apply_rope_interleaved(y, cos, sin, 4);  // pairs (0, 1) and (2, 3), written as [evens', odds']
  EXPECT_NEAR(y[0], 1 * std::cos(3.0f) - 2 * std::sin(3.0f), 1e-6);
  EXPECT_NEAR(y[2], 2 * std::cos(3.0f) + 1 * std::sin(3.0f), 1e-6);
  EXPECT_NEAR(y[1], 3 * std::cos(0.3f) - 4 * std::sin(0.3f), 1e-6);
}

// A head narrower than the rotary dims (MiniMax-M3's indexer with index_head_dim < rotary dims):
// transformers slices cat(freqs, freqs) to the head, so with 3 frequencies and a head of 4 the table is
// [f0, f1, f2, f0] and rotate_half pairs (0, 2), (1, 3) over the whole head.
TEST(Rope, NarrowHeadTakesTheSlicedTable) {
  const float cos[3] = {0.9f, 0.8f, 0.7f}, sin[3] = {0.1f, 0.2f, 0.3f};
  float x[4] = {1, 2, 3, 4};
  cpu::apply_rope_neox_narrow_head(x, cos, sin, 4, 6);
  EXPECT_FLOAT_EQ(x[0], 1 * 0.9f - 3 * 0.1f);
  EXPECT_FLOAT_EQ(x[1], 2 * 0.8f - 4 * 0.2f);
  EXPECT_FLOAT_EQ(x[2], 3 * 0.7f + 1 * 0.3f);
  EXPECT_FLOAT_EQ(x[3], 4 * 0.9f + 2 * 0.1f);
  // A head as wide as the rotary dims is the plain NeoX rotation.
  float y[6] = {1, 2, 3, 4, 5, 6}, z[6] = {1, 2, 3, 4, 5, 6};
  cpu::apply_rope_neox_narrow_head(y, cos, sin, 6, 6);
  apply_rope_neox(z, cos, sin, 6);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(y[i], z[i]) << i;
}

TEST(Rope, RejectsUnknownTypes) {
  EXPECT_THROW(Rope::from_config(nlohmann::json{{"rope_type", "longrope"}}, 8, 128), Error);
  EXPECT_THROW(Rope::from_config(nlohmann::json{{"rope_type", "yarn"}, {"factor", 2.0}}, 8, 128), Error);
  EXPECT_THROW(Rope::from_config(nlohmann::json::object(), 7, 128), Error);
  // A type that is not a string is the same one-line error, not a JSON exception (found by fuzz_config).
  EXPECT_THROW(Rope::from_config(nlohmann::json{{"rope_type", 3}}, 8, 128), Error);
  EXPECT_THROW(Rope::from_config(nlohmann::json{{"type", {1}}}, 8, 128), Error);
}
