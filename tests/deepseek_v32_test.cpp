// DeepSeek-V3.2: the DSA indexer's scores and selection on hand-computed cases, the MLA softmax scale,
// and a small random checkpoint run through load_model: prefill followed by decodes equals one long
// prefill, sequences batched together do not interact, and bad configs give one-line errors.
// Agreement with transformers is checked on the committed fixtures by reference_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "model/dsa_indexer.h"
#include "model/mla.h"
#include "model/model.h"
#include "runner/dense_sequence_cache.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace {

Tensor matrix(int64_t rows, int64_t cols, std::vector<float> values) {
  Tensor t = Tensor::empty({rows, cols});
  std::copy(values.begin(), values.end(), t.data());
  return t;
}

// A rotation by angle 0 at every position: the identity, so hand computations need no cos/sin.
Rope identity_rope(int rot_dim) {
  Rope rope;
  rope.inv_freq.assign(rot_dim / 2, 0.0f);
  return rope;
}

// One head-weighted indexer with hidden 3, one query input and head_dim 3 whose keys depend only on
// the direction of x: with k_norm = LayerNorm (weight 1, bias 0),
//   x = [1, 0, 0] -> k = [√2, -1/√2, -1/√2]   (kind A)
//   x = [0, 1, 0] -> k = [-1/√2, √2, -1/√2]   (kind B)
//   x = [1, 1, 0] -> k = [1/√2, 1/√2, -√2]    (kind C)
// and every query is q = [1, 0, 0], so a key's score is w * relu(k[0] / √3): A > C > B = 0.
DsaIndexer hand_indexer(int64_t topk) {
  DsaIndexer indexer;
  indexer.options.hidden = 3;
  indexer.options.query_input = 1;
  indexer.options.num_heads = 1;
  indexer.options.head_dim = 3;
  indexer.options.topk = topk;
  indexer.options.rope = identity_rope(2);
  indexer.wq_b = matrix(3, 1, {1, 0, 0});
  indexer.wk = matrix(3, 3, {1, 0, 0, 0, 1, 0, 0, 0, 1});
  indexer.k_norm_weight = matrix(1, 3, {1, 1, 1}).reshape({3});
  indexer.k_norm_bias = Tensor::zeros({3});
  indexer.weights_proj = matrix(1, 3, {1, 1, 1});
  return indexer;
}

Tensor hand_inputs(const std::string& kinds) {
  Tensor x = Tensor::zeros({int64_t(kinds.size()), 3});
  for (size_t t = 0; t < kinds.size(); ++t) {
    if (kinds[t] != 'B') x.row(t)[0] = 1;
    if (kinds[t] != 'A') x.row(t)[1] = 1;
  }
  return x;
}

}  // namespace

TEST(DeepseekV32Indexer, ScoreIsTheWeightedSumOfReluHeadScores) {
  const cpu::DsaShape shape{/*heads=*/2, /*head_dim=*/2, /*topk=*/4};
  const float query[] = {1, 0, /* head 1 */ 0, 1};
  const float weights[] = {1.0f, -0.5f};
  const float keys[] = {2, 0, 0, 2, 1, 1, -1, -1};
  // head 0: q·k = [2, 0, 1, -1], head 1: [0, 2, 1, -1]; relu(· / √2) weighted 1 and -0.5.
  const float s = 1.0f / std::sqrt(2.0f);
  std::vector<float> expected = {2 * s, -s, 0.5f * s, 0.0f};
  std::vector<float> got = cpu::dsa_scores(shape, query, weights, keys, 4);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-6) << i;
}

TEST(DeepseekV32Indexer, SelectsTheTopKeysOnceMoreThanTopkAreVisible) {
  DsaIndexer indexer = hand_indexer(2);
  const std::string kinds = "BACBA";
  Tensor x = hand_inputs(kinds);
  Tensor q_resid = Tensor::empty({5, 1});
  for (int64_t t = 0; t < 5; ++t) q_resid.row(t)[0] = 1;

  const std::vector<LayerCacheSpec> spec = {{{indexer.options.cache_page()}, {}}};
  SequenceState state = standalone_sequence(spec);
  Batch batch = make_batch({{&state, {0, 0, 0, 0, 0}}});
  // Each row of the int32 [T, topk] table: positions ascending, then -1.
  auto row = [](const Tensor& table, int64_t r) {
    return std::vector<int32_t>(table.as<int32_t>() + r * table.dim(1), table.as<int32_t>() + (r + 1) * table.dim(1));
  };
  const Tensor sel = indexer.select(x, q_resid, batch, 0);
  ASSERT_EQ(sel.shape(), (std::vector<int64_t>{5, 2}));
  // Tokens 0 and 1 see no more than topk keys: their whole prefix.
  EXPECT_EQ(row(sel, 0), (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(row(sel, 1), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(row(sel, 2), (std::vector<int32_t>{1, 2}));  // B0 A1 C2      -> A1, C2
  EXPECT_EQ(row(sel, 3), (std::vector<int32_t>{1, 2}));  // B0 A1 C2 B3   -> A1, C2
  EXPECT_EQ(row(sel, 4), (std::vector<int32_t>{1, 4}));  // ... B3 A4     -> A1, A4
  std::vector<float> keys(5 * 3);
  state.cache->read(0, PageKind::DsaIndexKey, 0, 5, keys.data());
  EXPECT_NEAR(keys[3], std::sqrt(2.0f), 1e-4);  // token 1 is kind A

  // The same tokens one step at a time select the same keys from the cache.
  SequenceState stepwise = standalone_sequence(spec);
  for (int64_t t = 0; t < 5; ++t) {
    Batch step = make_batch({{&stepwise, {0}}});
    const Tensor one = indexer.select(x.rows(t, t + 1), q_resid.rows(t, t + 1), step, 0);
    EXPECT_EQ(row(one, 0), row(sel, t)) << "token " << t;
    stepwise.length += 1;
  }
  std::vector<float> stepwise_keys(5 * 3);
  stepwise.cache->read(0, PageKind::DsaIndexKey, 0, 5, stepwise_keys.data());
  EXPECT_EQ(stepwise_keys, keys);
}

TEST(DeepseekV32Mla, SoftmaxScaleFollowsYarnApplyMscale) {
  EXPECT_FLOAT_EQ(mla_softmax_scale(192, nlohmann::json{{"rope_type", "default"}, {"rope_theta", 1e4}}),
                  1.0f / std::sqrt(192.0f));
  // DeepSeek-V3.2's YaRN: factor 40, mscale_all_dim 1 -> (0.1 ln 40 + 1)^2 / √192.
  nlohmann::json yarn = {{"rope_type", "yarn"}, {"factor", 40}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_FLOAT_EQ(mla_softmax_scale(192, yarn), float(mscale * mscale / std::sqrt(192.0)));
  // Without mscale_all_dim the scale stays plain.
  yarn.erase("mscale_all_dim");
  EXPECT_FLOAT_EQ(mla_softmax_scale(192, yarn), 1.0f / std::sqrt(192.0f));
}

namespace {

// A tiny DeepSeek-V3.2 checkpoint with random weights: 3 layers (dense, MoE, MoE), index_topk 4 so
// that a prompt of a dozen tokens exercises the sparse selection.
nlohmann::json tiny_config() {
  return {{"model_type", "deepseek_v32"},
          {"vocab_size", 50},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 4},
          {"n_shared_experts", 1},
          {"n_routed_experts", 8},
          {"n_group", 2},
          {"topk_group", 1},
          {"num_experts_per_tok", 2},
          {"routed_scaling_factor", 2.5},
          {"kv_lora_rank", 16},
          {"q_lora_rank", 24},
          {"qk_rope_head_dim", 8},
          {"qk_nope_head_dim", 8},
          {"v_head_dim", 12},
          {"first_k_dense_replace", 1},
          {"index_topk", 4},
          {"index_head_dim", 16},
          {"index_n_heads", 4},
          {"max_position_embeddings", 128},
          {"rms_norm_eps", 1e-6},
          {"hidden_act", "silu"},
          {"attention_bias", true},
          {"tie_word_embeddings", false},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
}

// Writes `config_json` as config.json and random tensors shaped by tiny_config(), so a test may make
// the config disagree with the weights.
void write_tiny_checkpoint(const TempDir& dir, const nlohmann::json& config_json) {
  dir.write("config.json", config_json.dump());
  const nlohmann::json config = tiny_config();
  const int64_t V = config["vocab_size"], H = config["hidden_size"], I = config["intermediate_size"];
  const int64_t MI = config["moe_intermediate_size"], E = config["n_routed_experts"];
  const int64_t heads = config["num_attention_heads"], ql = config["q_lora_rank"], kvl = config["kv_lora_rank"];
  const int64_t nope = config["qk_nope_head_dim"], rope = config["qk_rope_head_dim"], v = config["v_head_dim"];
  const int64_t ih = config["index_n_heads"], id = config["index_head_dim"];
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::pair<std::string, Tensor>> tensors;
  auto add = [&](const std::string& name, Shape shape, float scale, float offset = 0.0f) {
    Tensor t = Tensor::empty(shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = offset + scale * normal(rng);
    tensors.emplace_back(name, t);
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, 1.0f / std::sqrt(float(in)));
  };
  auto norm = [&](const std::string& name, int64_t n) { add(name, {n}, 0.1f, 1.0f); };
  add("model.embed_tokens.weight", {V, H}, 1.0f);
  norm("model.norm.weight", H);
  linear("lm_head.weight", V, H);
  for (int layer = 0; layer < 3; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    norm(p + "input_layernorm.weight", H);
    norm(p + "post_attention_layernorm.weight", H);
    const std::string a = p + "self_attn.";
    linear(a + "q_a_proj.weight", ql, H);
    add(a + "q_a_proj.bias", {ql}, 0.1f);
    norm(a + "q_a_layernorm.weight", ql);
    linear(a + "q_b_proj.weight", heads * (nope + rope), ql);
    linear(a + "kv_a_proj_with_mqa.weight", kvl + rope, H);
    add(a + "kv_a_proj_with_mqa.bias", {kvl + rope}, 0.1f);
    norm(a + "kv_a_layernorm.weight", kvl);
    linear(a + "kv_b_proj.weight", heads * (nope + v), kvl);
    linear(a + "o_proj.weight", H, heads * v);
    add(a + "o_proj.bias", {H}, 0.1f);
    linear(a + "indexer.wq_b.weight", ih * id, ql);
    linear(a + "indexer.wk.weight", id, H);
    norm(a + "indexer.k_norm.weight", id);
    add(a + "indexer.k_norm.bias", {id}, 0.1f);
    linear(a + "indexer.weights_proj.weight", ih, H);
    if (layer == 0) {
      linear(p + "mlp.gate_proj.weight", I, H);
      linear(p + "mlp.up_proj.weight", I, H);
      linear(p + "mlp.down_proj.weight", H, I);
    } else {
      linear(p + "mlp.gate.weight", E, H);
      add(p + "mlp.gate.e_score_correction_bias", {E}, 0.05f);
      add(p + "mlp.experts.gate_up_proj", {E, 2 * MI, H}, 1.0f / std::sqrt(float(H)));
      add(p + "mlp.experts.down_proj", {E, H, MI}, 1.0f / std::sqrt(float(MI)));
      linear(p + "mlp.shared_experts.gate_proj.weight", MI, H);
      linear(p + "mlp.shared_experts.up_proj.weight", MI, H);
      linear(p + "mlp.shared_experts.down_proj.weight", H, MI);
    }
  }
  // A multi-token-prediction layer, which the causal LM ignores.
  norm("model.layers.3.enorm.weight", H);
  write_safetensors(dir.file("model.safetensors"), tensors);
}

std::vector<int32_t> prompt(int n) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n; ++i) tokens.push_back((i * 17 + 5) % 50);
  return tokens;
}

double relative_error(const float* a, const float* b, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += double(a[i] - b[i]) * (a[i] - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace

TEST(DeepseekV32Model, PrefillThenDecodeEqualsOneLongPrefill) {
  TempDir dir;
  write_tiny_checkpoint(dir, tiny_config());
  std::unique_ptr<Model> model = load_model(dir.path());
  const int64_t V = model->vocab_size();
  const std::vector<int32_t> tokens = prompt(12);

  SequenceState whole = sparrow::testing::new_sequence(*model);
  Tensor reference = sparrow::testing::run_step(*model, make_batch({{&whole, tokens}}));
  ASSERT_EQ(reference.dim(0), 12);

  SequenceState steps = sparrow::testing::new_sequence(*model);
  Tensor first = sparrow::testing::run_step(*model, make_batch({{&steps, std::vector<int32_t>(tokens.begin(), tokens.begin() + 5)}}));
  for (int64_t t = 0; t < 5; ++t) EXPECT_LT(relative_error(first.row(t), reference.row(t), V), 1e-5) << t;
  for (int64_t t = 5; t < 12; ++t) {
    Tensor one = sparrow::testing::run_step(*model, make_batch({{&steps, {tokens[t]}}}));
    EXPECT_LT(relative_error(one.row(0), reference.row(t), V), 1e-5) << "decode at " << t;
  }
  EXPECT_EQ(steps.length, 12);
}

TEST(DeepseekV32Model, SequencesInOneBatchDoNotInteract) {
  TempDir dir;
  write_tiny_checkpoint(dir, tiny_config());
  std::unique_ptr<Model> model = load_model(dir.path());
  const int64_t V = model->vocab_size();
  const std::vector<int32_t> a = prompt(9), b = prompt(11);

  SequenceState alone_a = sparrow::testing::new_sequence(*model), alone_b = sparrow::testing::new_sequence(*model);
  Tensor ra = sparrow::testing::run_step(*model, make_batch({{&alone_a, a}}));
  Tensor rb = sparrow::testing::run_step(*model, make_batch({{&alone_b, b}}));

  // b is ahead by 6 tokens before the shared batch: different cache lengths in one step.
  SequenceState sa = sparrow::testing::new_sequence(*model), sb = sparrow::testing::new_sequence(*model);
  sparrow::testing::run_step(*model, make_batch({{&sb, std::vector<int32_t>(b.begin(), b.begin() + 6)}}));
  Tensor both = sparrow::testing::run_step(*model, 
      make_batch({{&sa, a}, {&sb, std::vector<int32_t>(b.begin() + 6, b.end())}}));
  for (int64_t t = 0; t < 9; ++t) EXPECT_LT(relative_error(both.row(t), ra.row(t), V), 1e-5) << "a " << t;
  for (int64_t t = 0; t < 5; ++t) EXPECT_LT(relative_error(both.row(9 + t), rb.row(6 + t), V), 1e-5) << "b " << t;
}

TEST(DeepseekV32Model, UnsupportedConfigsGiveOneLineErrors) {
  auto load_with = [](const std::string& key, const nlohmann::json& value) {
    TempDir dir;
    nlohmann::json config = tiny_config();
    config[key] = value;
    write_tiny_checkpoint(dir, config);
    return error_message([&] { load_model(dir.path()); });
  };
  EXPECT_TRUE(mentions(load_with("hidden_act", "gelu"), {"hidden_act", "gelu"}));
  EXPECT_TRUE(mentions(load_with("q_lora_rank", nullptr), {"q_lora_rank"}));
  EXPECT_TRUE(mentions(load_with("num_key_value_heads", 2), {"num_key_value_heads"}));
  EXPECT_TRUE(mentions(load_with("n_group", 3), {"n_group"}));
  EXPECT_TRUE(mentions(load_with("layer_types", {"full_attention", "full_attention", "full_attention"}),
                       {"layer_types", "full_attention"}));
  // A config that disagrees with the tensors names the tensor.
  EXPECT_TRUE(mentions(load_with("index_head_dim", 32), {"indexer.wq_b.weight", "expected shape"}));
}
