// Kimi Linear and Kimi K3 through load_model: small random checkpoints (KDA + MLA layers, dense MLP
// and MoE) where a prefill followed by a chunked prefill and decodes equals one long prefill, both
// checkpoint layouts load to the same model, batched sequences do not interact, and bad configs give
// one-line errors. Agreement with transformers is checked on the committed fixtures
// (tests/fixtures/kimi_linear, kimi_k3) by reference_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/safetensors.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace {

// 4 layers: KDA, KDA, MLA, KDA (linear_attn_config is 1-indexed, as Kimi ships it), the first dense.
// The MoE fields use Kimi's own names (num_experts, ...), which KimiLinearConfig maps to its fields.
nlohmann::json tiny_kimi_linear() {
  return {{"model_type", "kimi_linear"},
          {"vocab_size", 60},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 2},
          {"kv_lora_rank", 16},
          {"q_lora_rank", nullptr},
          {"qk_nope_head_dim", 8},
          {"qk_rope_head_dim", 4},
          {"v_head_dim", 8},
          {"linear_attn_config",
           {{"head_dim", 8}, {"num_heads", 3}, {"short_conv_kernel_size", 4}, {"kda_layers", {1, 2, 4}},
            {"full_attn_layers", {3}}}},
          {"num_experts", 8},
          {"num_experts_per_token", 2},
          {"num_shared_experts", 1},
          {"num_expert_group", 2},
          {"topk_group", 1},
          {"moe_renormalize", true},
          {"routed_scaling_factor", 2.446},
          {"first_k_dense_replace", 1},
          {"rms_norm_eps", 1e-5},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

// Kimi K3: the same with a query LoRA and a DSA indexer (index_topk 5) on the MLA layer.
nlohmann::json tiny_kimi_k3() {
  nlohmann::json c = tiny_kimi_linear();
  c["model_type"] = "kimi_k3";
  c["q_lora_rank"] = 12;
  c["index_n_heads"] = 2;
  c["index_head_dim"] = 8;
  c["index_topk"] = 5;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  return c;
}

enum class Layout { Transformers, Kimi };  // what save_pretrained writes by default vs Kimi's release

void write_checkpoint(const TempDir& dir, const nlohmann::json& config, Layout layout) {
  dir.write("config.json", config.dump());
  const int64_t V = config["vocab_size"], H = config["hidden_size"], I = config["intermediate_size"];
  const int64_t MI = config["moe_intermediate_size"], E = config["num_experts"];
  const int64_t heads = config["num_attention_heads"], kvl = config["kv_lora_rank"];
  const int64_t nope = config["qk_nope_head_dim"], rope = config["qk_rope_head_dim"], v = config["v_head_dim"];
  const int64_t lh = config["linear_attn_config"]["num_heads"], ld = config["linear_attn_config"]["head_dim"];
  const int64_t kernel = config["linear_attn_config"]["short_conv_kernel_size"], P = lh * ld;
  const bool k3 = config["model_type"] == "kimi_k3";
  const bool kimi = layout == Layout::Kimi;
  std::mt19937 rng(11);
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
  add("lm_head.weight", {V, H}, 3.0f / std::sqrt(float(H)));
  for (int layer = 0; layer < 4; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".", a = p + "self_attn.";
    norm(p + "input_layernorm.weight", H);
    norm(p + "post_attention_layernorm.weight", H);
    if (layer != 2) {  // KDA
      linear(a + "q_proj.weight", P, H);
      linear(a + "k_proj.weight", P, H);
      linear(a + "v_proj.weight", P, H);
      if (kimi) {
        for (const char* c : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}) add(a + c, {P, 1, kernel}, 0.5f);
      } else {
        add(a + "conv1d.weight", {3 * P, 1, kernel}, 0.5f);
      }
      const std::string gate = kimi ? a : a + "forget_gate.";
      linear(gate + "f_a_proj.weight", ld, H);
      linear(gate + "f_b_proj.weight", P, ld);
      add(gate + "dt_bias", {P}, 1.0f, -2.0f);
      add(gate + "A_log", {1, 1, lh, 1}, 0.5f, 1.0f);
      linear(a + "b_proj.weight", lh, H);
      linear(a + "g_a_proj.weight", ld, H);
      linear(a + "g_b_proj.weight", P, ld);
      norm(a + "o_norm.weight", ld);
      linear(a + "o_proj.weight", H, P);
    } else {  // MLA (and K3's indexer)
      if (k3) {
        const int64_t ql = config["q_lora_rank"], ih = config["index_n_heads"], id = config["index_head_dim"];
        linear(a + "q_a_proj.weight", ql, H);
        norm(a + "q_a_layernorm.weight", ql);
        linear(a + "q_b_proj.weight", heads * (nope + rope), ql);
        linear(a + "indexer.wq_b.weight", ih * id, ql);
        linear(a + "indexer.wk.weight", id, H);
        norm(a + "indexer.k_norm.weight", id);
        add(a + "indexer.k_norm.bias", {id}, 0.1f);
        linear(a + "indexer.weights_proj.weight", ih, H);
      } else {
        linear(a + "q_proj.weight", heads * (nope + rope), H);
      }
      linear(a + "kv_a_proj_with_mqa.weight", kvl + rope, H);
      norm(a + "kv_a_layernorm.weight", kvl);
      linear(a + "kv_b_proj.weight", heads * (nope + v), kvl);
      linear(a + "o_proj.weight", H, heads * v);
    }
    const std::string f = p + (kimi ? "block_sparse_moe." : "mlp.");
    if (layer == 0) {
      linear(f + "gate_proj.weight", I, H);
      linear(f + "up_proj.weight", I, H);
      linear(f + "down_proj.weight", H, I);
    } else {
      linear(f + "gate.weight", E, H);
      add(f + "gate.e_score_correction_bias", {E}, 0.05f);
      add(f + "experts.gate_up_proj", {E, 2 * MI, H}, 1.0f / std::sqrt(float(H)));
      add(f + "experts.down_proj", {E, H, MI}, 1.0f / std::sqrt(float(MI)));
      if (kimi) {  // the same values, split per expert: w1 = gate rows, w3 = up rows, w2 = down
        const Tensor gate_up = tensors[tensors.size() - 2].second, down = tensors.back().second;
        tensors.resize(tensors.size() - 2);
        for (int64_t e = 0; e < E; ++e) {
          const std::string x = f + "experts." + std::to_string(e) + ".";
          tensors.emplace_back(x + "w1.weight", gate_up.rows(e, e + 1).reshape({2 * MI, H}).rows(0, MI).clone());
          tensors.emplace_back(x + "w3.weight", gate_up.rows(e, e + 1).reshape({2 * MI, H}).rows(MI, 2 * MI).clone());
          tensors.emplace_back(x + "w2.weight", down.rows(e, e + 1).reshape({H, MI}).clone());
        }
      }
      linear(f + "shared_experts.gate_proj.weight", MI, H);
      linear(f + "shared_experts.up_proj.weight", MI, H);
      linear(f + "shared_experts.down_proj.weight", H, MI);
    }
  }
  write_safetensors(dir.file("model.safetensors"), tensors);
}

std::vector<int32_t> prompt(int n, int vocab = 60) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n; ++i) tokens.push_back((i * 17 + 5 + i * i / 7) % vocab);
  return tokens;
}

// ||a - b|| / ||b||
double relative_error(const float* a, const float* b, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += double(a[i] - b[i]) * (a[i] - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// One prefill of `tokens`, then the same tokens as a prefill of 70 (two chunks, the second ragged),
// a chunked prefill of 3 continuing it, and single-token decodes: every row must agree.
void expect_steps_match_one_prefill(Model& model, const std::vector<int32_t>& tokens) {
  const int64_t V = model.vocab_size(), T = int64_t(tokens.size());
  SequenceState whole = sparrow::testing::new_sequence(model);
  const Tensor reference = sparrow::testing::run_step(model, make_batch({{&whole, tokens}}));
  ASSERT_EQ(reference.dim(0), T);

  SequenceState steps = sparrow::testing::new_sequence(model);
  int64_t done = 0;
  for (int64_t count : {int64_t(70), int64_t(3)}) {
    const Tensor part = sparrow::testing::run_step(model, 
        make_batch({{&steps, std::vector<int32_t>(tokens.begin() + done, tokens.begin() + done + count)}}));
    for (int64_t t = 0; t < count; ++t)
      EXPECT_LT(relative_error(part.row(t), reference.row(done + t), V), 1e-5) << "prefill row " << done + t;
    done += count;
  }
  for (; done < T; ++done) {
    const Tensor one = sparrow::testing::run_step(model, make_batch({{&steps, {tokens[done]}}}));
    EXPECT_LT(relative_error(one.row(0), reference.row(done), V), 1e-5) << "decode at " << done;
  }
  EXPECT_EQ(steps.length, T);
}

}  // namespace

TEST(KimiLinearModel, PrefillThenDecodeEqualsOneLongPrefill) {
  TempDir dir;
  write_checkpoint(dir, tiny_kimi_linear(), Layout::Transformers);
  std::unique_ptr<Model> model = load_model(dir.path());
  EXPECT_EQ(model->model_type(), "kimi_linear");
  expect_steps_match_one_prefill(*model, prompt(90));
}

TEST(KimiK3Model, PrefillThenDecodeEqualsOneLongPrefill) {
  TempDir dir;
  write_checkpoint(dir, tiny_kimi_k3(), Layout::Transformers);
  std::unique_ptr<Model> model = load_model(dir.path());
  EXPECT_EQ(model->model_type(), "kimi_k3");
  expect_steps_match_one_prefill(*model, prompt(90));
}

TEST(KimiK3Model, TheIndexerRestrictsTheFullAttentionLayers) {
  // Same weights, a budget wide enough to see everything: identical until more than index_topk = 5
  // keys are visible, different afterwards.
  TempDir sparse_dir, dense_dir;
  nlohmann::json wide = tiny_kimi_k3();
  wide["index_topk"] = 1000;
  write_checkpoint(sparse_dir, tiny_kimi_k3(), Layout::Transformers);
  write_checkpoint(dense_dir, wide, Layout::Transformers);
  std::unique_ptr<Model> sparse = load_model(sparse_dir.path()), dense = load_model(dense_dir.path());
  const std::vector<int32_t> tokens = prompt(20);
  SequenceState a = sparrow::testing::new_sequence(*sparse), b = sparrow::testing::new_sequence(*dense);
  const Tensor ls = sparrow::testing::run_step(*sparse, make_batch({{&a, tokens}})), ld = sparrow::testing::run_step(*dense, make_batch({{&b, tokens}}));
  const int64_t V = sparse->vocab_size();
  for (int64_t t = 0; t < 5; ++t) EXPECT_LT(relative_error(ls.row(t), ld.row(t), V), 1e-6) << t;
  EXPECT_GT(relative_error(ls.row(19), ld.row(19), V), 1e-3);
}

TEST(KimiLinearModel, BothCheckpointLayoutsLoadTheSameModel) {
  // Kimi's release (block_sparse_moe, experts.N.w1/w2/w3, separate q/k/v convs, forget gate on
  // self_attn) and transformers' names hold the same random draws in the same order.
  for (const nlohmann::json& config : {tiny_kimi_linear(), tiny_kimi_k3()}) {
    TempDir hf_dir, kimi_dir;
    write_checkpoint(hf_dir, config, Layout::Transformers);
    write_checkpoint(kimi_dir, config, Layout::Kimi);
    std::unique_ptr<Model> hf = load_model(hf_dir.path()), kimi = load_model(kimi_dir.path());
    const std::vector<int32_t> tokens = prompt(12);
    SequenceState a = sparrow::testing::new_sequence(*hf), b = sparrow::testing::new_sequence(*kimi);
    const Tensor la = sparrow::testing::run_step(*hf, make_batch({{&a, tokens}})), lb = sparrow::testing::run_step(*kimi, make_batch({{&b, tokens}}));
    for (int64_t i = 0; i < la.numel(); ++i) ASSERT_EQ(la.data()[i], lb.data()[i]) << config["model_type"] << " " << i;
  }
}

TEST(KimiLinearModel, SequencesInOneBatchDoNotInteract) {
  TempDir dir;
  write_checkpoint(dir, tiny_kimi_k3(), Layout::Transformers);
  std::unique_ptr<Model> model = load_model(dir.path());
  const int64_t V = model->vocab_size();
  const std::vector<int32_t> a = prompt(70), b = prompt(11);

  SequenceState alone_a = sparrow::testing::new_sequence(*model), alone_b = sparrow::testing::new_sequence(*model);
  const Tensor ra = sparrow::testing::run_step(*model, make_batch({{&alone_a, a}}));
  const Tensor rb = sparrow::testing::run_step(*model, make_batch({{&alone_b, b}}));

  // b is ahead by 10 tokens: a 70-token prefill and a 1-token decode share the step.
  SequenceState sa = sparrow::testing::new_sequence(*model), sb = sparrow::testing::new_sequence(*model);
  sparrow::testing::run_step(*model, make_batch({{&sb, std::vector<int32_t>(b.begin(), b.begin() + 10)}}));
  const Tensor both = sparrow::testing::run_step(*model, make_batch({{&sa, a}, {&sb, {b[10]}}}));
  for (int64_t t = 0; t < 70; ++t) EXPECT_LT(relative_error(both.row(t), ra.row(t), V), 1e-5) << "a " << t;
  EXPECT_LT(relative_error(both.row(70), rb.row(10), V), 1e-5);
}

TEST(KimiLinearModel, LayerTypesFollowKimiLinearConfig) {
  // layer_types takes precedence over linear_attn_config's lists; with neither, layer 4 (0-indexed)
  // would be the only full-attention layer of 4, so the MLA weights at layer 2 are left over.
  auto load_with = [](nlohmann::json config) {
    TempDir dir;
    write_checkpoint(dir, config, Layout::Transformers);
    return error_message([&] { load_model(dir.path()); });
  };
  nlohmann::json explicit_types = tiny_kimi_linear();
  explicit_types["layer_types"] = {"linear_attention", "linear_attention", "full_attention", "linear_attention"};
  explicit_types["linear_attn_config"]["full_attn_layers"] = {1};
  explicit_types["linear_attn_config"]["kda_layers"] = {2, 3, 4};
  EXPECT_EQ(load_with(explicit_types), "");

  nlohmann::json no_lists = tiny_kimi_linear();
  no_lists["linear_attn_config"].erase("full_attn_layers");
  EXPECT_TRUE(mentions(load_with(no_lists), {"missing tensor", "layers.2.self_attn"}));
}

TEST(KimiLinearModel, UnsupportedConfigsGiveOneLineErrors) {
  // The checkpoint is written for `config`, then its config.json changed.
  auto load_with = [](nlohmann::json config, const std::string& key, const nlohmann::json& value) {
    TempDir dir;
    write_checkpoint(dir, config, Layout::Transformers);
    config[key] = value;
    dir.write("config.json", config.dump());
    return error_message([&] { load_model(dir.path()); });
  };
  const nlohmann::json linear = tiny_kimi_linear(), k3 = tiny_kimi_k3();
  EXPECT_TRUE(mentions(load_with(linear, "hidden_act", "gelu"), {"hidden_act", "gelu"}));
  EXPECT_TRUE(mentions(load_with(linear, "moe_router_activation_func", "softmax"), {"moe_router_activation_func"}));
  EXPECT_TRUE(mentions(load_with(linear, "mla_use_nope", false), {"mla_use_nope"}));
  EXPECT_TRUE(mentions(load_with(linear, "num_key_value_heads", 1), {"num_key_value_heads"}));
  EXPECT_TRUE(mentions(load_with(linear, "num_expert_group", 3), {"num_expert_group"}));
  EXPECT_TRUE(mentions(load_with(linear, "layer_types", {"linear_attention", "sliding_attention", "full_attention",
                                                         "linear_attention"}),
                       {"layer_types", "sliding_attention"}));
  EXPECT_TRUE(mentions(load_with(linear, "mlp_layer_types", {"dense", "dense"}), {"mlp_layer_types"}));
  EXPECT_TRUE(mentions(load_with(k3, "q_lora_rank", nullptr), {"q_lora_rank", "kimi_k3"}));
  nlohmann::json gap = linear["linear_attn_config"];
  gap["kda_layers"] = {1, 2};
  EXPECT_TRUE(mentions(load_with(linear, "linear_attn_config", gap), {"layer 4"}));
  // A config that disagrees with the tensors names the tensor.
  nlohmann::json wider = linear["linear_attn_config"];
  wider["head_dim"] = 16;
  EXPECT_TRUE(mentions(load_with(linear, "linear_attn_config", wider), {"layers.0.self_attn.q_proj.weight", "shape"}));
}
