// Kimi Linear and the released Kimi K3 / K3.1 Pro through load_model. Kimi Linear: small random
// checkpoints (KDA + MLA layers, dense MLP and MoE) where a prefill followed by a chunked prefill and
// decodes equals one long prefill, both checkpoint layouts load to the same model, batched sequences do not
// interact, and bad configs give one-line errors. Kimi K3: the same on the committed release-layout
// fixtures (tests/fixtures/kimi_k3, kimi_k3_1_pro, from tools/kimi_k3_reference.py), the K3.1 Pro indexer
// restricting its MLA layers, the vision tower skipped, and K3 configs' errors. Agreement with the
// references (transformers; tools/kimi_k3_reference.py for K3) is checked by reference_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
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

enum class Layout { Transformers, Kimi };  // what save_pretrained writes by default vs Kimi's release

void write_checkpoint(const TempDir& dir, const nlohmann::json& config, Layout layout) {
  dir.write("config.json", config.dump());
  const int64_t V = config["vocab_size"], H = config["hidden_size"], I = config["intermediate_size"];
  const int64_t MI = config["moe_intermediate_size"], E = config["num_experts"];
  const int64_t heads = config["num_attention_heads"], kvl = config["kv_lora_rank"];
  const int64_t nope = config["qk_nope_head_dim"], rope = config["qk_rope_head_dim"], v = config["v_head_dim"];
  const int64_t lh = config["linear_attn_config"]["num_heads"], ld = config["linear_attn_config"]["head_dim"];
  const int64_t kernel = config["linear_attn_config"]["short_conv_kernel_size"], P = lh * ld;
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
    } else {  // MLA
      linear(a + "q_proj.weight", heads * (nope + rope), H);
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

// A 70-token prefill batched with the last token of a `b_length`-token sequence decoding: each equals the
// same sequence run alone.
void expect_batched_sequences_independent(Model& model, int b_length) {
  const int64_t V = model.vocab_size();
  const std::vector<int32_t> a = prompt(70, int(V)), b = prompt(b_length, int(V));
  SequenceState alone_a = sparrow::testing::new_sequence(model), alone_b = sparrow::testing::new_sequence(model);
  const Tensor ra = sparrow::testing::run_step(model, make_batch({{&alone_a, a}}));
  const Tensor rb = sparrow::testing::run_step(model, make_batch({{&alone_b, b}}));
  SequenceState sa = sparrow::testing::new_sequence(model), sb = sparrow::testing::new_sequence(model);
  sparrow::testing::run_step(model, make_batch({{&sb, std::vector<int32_t>(b.begin(), b.end() - 1)}}));
  const Tensor both = sparrow::testing::run_step(model, make_batch({{&sa, a}, {&sb, {b.back()}}}));
  for (int64_t t = 0; t < 70; ++t) EXPECT_LT(relative_error(both.row(t), ra.row(t), V), 1e-5) << "a " << t;
  EXPECT_LT(relative_error(both.row(70), rb.row(b_length - 1), V), 1e-5);
}

}  // namespace

TEST(KimiLinearModel, PrefillThenDecodeEqualsOneLongPrefill) {
  TempDir dir;
  write_checkpoint(dir, tiny_kimi_linear(), Layout::Transformers);
  std::unique_ptr<Model> model = load_model(dir.path());
  EXPECT_EQ(model->model_type(), "kimi_linear");
  expect_steps_match_one_prefill(*model, prompt(90));
}

TEST(KimiLinearModel, BothCheckpointLayoutsLoadTheSameModel) {
  // Kimi's release (block_sparse_moe, experts.N.w1/w2/w3, separate q/k/v convs, forget gate on
  // self_attn) and transformers' names hold the same random draws in the same order.
  for (const nlohmann::json& config : {tiny_kimi_linear()}) {
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
  write_checkpoint(dir, tiny_kimi_linear(), Layout::Transformers);
  std::unique_ptr<Model> model = load_model(dir.path());
  expect_batched_sequences_independent(*model, 11);
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
  const nlohmann::json linear = tiny_kimi_linear();
  EXPECT_TRUE(mentions(load_with(linear, "hidden_act", "gelu"), {"hidden_act", "gelu"}));
  EXPECT_TRUE(mentions(load_with(linear, "moe_router_activation_func", "softmax"), {"moe_router_activation_func"}));
  EXPECT_TRUE(mentions(load_with(linear, "mla_use_nope", false), {"mla_use_nope"}));
  EXPECT_TRUE(mentions(load_with(linear, "num_key_value_heads", 1), {"num_key_value_heads"}));
  EXPECT_TRUE(mentions(load_with(linear, "num_expert_group", 3), {"num_expert_group"}));
  EXPECT_TRUE(mentions(load_with(linear, "layer_types", {"linear_attention", "sliding_attention", "full_attention",
                                                         "linear_attention"}),
                       {"layer_types", "sliding_attention"}));
  EXPECT_TRUE(mentions(load_with(linear, "mlp_layer_types", {"dense", "dense"}), {"mlp_layer_types"}));
  // Kimi K3's fields are refused under model_type kimi_linear: transformers would run another network.
  EXPECT_TRUE(mentions(load_with(linear, "attn_res_block_size", 3), {"attn_res_block_size", "kimi_k3"}));
  EXPECT_TRUE(mentions(load_with(linear, "hidden_act", "situ"), {"hidden_act", "situ"}));
  nlohmann::json gap = linear["linear_attn_config"];
  gap["kda_layers"] = {1, 2};
  EXPECT_TRUE(mentions(load_with(linear, "linear_attn_config", gap), {"layer 4"}));
  // A config that disagrees with the tensors names the tensor.
  nlohmann::json wider = linear["linear_attn_config"];
  wider["head_dim"] = 16;
  EXPECT_TRUE(mentions(load_with(linear, "linear_attn_config", wider), {"layers.0.self_attn.q_proj.weight", "shape"}));
}

// ---- Kimi K3 and K3.1 Pro, on the release-layout fixtures -------------------------------------------------

namespace {

std::filesystem::path k3_fixture(const std::string& name) {
  return std::filesystem::path(SPARROW_SOURCE_DIR) / "tests/fixtures" / name;
}

// A copy of a K3 fixture's checkpoint whose text_config is changed by `edit` (and whose extra tensors, if
// any, sit in a second shard named by an index).
void copy_k3(const TempDir& dir, const std::string& fixture, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json config = nlohmann::json::parse(std::ifstream(k3_fixture(fixture) / "config.json"));
  edit(config["text_config"]);
  dir.write("config.json", config.dump());
  std::filesystem::copy_file(k3_fixture(fixture) / "model.safetensors", dir.file("model.safetensors"));
}

}  // namespace

TEST(KimiK3Model, PrefillThenDecodeEqualsOneLongPrefill) {
  for (const char* fixture : {"kimi_k3", "kimi_k3_1_pro"}) {
    SCOPED_TRACE(fixture);
    std::unique_ptr<Model> model = load_model(k3_fixture(fixture).string());
    EXPECT_EQ(model->model_type(), "kimi_k3");
    expect_steps_match_one_prefill(*model, prompt(90, int(model->vocab_size())));
  }
}

TEST(KimiK3Model, SequencesInOneBatchDoNotInteract) {
  std::unique_ptr<Model> model = load_model(k3_fixture("kimi_k3_1_pro").string());
  expect_batched_sequences_independent(*model, 30);
}

TEST(KimiK3Model, TheIndexerRestrictsTheMlaLayers) {
  // K3.1 Pro's weights with a budget that sees everything: identical while no more than index_topk keys
  // are visible, different once the indexer leaves some out.
  TempDir wide;
  copy_k3(wide, "kimi_k3_1_pro", [](nlohmann::json& text) { text["index_topk"] = 100000; });
  std::unique_ptr<Model> sparse = load_model(k3_fixture("kimi_k3_1_pro").string()), dense = load_model(wide.path());
  const int64_t V = sparse->vocab_size();
  const int64_t topk = nlohmann::json::parse(std::ifstream(k3_fixture("kimi_k3_1_pro") / "config.json"))["text_config"]["index_topk"];
  const std::vector<int32_t> tokens = prompt(int(topk) + 30, int(V));
  SequenceState a = sparrow::testing::new_sequence(*sparse), b = sparrow::testing::new_sequence(*dense);
  const Tensor ls = sparrow::testing::run_step(*sparse, make_batch({{&a, tokens}}));
  const Tensor ld = sparrow::testing::run_step(*dense, make_batch({{&b, tokens}}));
  for (int64_t t = 0; t < topk; ++t) EXPECT_LT(relative_error(ls.row(t), ld.row(t), V), 2e-5) << t;
  EXPECT_GT(relative_error(ls.row(topk + 29), ld.row(topk + 29), V), 1e-3);
}

TEST(KimiK3Model, TheTextModelLeavesTheVisionWeights) {
  // The release is multimodal: its vision tower and projector sit beside language_model.* and are the vision
  // loader's (tests/kimi_k3_vision_test.cpp); the text model reads around them (here, without a vision_config,
  // no tower loads at all).
  TempDir dir;
  copy_k3(dir, "kimi_k3", [](nlohmann::json&) {});
  write_safetensors(dir.file("vision.safetensors"),
                    {{"vision_tower.encoder.blocks.0.attn.qkv.weight", Tensor::zeros({4, 4})},
                     {"mm_projector.linear_1.weight", Tensor::zeros({4, 4})}});
  nlohmann::json index;
  std::unique_ptr<Model> text_only = load_model(k3_fixture("kimi_k3").string());
  const auto text_file = SafetensorsFile::open((k3_fixture("kimi_k3") / "model.safetensors").string());
  for (const auto& [name, info] : text_file->tensors())
    index["weight_map"][name] = "model.safetensors";
  index["weight_map"]["vision_tower.encoder.blocks.0.attn.qkv.weight"] = "vision.safetensors";
  index["weight_map"]["mm_projector.linear_1.weight"] = "vision.safetensors";
  dir.write("model.safetensors.index.json", index.dump());
  std::unique_ptr<Model> model = load_model(dir.path());
  EXPECT_EQ(model->vision(), nullptr);
  const std::vector<int32_t> tokens = prompt(12, int(model->vocab_size()));
  SequenceState a = sparrow::testing::new_sequence(*model), b = sparrow::testing::new_sequence(*text_only);
  const Tensor la = sparrow::testing::run_step(*model, make_batch({{&a, tokens}}));
  const Tensor lb = sparrow::testing::run_step(*text_only, make_batch({{&b, tokens}}));
  for (int64_t i = 0; i < la.numel(); ++i) ASSERT_EQ(la.data()[i], lb.data()[i]) << i;
}

TEST(KimiK3Model, UnsupportedConfigsGiveOneLineErrors) {
  auto load_with = [](const std::string& fixture, const std::function<void(nlohmann::json&)>& edit) {
    TempDir dir;
    copy_k3(dir, fixture, edit);
    return error_message([&] { load_model(dir.path()); });
  };
  EXPECT_TRUE(mentions(load_with("kimi_k3", [](nlohmann::json& t) { t["hidden_act"] = "gelu"; }), {"hidden_act", "gelu", "situ"}));
  EXPECT_TRUE(mentions(load_with("kimi_k3", [](nlohmann::json& t) { t["linear_attn_config"]["gate_lower_bound"] = 2.0; }),
                       {"gate_lower_bound", "negative"}));
  EXPECT_TRUE(mentions(load_with("kimi_k3_1_pro", [](nlohmann::json& t) { t["q_lora_rank"] = nullptr; }),
                       {"q_lora_rank", "index_topk"}));
  EXPECT_TRUE(mentions(load_with("kimi_k3_1_pro", [](nlohmann::json& t) { t["index_topk"] = 0; }), {"index_topk"}));
  // A K3 checkpoint declared without its indexer has weights nobody reads.
  EXPECT_TRUE(mentions(load_with("kimi_k3_1_pro", [](nlohmann::json& t) { t.erase("index_topk"); }),
                       {"unexpected tensor", "indexer"}));
  // Without AttnRes the per-sublayer queries are left over.
  EXPECT_TRUE(mentions(load_with("kimi_k3", [](nlohmann::json& t) { t["attn_res_block_size"] = nullptr; }),
                       {"unexpected tensor", "_res_"}));
  EXPECT_TRUE(mentions(load_with("kimi_k3", [](nlohmann::json& t) { t["routed_expert_hidden_size"] = 48; }),
                       {"routed_expert_down_proj", "shape"}));
}
