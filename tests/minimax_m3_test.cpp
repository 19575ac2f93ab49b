// MiniMax-M3: the MSA block selection rule, the indexer's pooling, and whole tiny models written as
// checkpoints (prefill/decode equivalence, batching, both weight layouts, config errors). Agreement with
// transformers itself is checked by the reference fixtures under tests/fixtures/minimax_m3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "formats/safetensors.h"
#include "model/model.h"
#include "model/msa_indexer.h"
#include "test_util.h"

using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;
using sparrow::cpu::select_blocks;

namespace {
std::vector<int32_t> sorted(std::vector<int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}
}  // namespace

// block_size 4, so the query at position 17 sits in block 4, which holds only keys 16 and 17.
TEST(MiniMaxM3BlockSelection, KeepsTheNewestBlockAndTheBestOlderOnes) {
  // The partial newest block scores worst but is forced; blocks 1 and 3 take the two other slots.
  EXPECT_EQ(select_blocks({0.5f, 2.0f, -1.0f, 1.5f, -9.0f}, 17, 4, 3, 1), (std::vector<int32_t>{4, 1, 3}));
  // Without local blocks the newest one competes like the others.
  EXPECT_EQ(select_blocks({0.5f, 2.0f, -1.0f, 1.5f, -9.0f}, 17, 4, 3, 0), (std::vector<int32_t>{1, 3, 0}));
  // Two local blocks: 4 and 3 are forced, one slot is left for block 1.
  EXPECT_EQ(select_blocks({0.5f, 2.0f, -1.0f, 1.5f, -9.0f}, 17, 4, 3, 2), (std::vector<int32_t>{3, 4, 1}));
}

TEST(MiniMaxM3BlockSelection, KeepsEverythingVisibleWhenWithinBudget) {
  EXPECT_EQ(sorted(select_blocks({-5.0f, 3.0f, 0.0f}, 9, 4, 3, 1)), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(select_blocks({7.0f}, 0, 4, 3, 1), (std::vector<int32_t>{0}));
}

TEST(MiniMaxM3BlockSelection, TiesGoToTheSmallerBlock) {
  EXPECT_EQ(select_blocks({1.0f, 1.0f, 1.0f, 1.0f, 0.0f}, 19, 4, 3, 1), (std::vector<int32_t>{4, 0, 1}));
}

TEST(MiniMaxM3BlockSelection, LocalBlocksClampAtTheFirstBlock) {
  // Query in block 1 with three local blocks: forced blocks are 1, 0, 0 -> just {0, 1}.
  EXPECT_EQ(sorted(select_blocks({-1.0f, -2.0f}, 5, 4, 3, 3)), (std::vector<int32_t>{0, 1}));
  // Two forced blocks fill a budget of two, however good block 0 is.
  EXPECT_EQ(sorted(select_blocks({5.0f, -1.0f, -2.0f, -3.0f}, 13, 4, 2, 2)), (std::vector<int32_t>{2, 3}));
}

// sparse_init_block (vLLM's MiniMaxM3 indexer, init blocks scored 1e30 and local ones 1e29): the first
// blocks are forced beside the newest, and when the budget cannot hold both the init blocks come first.
TEST(MiniMaxM3BlockSelection, InitBlocksAreForcedAndRankFirst) {
  // Block 0 scores worst of all but is an init block; block 4 is local; block 1 takes the last slot.
  EXPECT_EQ(select_blocks({-9.0f, 2.0f, -1.0f, 1.5f, -8.0f}, 17, 4, 3, 1, 1), (std::vector<int32_t>{0, 4, 1}));
  // Two init blocks and one local in a budget of two: the init blocks.
  EXPECT_EQ(select_blocks({-9.0f, -8.0f, 5.0f, 1.5f, -7.0f}, 17, 4, 2, 1, 2), (std::vector<int32_t>{0, 1}));
  // More init blocks than the query sees: every visible block, once.
  EXPECT_EQ(sorted(select_blocks({-1.0f, -2.0f}, 5, 4, 3, 1, 4)), (std::vector<int32_t>{0, 1}));
}

// One index head sees score = key[0], the other score = -key[0]. block_size 4, one kept block per query.
// Keys: block 0 scores 3, block 1 scores 0, block 2 holds key 8 (score 1) and key 9 (score 100).
TEST(MiniMaxM3Indexer, MaxPoolsOnlyTheKeysAQuerySees) {
  cpu::MsaSelectShape shape{/*heads=*/2, /*head_dim=*/2, /*block_size=*/4, /*topk_blocks=*/1, /*local_blocks=*/0};
  const float key_scores[10] = {3, 3, 3, 3, 0, 0, 0, 0, 1, 100};
  std::vector<float> keys;
  for (float s : key_scores) keys.insert(keys.end(), {s, 0.5f});
  // Queries at positions 5, 8, 9 (a prefill of positions 5..9; 6 and 7 are uninteresting).
  std::vector<float> queries;
  for (int i = 0; i < 5; ++i) queries.insert(queries.end(), {1.0f, 0.0f, -1.0f, 0.0f});
  std::vector<int32_t> table;
  auto select = [&] {
    table.assign(5 * shape.heads * shape.topk_blocks, 7);  // overwritten, -1 included
    cpu::msa_select(shape, queries.data(), 4, 5, 5, keys.data(), table.data());
  };
  // The kept blocks of one head for the query at `position`: msa_select's row, ascending, -1 after.
  auto kept = [&](int64_t head, int64_t position) {
    const int32_t* row = table.data() + ((position - 5) * shape.heads + head) * shape.topk_blocks;
    std::vector<int32_t> blocks(row, row + shape.topk_blocks);
    std::erase(blocks, -1);
    EXPECT_TRUE(std::is_sorted(blocks.begin(), blocks.end()));
    return blocks;
  };
  select();
  EXPECT_EQ(kept(0, 5), (std::vector<int32_t>{0}));
  EXPECT_EQ(kept(0, 8), (std::vector<int32_t>{0}));  // key 9 is in the future: block 2 scores 1, not 100
  EXPECT_EQ(kept(0, 9), (std::vector<int32_t>{2}));
  EXPECT_EQ(kept(1, 5), (std::vector<int32_t>{1}));  // -0 beats -3
  EXPECT_EQ(kept(1, 8), (std::vector<int32_t>{1}));  // -0 beats -1 and -3

  // With the newest block forced and a budget of two, position 8 keeps blocks 2 and 0 (listed ascending);
  // position 5 sees two blocks and keeps both; nothing else is listed.
  shape.topk_blocks = 2;
  shape.local_blocks = 1;
  select();
  EXPECT_EQ(kept(0, 8), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(kept(1, 8), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(kept(0, 5), (std::vector<int32_t>{0, 1}));
}

namespace {

// A tiny random MiniMax-M3 written as a checkpoint: 4 layers (dense attention, then MSA), dense and MoE
// feed-forwards, partial rotary, MSA blocks of 8 keys with 3 kept per query.
nlohmann::json tiny_text_config() {
  return nlohmann::json::parse(R"({
    "model_type": "minimax_m3_vl_text", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 8,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "dense_intermediate_size": 12, "shared_intermediate_size": 6, "num_local_experts": 4,
    "num_experts_per_tok": 2, "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 3.0,
    "index_n_heads": 2, "index_head_dim": 8, "index_block_size": 8, "index_topk_blocks": 3,
    "index_local_blocks": 1, "rms_norm_eps": 1e-6,
    "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})");
}

// transformers' tensor names and shapes for tiny_text_config() (MiniMaxM3VLForCausalLM).
std::vector<std::pair<std::string, Shape>> tiny_tensors() {
  std::vector<std::pair<std::string, Shape>> t = {
      {"model.embed_tokens.weight", {40, 32}}, {"model.norm.weight", {32}}, {"lm_head.weight", {40, 32}}};
  for (int i = 0; i < 4; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (auto [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {"input_layernorm.weight", {32}}, {"post_attention_layernorm.weight", {32}},
             {"self_attn.q_proj.weight", {32, 32}}, {"self_attn.k_proj.weight", {16, 32}},
             {"self_attn.v_proj.weight", {16, 32}}, {"self_attn.o_proj.weight", {32, 32}},
             {"self_attn.q_norm.weight", {8}}, {"self_attn.k_norm.weight", {8}}})
      t.push_back({p + name, shape});
    if (i > 0)
      for (auto [name, shape] : std::vector<std::pair<std::string, Shape>>{
               {"self_attn.indexer.q_proj.weight", {16, 32}}, {"self_attn.indexer.k_proj.weight", {8, 32}},
               {"self_attn.indexer.q_norm.weight", {8}}, {"self_attn.indexer.k_norm.weight", {8}}})
        t.push_back({p + name, shape});
    if (i == 0 || i == 3) {
      t.push_back({p + "mlp.gate_up_proj.weight", {24, 32}});
      t.push_back({p + "mlp.down_proj.weight", {32, 12}});
    } else {
      for (auto [name, shape] : std::vector<std::pair<std::string, Shape>>{
               {"mlp.gate.weight", {4, 32}}, {"mlp.gate.e_score_correction_bias", {4}},
               {"mlp.experts.gate_up_proj", {4, 16, 32}}, {"mlp.experts.down_proj", {4, 32, 8}},
               {"mlp.shared_experts.gate_up_proj.weight", {12, 32}}, {"mlp.shared_experts.down_proj.weight", {32, 6}}})
        t.push_back({p + name, shape});
    }
  }
  return t;
}

// Random weights scaled up (so attention is peaked and block selection matters), fixed seed.
std::vector<std::pair<std::string, Tensor>> tiny_weights() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& [name, shape] : tiny_tensors()) {
    Tensor t = Tensor::empty(shape);
    const float scale = shape.size() == 1 ? 0.3f : 1.5f / std::sqrt(float(shape.back()));
    for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = normal(rng) * scale;
    weights.push_back({name, t});
  }
  return weights;
}

void write_checkpoint(const TempDir& dir, const nlohmann::json& config,
                      const std::vector<std::pair<std::string, Tensor>>& weights) {
  dir.write("config.json", config.dump());
  write_safetensors(dir.file("model.safetensors"), weights);
}

// The same weights in MiniMax's release layout, as MiniMaxM3SparseForConditionalGeneration saves them.
std::vector<std::pair<std::string, Tensor>> to_release_layout(const std::vector<std::pair<std::string, Tensor>>& in) {
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    size_t at = s.find(from);
    return at == std::string::npos ? s : s.replace(at, from.size(), to);
  };
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [native, t] : in) {
    std::string name = native == "lm_head.weight" ? "language_model.lm_head.weight"
                                                  : replace(native, "model.", "language_model.model.");
    name = replace(replace(name, ".mlp.", ".block_sparse_moe."), "indexer.", "index_");
    name = replace(name, "gate.e_score_correction_bias", "e_score_correction_bias");
    // &t = t: clang before 16 cannot capture a structured binding (the sanitizer build uses clang).
    auto split = [&, &t = t](const std::string& fused, const char* first, const char* second) {
      const int64_t half = t.dim(0) / 2;
      out.push_back({replace(name, fused, first), t.rows(0, half).clone()});
      out.push_back({replace(name, fused, second), t.rows(half, 2 * half).clone()});
    };
    if (name.ends_with("experts.gate_up_proj")) {
      for (int64_t e = 0; e < t.dim(0); ++e) {
        Tensor expert = t.rows(e, e + 1).reshape({t.dim(1), t.dim(2)});
        const int64_t half = t.dim(1) / 2;
        const std::string prefix = replace(name, "gate_up_proj", std::to_string(e));
        out.push_back({prefix + ".w1.weight", expert.rows(0, half).clone()});
        out.push_back({prefix + ".w3.weight", expert.rows(half, 2 * half).clone()});
      }
    } else if (name.ends_with("experts.down_proj")) {
      for (int64_t e = 0; e < t.dim(0); ++e)
        out.push_back({replace(name, "down_proj", std::to_string(e) + ".w2.weight"),
                       t.rows(e, e + 1).reshape({t.dim(1), t.dim(2)}).clone()});
    } else if (name.ends_with("gate_up_proj.weight")) {
      split("gate_up_proj", "gate_proj", "up_proj");
    } else {
      out.push_back({name, t});
    }
  }
  return out;
}

std::vector<int32_t> tiny_prompt(int n, int seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = int32_t(rng() % 40);
  return tokens;
}

// Runs `tokens` through a fresh sequence in chunks of the given sizes (the last size repeats) and
// returns the logits of every token, [n, vocab].
Tensor run_in_chunks(Model& model, const std::vector<int32_t>& tokens, std::vector<int64_t> chunks) {
  SequenceState seq = sparrow::testing::new_sequence(model);
  Tensor all = Tensor::empty({int64_t(tokens.size()), model.vocab_size()});
  for (int64_t done = 0, c = 0; done < int64_t(tokens.size()); ++c) {
    const int64_t len = std::min(int64_t(tokens.size()) - done, chunks[std::min<size_t>(c, chunks.size() - 1)]);
    Tensor logits = sparrow::testing::run_step(model, make_batch({{&seq, {tokens.begin() + done, tokens.begin() + done + len}}}));
    std::copy(logits.data(), logits.data() + logits.numel(), all.row(done));
    done += len;
  }
  return all;
}

// max over rows of |a - b| / |b| (L2 per row).
double max_relative_error(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t i = 0; i < b.dim(0); ++i) {
    double err = 0, norm = 0;
    for (int64_t v = 0; v < b.dim(1); ++v) {
      err += std::pow(double(a.row(i)[v]) - b.row(i)[v], 2);
      norm += std::pow(double(b.row(i)[v]), 2);
    }
    worst = std::max(worst, std::sqrt(err / norm));
  }
  return worst;
}

}  // namespace

TEST(MiniMaxM3Model, PrefillThenDecodeEqualsOneLongPrefill) {
  TempDir dir;
  write_checkpoint(dir, tiny_text_config(), tiny_weights());
  auto model = load_model(dir.path());
  const std::vector<int32_t> tokens = tiny_prompt(70, 1);  // 9 blocks of 8: selection drops blocks
  Tensor once = run_in_chunks(*model, tokens, {70});
  EXPECT_LT(max_relative_error(run_in_chunks(*model, tokens, {50, 1}), once), 1e-5);
  EXPECT_LT(max_relative_error(run_in_chunks(*model, tokens, {5, 11, 1, 30}), once), 1e-5);
}

TEST(MiniMaxM3Model, BatchedSequencesMatchSeparateRuns) {
  TempDir dir;
  write_checkpoint(dir, tiny_text_config(), tiny_weights());
  auto model = load_model(dir.path());
  const std::vector<int32_t> a = tiny_prompt(45, 2), b = tiny_prompt(30, 3);
  Tensor a_alone = run_in_chunks(*model, a, {45}), b_alone = run_in_chunks(*model, b, {30});
  // b has a cached prefix of 20 when the two go through one batch.
  SequenceState sa = sparrow::testing::new_sequence(*model), sb = sparrow::testing::new_sequence(*model);
  sparrow::testing::run_step(*model, make_batch({{&sb, {b.begin(), b.begin() + 20}}}));
  Tensor both = sparrow::testing::run_step(*model, make_batch({{&sa, a}, {&sb, {b.begin() + 20, b.end()}}}));
  EXPECT_LT(max_relative_error(both.rows(0, 45), a_alone), 1e-5);
  EXPECT_LT(max_relative_error(both.rows(45, 55), b_alone.rows(20, 30)), 1e-5);
}

// Queries that see at most index_topk_blocks blocks attend densely; later ones lose blocks.
TEST(MiniMaxM3Model, SelectionOnlyMattersPastTheBudget) {
  TempDir sparse_dir, dense_dir;
  nlohmann::json config = tiny_text_config();
  write_checkpoint(sparse_dir, config, tiny_weights());
  config["index_topk_blocks"] = 1000;
  write_checkpoint(dense_dir, config, tiny_weights());
  const std::vector<int32_t> tokens = tiny_prompt(70, 4);
  Tensor sparse = run_in_chunks(*load_model(sparse_dir.path()), tokens, {70});
  Tensor dense = run_in_chunks(*load_model(dense_dir.path()), tokens, {70});
  EXPECT_LT(max_relative_error(sparse.rows(0, 24), dense.rows(0, 24)), 1e-6);  // 3 blocks of 8
  EXPECT_GT(max_relative_error(sparse.rows(24, 70), dense.rows(24, 70)), 1e-2);
}

TEST(MiniMaxM3Model, ReleaseLayoutOfAVisionLanguageCheckpointLoadsTheSameModel) {
  TempDir native_dir, release_dir;
  write_checkpoint(native_dir, tiny_text_config(), tiny_weights());
  nlohmann::json vl = {{"model_type", "minimax_m3_vl"}, {"text_config", tiny_text_config()}};
  vl["text_config"].erase("model_type");
  std::vector<std::pair<std::string, Tensor>> weights = to_release_layout(tiny_weights());
  weights.push_back({"vision_tower.vision_model.pre_layrnorm.weight", Tensor::zeros({4})});
  weights.push_back({"multi_modal_projector.linear_1.weight", Tensor::zeros({4, 4})});
  write_checkpoint(release_dir, vl, weights);
  const std::vector<int32_t> tokens = tiny_prompt(40, 5);
  Tensor native = run_in_chunks(*load_model(native_dir.path()), tokens, {40});
  Tensor release = run_in_chunks(*load_model(release_dir.path()), tokens, {40});
  EXPECT_EQ(max_relative_error(release, native), 0.0);
}

TEST(MiniMaxM3Config, LegacyFieldsMeanWhatTransformersReadsFromThem) {
  TempDir modern_dir, legacy_dir;
  write_checkpoint(modern_dir, tiny_text_config(), tiny_weights());
  nlohmann::json legacy = tiny_text_config();
  for (const char* key : {"index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
                          "index_local_blocks", "layer_types", "mlp_layer_types", "rope_parameters"})
    legacy.erase(key);
  legacy["sparse_attention_config"] = {{"sparse_num_index_heads", 2}, {"sparse_index_dim", 8},
                                       {"sparse_block_size", 8},      {"sparse_topk_blocks", 3},
                                       {"sparse_local_block", 1},     {"sparse_attention_freq", {0, 1, 1, 1}}};
  legacy["moe_layer_freq"] = {0, 1, 1, 0};
  legacy["rope_theta"] = 10000.0;
  legacy["partial_rotary_factor"] = 0.5;
  write_checkpoint(legacy_dir, legacy, tiny_weights());
  const std::vector<int32_t> tokens = tiny_prompt(40, 6);
  EXPECT_EQ(max_relative_error(run_in_chunks(*load_model(legacy_dir.path()), tokens, {40}),
                               run_in_chunks(*load_model(modern_dir.path()), tokens, {40})),
            0.0);
}

// sparse_init_block is read (vLLM forces the first blocks; the releases have 0): on a prompt beyond the
// block budget (5 blocks of 8, 3 kept), forcing block 0 changes what later queries see, and an explicit 0
// is the same model as none. A block score other than "max" is refused.
TEST(MiniMaxM3Config, SparseInitBlockIsRead) {
  auto logits_with = [](const nlohmann::json& sparse_extra) {
    TempDir dir;
    nlohmann::json config = tiny_text_config();
    for (const char* key : {"index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
                            "index_local_blocks", "layer_types"})
      config.erase(key);
    config["sparse_attention_config"] = {{"sparse_num_index_heads", 2}, {"sparse_index_dim", 8},
                                         {"sparse_block_size", 8},      {"sparse_topk_blocks", 3},
                                         {"sparse_local_block", 1},     {"sparse_attention_freq", {0, 1, 1, 1}}};
    config["sparse_attention_config"].update(sparse_extra);
    write_checkpoint(dir, config, tiny_weights());
    return run_in_chunks(*load_model(dir.path()), tiny_prompt(40, 7), {40});
  };
  const Tensor none = logits_with(nlohmann::json::object());
  EXPECT_EQ(max_relative_error(logits_with({{"sparse_init_block", 0}, {"sparse_score_type", "max"}}), none), 0.0);
  EXPECT_GT(max_relative_error(logits_with({{"sparse_init_block", 2}}), none), 1e-4);
  EXPECT_TRUE(mentions(error_message([&] { logits_with({{"sparse_score_type", "mean"}}); }), {"sparse_score_type"}));
  EXPECT_TRUE(mentions(error_message([&] { logits_with({{"sparse_init_block", -1}}); }), {"sparse_init_block"}));
}

TEST(MiniMaxM3Config, UnsupportedValuesAreOneLineErrors) {
  auto load_with = [](const std::string& key, const nlohmann::json& value) {
    TempDir dir;
    nlohmann::json config = tiny_text_config();
    config[key] = value;
    write_checkpoint(dir, config, tiny_weights());
    return error_message([&] { load_model(dir.path()); });
  };
  EXPECT_TRUE(mentions(
      load_with("layer_types", {"full_attention", "sliding_attention", "minimax_m3_sparse", "minimax_m3_sparse"}),
      {"layer_types entry", "sliding_attention"}));
  EXPECT_TRUE(mentions(load_with("mlp_layer_types", {"dense", "dense"}), {"mlp_layer_types"}));
  EXPECT_TRUE(mentions(load_with("index_head_dim", 3), {"index_head_dim", "even"}));
  EXPECT_TRUE(mentions(load_with("index_n_heads", 3), {"index_n_heads"}));
  EXPECT_TRUE(mentions(load_with("rope_parameters", {{"rope_type", "longrope"}}), {"longrope"}));
  EXPECT_TRUE(mentions(load_with("hidden_size", 16), {"embed_tokens", "shape"}));
}
