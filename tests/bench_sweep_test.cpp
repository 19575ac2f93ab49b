// Dummy weights (--load-format dummy), the decode roofline and `sparrow bench sweep`: the initialisation
// rules, every fixture family built from its config.json alone (finite, deterministic logits; the
// roofline's parameter count equals what the model took), the roofline against hand-computed cases, the
// real-dimension shape configs, a tokenizer-less dummy server answering token-id prompts, and a tiny sweep
// against a sparrow server the sweep launches itself.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "bench/roofline.h"
#include "bench/sweep.h"
#include "core/bfloat16.h"
#include "formats/checkpoint.h"
#include "formats/dummy_weights.h"
#include "kernels/cpu/fp8_codec.h"
#include "model/families.h"
#include "model/model.h"
#include "serve_process.h"
#include "test_util.h"

namespace sparrow {
namespace {

namespace fs = std::filesystem;
using testing::error_message;
using testing::mentions;
using testing::TempDir;

const fs::path kSource = fs::path(SPARROW_SOURCE_DIR);

std::string slurp(const std::string& path) { return test::read_text_file(path); }

// A folder holding only `fixture`'s config.json: nothing else to read.
std::string config_only(const TempDir& dir, const std::string& fixture) {
  fs::copy_file(kSource / "tests/fixtures" / fixture / "config.json", dir.file("config.json"));
  return dir.path();
}

// ---------------------------------------------------------------------------------------------------
// Dummy weights

TEST(DummyWeights, InitRulesFollowTheTensorsRole) {
  EXPECT_EQ(dummy_init("model.norm.weight", {64}, false).kind, DummyInit::Constant);
  EXPECT_EQ(dummy_init("model.norm.weight", {64}, false).value, 1.0f);
  EXPECT_EQ(dummy_init("model.layers.0.input_layernorm.weight", {64}, true).value, 0.0f);  // x̂ · (1 + w)
  EXPECT_EQ(dummy_init("x.indexer.k_norm.bias", {128}, false).value, 0.0f);
  EXPECT_EQ(dummy_init("x.self_attn.A_log", {1, 1, 4, 1}, false).kind, DummyInit::ALog);
  EXPECT_EQ(dummy_init("x.self_attn.dt_bias", {512}, false).kind, DummyInit::DtBias);
  const DummyInit matrix = dummy_init("x.q_proj.weight", {256, 1024}, false);
  EXPECT_EQ(matrix.kind, DummyInit::Uniform);
  EXPECT_NEAR(matrix.scale, std::sqrt(3.0 / 1024), 1e-7);  // std 1/sqrt(fan_in)
  EXPECT_NEAR(dummy_init("x.experts.down_proj", {8, 64, 32}, false).scale, std::sqrt(3.0 / 32), 1e-7);
  EXPECT_EQ(dummy_init("x.q_a_proj.bias", {16}, false).scale, 0.02f);

  // The drawn statistics: mean 0, std 1/sqrt(fan_in); gates and decays in their real ranges.
  const int64_t n = 1 << 16;
  std::vector<float> v(n);
  dummy_fill_f32(matrix, dummy_key(0, "w"), 0, n, v.data());
  double sum = 0, sq = 0;
  for (float x : v) sum += x, sq += double(x) * x;
  EXPECT_NEAR(sum / n, 0.0, 3e-4);
  EXPECT_NEAR(std::sqrt(sq / n), 1.0 / 32, 3e-4);
  dummy_fill_f32(dummy_init("A_log", {n}, false), dummy_key(0, "A_log"), 0, n, v.data());
  for (float x : v) ASSERT_TRUE(x >= 0.0f && x <= std::log(16.0f) + 1e-6f) << x;
  dummy_fill_f32(dummy_init("dt_bias", {n}, false), dummy_key(0, "dt_bias"), 0, n, v.data());
  for (float x : v) {
    const double dt = std::log1p(std::exp(double(x)));  // softplus
    ASSERT_TRUE(dt > 0.00099 && dt < 0.1001) << x;
  }
}

TEST(DummyWeights, ValuesArePureFunctionsOfSeedNameAndIndex) {
  const DummyInit init = dummy_init("w", {100, 100}, false);
  std::vector<float> whole(10000), part(1000), other(1000);
  dummy_fill_f32(init, dummy_key(7, "w"), 0, 10000, whole.data());
  dummy_fill_f32(init, dummy_key(7, "w"), 5000, 1000, part.data());  // a chunk equals the same range
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(part[i], whole[5000 + i]);
  dummy_fill_f32(init, dummy_key(8, "w"), 5000, 1000, other.data());
  EXPECT_NE(other, part);  // another seed
  dummy_fill_f32(init, dummy_key(7, "v"), 5000, 1000, other.data());
  EXPECT_NE(other, part);  // another name
  std::vector<uint16_t> bf16(1000);
  dummy_fill_bf16(init, dummy_key(7, "w"), 5000, 1000, bf16.data());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(bf16[i], float_to_bf16(part[i]));

  // FP8 codes of 448 u dequantise with scale a / 448 to the fp32 value, to E4M3's precision.
  std::vector<uint8_t> codes(1000);
  dummy_fill_e4m3(dummy_key(7, "w"), 5000, 1000, codes.data());
  for (int i = 0; i < 1000; ++i) {
    const float w = cpu::e4m3_to_float(codes[i]) * init.scale / 448.0f;
    ASSERT_NEAR(w, part[i], std::fabs(part[i]) / 16 + init.scale / 448.0f * 0.02f) << i;
  }

  // A tensor generated in one go equals its pieces.
  Tensor t = dummy_tensor(init, dummy_key(7, "w"), {100, 100}, ScalarType::F32, Device::Cpu);
  for (int i = 0; i < 10000; ++i) ASSERT_EQ(t.data()[i], whole[i]);
}

// Every family from config.json alone, with the loader load_model would pick (the registry's).
std::unique_ptr<DecoderModel> load_dummy(Checkpoint& ckpt) {
  const ModelFamily& family = model_family(ckpt.config());
  return family.load(ckpt, family.text(ckpt.config()), family.weight_prefix);
}

Tensor logits_of(Model& model, const std::vector<int32_t>& prompt) {
  SequenceState state = sparrow::testing::new_sequence(model);
  Batch prefill = make_batch({{&state, prompt}});
  Tensor logits = sparrow::testing::run_step(model, prefill);
  Batch decode = make_batch({{&state, {prompt[0]}}});  // one decode step on top
  Tensor last = sparrow::testing::run_step(model, decode);
  std::vector<float> all(logits.data(), logits.data() + logits.numel());
  all.insert(all.end(), last.data(), last.data() + last.numel());
  Tensor out = Tensor::empty({int64_t(all.size())});
  std::copy(all.begin(), all.end(), out.data());
  return out;
}

class DummyFamilies : public ::testing::TestWithParam<std::string> {};

// 24 token ids valid in any fixture's vocabulary.
std::vector<int32_t> small_prompt(const Model& model) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back(int32_t((i * 37 + 5) % std::min<int64_t>(model.vocab_size(), 200)));
  return prompt;
}

TEST_P(DummyFamilies, ConfigAloneGivesFiniteDeterministicLogits) {
  TempDir dir;
  const std::string path = config_only(dir, GetParam());
  LoadOptions dummy;
  dummy.load_format = "dummy";
  auto a = load_model(path, Device::Cpu, dummy);
  auto b = load_model(path, Device::Cpu, dummy);
  const std::vector<int32_t> prompt = small_prompt(*a);
  const Tensor la = logits_of(*a, prompt), lb = logits_of(*b, prompt);
  ASSERT_EQ(la.numel(), lb.numel());
  float lo = la.data()[0], hi = la.data()[0];
  for (int64_t i = 0; i < la.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(la.data()[i])) << "logit " << i;
    ASSERT_EQ(la.data()[i], lb.data()[i]) << "two dummy loads differ at " << i;
    lo = std::min(lo, la.data()[i]), hi = std::max(hi, la.data()[i]);
  }
  EXPECT_GT(hi - lo, 1e-3f) << "constant logits: the random weights do not reach the head";
  EXPECT_LT(hi - lo, 1e3f) << "exploding activations: the init scale is off";

  // Another seed, other weights.
  dummy.dummy_seed = 1;
  const Tensor lc = logits_of(*load_model(path, Device::Cpu, dummy), prompt);
  EXPECT_NE(std::vector<float>(la.data(), la.data() + la.numel()), std::vector<float>(lc.data(), lc.data() + lc.numel()));
}

TEST_P(DummyFamilies, RooflineCountsEveryTensorTheModelTakes) {
  TempDir dir;
  const std::string path = config_only(dir, GetParam());
  auto ckpt = Checkpoint::open_dummy(path);
  auto model = load_dummy(*ckpt);
  const bench::ModelCost cost = bench::model_cost(ckpt->config());
  EXPECT_EQ(cost.total_params, double(ckpt->dummy_params())) << GetParam();
  EXPECT_EQ(cost.mixers.size(), size_t(model->num_layers()));
}

// --moe-routing-simulation uniform_random reaches every family's MoE layers: their logits change, and stay
// deterministic.
TEST_P(DummyFamilies, RoutingSimulationReachesTheMoeLayers) {
  TempDir dir;
  const std::string path = config_only(dir, GetParam());
  LoadOptions options;
  options.load_format = "dummy";
  auto own = load_model(path, Device::Cpu, options);
  options.moe_routing_simulation = "uniform_random";
  auto a = load_model(path, Device::Cpu, options);
  auto b = load_model(path, Device::Cpu, options);
  const std::vector<int32_t> prompt = small_prompt(*a);
  const Tensor lo = logits_of(*own, prompt), la = logits_of(*a, prompt), lb = logits_of(*b, prompt);
  const auto values = [](const Tensor& t) { return std::vector<float>(t.data(), t.data() + t.numel()); };
  EXPECT_EQ(values(la), values(lb));
  EXPECT_NE(values(la), values(lo)) << GetParam() << ": the simulation did not reach a MoE layer";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DummyFamilies,
                         ::testing::Values("deepseek_v32", "kimi_linear", "kimi_k3", "kimi_k3_1_pro", "minimax_m3",
                                           "minimax_m3_vl"));

TEST(DummyWeights, LoadFormatFlagValues) {
  TempDir dir;
  const std::string path = config_only(dir, "minimax_m3");
  LoadOptions options;
  options.load_format = "pt";
  EXPECT_TRUE(mentions(error_message([&] { load_model(path, Device::Cpu, options); }), {"--load-format", "'pt'"}));
  options.load_format = "auto";  // the real loader wants the weights
  EXPECT_TRUE(mentions(error_message([&] { load_model(path, Device::Cpu, options); }), {"model.safetensors"}));
  TempDir empty;
  options.load_format = "dummy";
  EXPECT_TRUE(mentions(error_message([&] { load_model(empty.path(), Device::Cpu, options); }), {"config.json"}));
  options.moe_routing_simulation = "uniform";  // vLLM's name is uniform_random
  EXPECT_TRUE(mentions(error_message([&] { load_model(path, Device::Cpu, options); }),
                       {"--moe-routing-simulation", "uniform_random", "'uniform'"}));
}

// ---------------------------------------------------------------------------------------------------
// The roofline

TEST(Roofline, ExpectedDistinctExperts) {
  EXPECT_DOUBLE_EQ(bench::expected_distinct_experts(256, 8, 1), 8.0);
  EXPECT_NEAR(bench::expected_distinct_experts(256, 8, 2), 256 * (1 - std::pow(31.0 / 32, 2)), 1e-12);  // 15.75
  EXPECT_NEAR(bench::expected_distinct_experts(256, 8, 10000), 256.0, 1e-9);
  EXPECT_EQ(bench::expected_distinct_experts(0, 8, 4), 0.0);
  EXPECT_DOUBLE_EQ(bench::expected_distinct_experts(4, 4, 3), 4.0);  // every token takes every expert
}

TEST(Roofline, DecodeStepByHand) {
  bench::ModelCost m;
  m.dense_params = 5e8;
  m.dense_bytes = 1e9;
  m.moe_layers = 2;
  m.num_experts = 4;
  m.experts_per_token = 1;
  m.expert_params = 5e7;
  m.expert_bytes = 1e8;
  bench::MixerCost dense;  // full attention: every cached token
  dense.kind = "gqa";
  dense.kv_bytes_per_token = 1000;
  dense.flops_per_key = 100;
  bench::MixerCost sparse;  // DSA: top 2048 latents, every index key
  sparse.kind = "mla_dsa";
  sparse.kv_bytes_per_token = 656;
  sparse.index_bytes_per_token = 132;
  sparse.attended_limit = 2048;
  sparse.flops_per_key = 10;
  sparse.index_flops_per_key = 1;
  bench::MixerCost kda;
  kda.kind = "kda";
  kda.state_bytes = 5000;
  kda.state_flops = 7;
  m.mixers = {dense, sparse, kda};
  bench::HardwareLimits hw;
  hw.hbm_bytes_per_s = 1e12;
  hw.flops_per_s = 1e14;

  const bench::DecodeStep s = bench::decode_roofline(m, 2, 8192, hw);
  const double experts = 4 * (1 - 0.75 * 0.75);  // D(2) = 1.75
  EXPECT_DOUBLE_EQ(s.distinct_experts, experts);
  EXPECT_DOUBLE_EQ(s.weight_bytes, 1e9 + 2 * experts * 1e8);
  EXPECT_DOUBLE_EQ(s.kv_bytes, 2 * (8192 * 1000.0 + 2048 * 656.0 + 8192 * 132.0 + 5000));
  EXPECT_DOUBLE_EQ(s.bytes, s.weight_bytes + s.kv_bytes);
  EXPECT_DOUBLE_EQ(s.flops, 2 * (2 * (5e8 + 2 * 1 * 5e7) + 8192 * 100.0 + 2048 * 10.0 + 8192 * 1.0 + 7));
  EXPECT_FALSE(s.compute_bound);
  EXPECT_DOUBLE_EQ(s.seconds, s.bytes / 1e12);
  EXPECT_DOUBLE_EQ(s.tokens_per_s_per_user, 1 / s.seconds);
  EXPECT_DOUBLE_EQ(s.tokens_per_s_per_gpu, 2 / s.seconds);

  // A short context reads every cached token of the sparse layer too.
  EXPECT_DOUBLE_EQ(bench::decode_roofline(m, 1, 100, hw).kv_bytes, 100 * 1000.0 + 100 * 656.0 + 100 * 132.0 + 5000);

  // Enough sequences make the step compute-bound: time = FLOPs / peak.
  hw.flops_per_s = 1e12;
  const bench::DecodeStep big = bench::decode_roofline(m, 4096, 10, hw);
  EXPECT_TRUE(big.compute_bound);
  EXPECT_DOUBLE_EQ(big.seconds, big.flops / 1e12);
  EXPECT_TRUE(mentions(error_message([&] { bench::decode_roofline(m, 0, 10, hw); }), {"batch"}));

  // The serving limit: O decode steps plus B prompts' prefill over one cycle. A prompt of I = 3000 tokens:
  // 2 · P_active a token, the dense layer's causal Σ p keys, the sparse layer's min(p, 2048) latents and
  // Σ p index keys, the KDA update a token.
  const double I = 3000, O = 100;
  const double causal = I * (I + 1) / 2, capped = 2048.0 * 2049 / 2 + (I - 2048) * 2048;
  const double prefill = I * 2 * (5e8 + 2 * 1 * 5e7) + causal * 100 + capped * 10 + causal * 1 + I * 7;
  EXPECT_DOUBLE_EQ(bench::prefill_flops(m, I), prefill);
  hw.flops_per_s = 1e14;
  const bench::ServingCycle few = bench::serving_roofline(m, 2, I, O, hw);
  const bench::DecodeStep step = bench::decode_roofline(m, 2, I + O / 2, hw);
  EXPECT_DOUBLE_EQ(few.decode_bytes, O * step.bytes);
  EXPECT_DOUBLE_EQ(few.prefill_flops, 2 * prefill);
  EXPECT_DOUBLE_EQ(few.compute_seconds, (O * step.flops + 2 * prefill) / 1e14);
  EXPECT_FALSE(few.compute_bound);  // two users: the decode steps' reads bind
  EXPECT_DOUBLE_EQ(few.seconds, O * step.bytes / 1e12);
  EXPECT_DOUBLE_EQ(few.tokens_per_s_per_user, O / few.seconds);
  EXPECT_DOUBLE_EQ(few.total_tokens_per_s_per_gpu, 2 * (I + O) / few.seconds);
  // Many users: the prompts' FLOPs bind, below what the decode roofline alone allows.
  const bench::ServingCycle many = bench::serving_roofline(m, 4096, I, O, hw);
  EXPECT_TRUE(many.compute_bound);
  EXPECT_LT(many.tokens_per_s_per_user, bench::decode_roofline(m, 4096, I + O / 2, hw).tokens_per_s_per_user);
  EXPECT_TRUE(mentions(error_message([&] { bench::serving_roofline(m, 2, I, 0, hw); }), {"output length"}));
}

// Over several GPUs (roofline.h, ParallelLayout): each GPU's share of the weights, cache reads and FLOPs,
// and the collectives' time on the link, by hand for T = 2 inside one group and for two groups of one.
TEST(Roofline, ParallelLayoutsByHand) {
  bench::ModelCost m;
  m.dense_params = 5e8;
  m.dense_bytes = 1e9;
  m.replicated_params = 1e8;  // kept whole by every tensor-parallel rank
  m.replicated_bytes = 2e8;
  m.moe_layers = 2;
  m.num_experts = 4;
  m.experts_per_token = 1;
  m.expert_params = 5e7;
  m.expert_bytes = 1e8;
  m.hidden = 1000;
  m.vocab = 5000;
  bench::MixerCost gqa;  // 4 K/V heads: split by min(T, 4)
  gqa.kind = "gqa";
  gqa.heads = 8;
  gqa.kv_heads = 4;
  gqa.kv_bytes_per_token = 1000;
  gqa.flops_per_key = 100;
  bench::MixerCost mla;  // the latent and the DSA keys read whole by every rank; the heads split
  mla.kind = "mla_dsa";
  mla.heads = 8;
  mla.kv_bytes_per_token = 656;
  mla.index_bytes_per_token = 132;
  mla.attended_limit = 2048;
  mla.flops_per_key = 10;
  mla.index_flops_per_key = 1;
  m.mixers = {gqa, mla};
  bench::HardwareLimits hw;
  hw.hbm_bytes_per_s = 1e12;
  hw.flops_per_s = 1e14;
  hw.link_bytes_per_s = 1e11;
  hw.collective_latency_s = 1e-5;
  const double C = 8192, experts = 4 * (1 - 0.75 * 0.75);  // D(2) = 1.75

  const bench::DecodeStep one = bench::decode_roofline(m, 2, C, hw);
  const bench::DecodeStep tp = bench::decode_roofline(m, 2, C, hw, {2, 1});
  EXPECT_DOUBLE_EQ(tp.weight_bytes, 2e8 + (1e9 - 2e8) / 2 + 2 * experts * 1e8 / 2);
  EXPECT_DOUBLE_EQ(tp.kv_bytes, 2 * (C * 1000.0 / 2 + 2048 * 656.0 + C * 132.0));
  EXPECT_DOUBLE_EQ(tp.flops, 2 * (2 * (1e8 + 4e8 / 2) + C * 100.0 / 2 + 2048 * 10.0 / 2 + C * 1.0) +
                                 2 * 2 * 2 * 1 * 5e7 / 2);
  // Two layers: two all-reduces each and the embedding's, [2, 1000] bf16 (a ring moves 2 (T-1)/T of it),
  // and the head's fp32 logits gathered ((T-1)/T of [2, 5000] x 4 bytes).
  EXPECT_EQ(tp.collectives, 2 * 2 + 1 + 1);
  EXPECT_DOUBLE_EQ(tp.collective_bytes, 5 * (2.0 * 1 / 2 * 2 * 2000) + 1.0 / 2 * 2 * 4 * 5000);
  EXPECT_DOUBLE_EQ(tp.collective_seconds, tp.collective_bytes / 1e11 + 6 * 1e-5);
  EXPECT_DOUBLE_EQ(tp.seconds, tp.bytes / 1e12 + tp.collective_seconds);
  EXPECT_DOUBLE_EQ(tp.tokens_per_s_per_gpu, 2 / tp.seconds / 2);
  EXPECT_LT(tp.bytes, one.bytes);

  // Two groups of one GPU: each holds one sequence and every weight but the experts, which it halves; each
  // MoE layer gathers both groups' rows and scatters them back.
  const bench::DecodeStep dp = bench::decode_roofline(m, 2, C, hw, {1, 2});
  EXPECT_DOUBLE_EQ(dp.weight_bytes, 1e9 + 2 * experts * 1e8 / 2);
  EXPECT_DOUBLE_EQ(dp.kv_bytes, 1 * (C * 1000.0 + 2048 * 656.0 + C * 132.0));
  EXPECT_DOUBLE_EQ(dp.flops, 1 * (2 * 5e8 + C * 100.0 + 2048 * 10.0 + C * 1.0) + 2 * 2 * 2 * 1 * 5e7 / 2);
  EXPECT_EQ(dp.collectives, 2 * 2);
  EXPECT_DOUBLE_EQ(dp.collective_bytes, 2 * 2.0 * 1 / 2 * 2 * 2000);
  EXPECT_DOUBLE_EQ(dp.tokens_per_s_per_gpu, 2 / dp.seconds / 2);

  // The serving limit over the layout: the prompts' FLOPs spread over both GPUs, the decode steps' collectives
  // added to the cycle.
  const bench::ServingCycle cycle = bench::serving_roofline(m, 2, 3000, 100, hw, {2, 1});
  EXPECT_DOUBLE_EQ(cycle.prefill_flops, 2 * bench::prefill_flops(m, 3000) / 2);
  EXPECT_DOUBLE_EQ(cycle.collective_seconds, 100 * bench::decode_roofline(m, 2, 3050, hw, {2, 1}).collective_seconds);
  EXPECT_DOUBLE_EQ(cycle.total_tokens_per_s_per_gpu, 2 * 3100 / cycle.seconds / 2);
  EXPECT_TRUE(mentions(error_message([&] { bench::decode_roofline(m, 2, C, hw, {0, 1}); }), {"tensor"}));
}

// The serving shapes: real widths, weights that leave room for the KV cache on one H200 (141 GB).
// The roofline reads a config only once the family's own reader accepted it, and its per-layer lists
// must have one entry per layer: one-line errors, not std::out_of_range (found by tests/fuzz/fuzz_config).
TEST(Roofline, RefusesWhatTheFamiliesRefuse) {
  auto fixture = [](const char* name) {
    return Config::load((kSource / "tests/fixtures" / name / "config.json").string()).json();
  };
  nlohmann::json deepseek = fixture("deepseek_v32");
  deepseek["mlp_layer_types"] = {"dense"};
  EXPECT_TRUE(mentions(error_message([&] { bench::model_cost(Config(deepseek, "config.json")); }),
                       {"mlp_layer_types", "num_hidden_layers entries"}));
  deepseek = fixture("deepseek_v32");
  deepseek.erase("rope_parameters");
  deepseek["rope_scaling"] = {{"type", 7}};
  EXPECT_TRUE(mentions(error_message([&] { bench::model_cost(Config(deepseek, "config.json")); }),
                       {"field 'rope_scaling.type' must be a string"}));
  nlohmann::json minimax = fixture("minimax_m3");
  minimax["layer_types"] = {"full_attention"};
  EXPECT_TRUE(mentions(error_message([&] { bench::model_cost(Config(minimax, "config.json")); }),
                       {"layer_types", "num_hidden_layers entries"}));
}

TEST(Roofline, ServeShapesFitOneH200) {
  // Kimi-Linear-48B is whole and bf16 (98 GB); the others are cut to 40-80 GB of FP8, MiniMax-M3.1-Flash
  // as released (NVFP4 experts) to ~30 GB.
  const std::tuple<const char*, double, double> shapes[] = {{"deepseek_v3.2", 40e9, 80e9},
                                                            {"kimi_k3.1_pro", 40e9, 80e9},
                                                            {"kimi_k3.1_pro_mxfp4", 40e9, 80e9},
                                                            {"minimax_m3.1_flash", 40e9, 80e9},
                                                            {"minimax_m3.1_flash_release", 25e9, 80e9},
                                                            {"kimi_linear_48b", 40e9, 110e9}};
  for (const auto& [name, min_weight_bytes, max_weight_bytes] : shapes) {
    const fs::path path = kSource / "bench/shapes/serve" / (std::string(name) + ".json");
    const Config config = Config::load(path.string());
    EXPECT_TRUE(config.has("_comment")) << name << ": each reduction is stated in _comment";
    const bench::ModelCost cost = bench::model_cost(config);
    std::printf("%-20s %5zu layers  %7.2f B params  %6.1f GB of weights on the GPU  %5.2f GB read per step at "
                "batch 1\n",
                name, cost.mixers.size(), cost.total_params / 1e9, cost.weight_bytes / 1e9,
                bench::decode_roofline(cost, 1, 0, {}).weight_bytes / 1e9);
    EXPECT_GT(cost.weight_bytes, min_weight_bytes) << name;
    EXPECT_LT(cost.weight_bytes, max_weight_bytes) << name;
    // Decode at batch 1 and 8K context is memory-bound; at batch 256 the experts are all read.
    const bench::DecodeStep one = bench::decode_roofline(cost, 1, 8192, {});
    EXPECT_FALSE(one.compute_bound) << name;
    const bench::DecodeStep many = bench::decode_roofline(cost, 256, 8192, {});
    EXPECT_NEAR(many.distinct_experts, double(cost.num_experts), 0.05 * double(cost.num_experts)) << name;
    EXPECT_GT(many.tokens_per_s_per_gpu, one.tokens_per_s_per_gpu) << name;
  }
  // DeepSeek-V3.2's shape by hand: one dense layer, 5 MoE layers of 256 experts of 3 x 2048 x 7168.
  const bench::ModelCost ds = bench::model_cost(Config::load((kSource / "bench/shapes/serve/deepseek_v3.2.json").string()));
  EXPECT_EQ(ds.moe_layers, 5);
  EXPECT_EQ(ds.num_experts, 256);
  EXPECT_EQ(ds.expert_params, 3.0 * 2048 * 7168);
  EXPECT_NEAR(ds.expert_bytes, 3.0 * 2048 * 7168 * (1 + 4.0 / 16384), 1);  // FP8 and its block scales
  // MLA latent 512 + rope 64 in bf16, the DSA key in FP8 (128 + 4 bytes) per token and layer.
  EXPECT_EQ(ds.mixers[0].kv_bytes_per_token, 1152);
  EXPECT_EQ(ds.mixers[0].index_bytes_per_token, 132);
  EXPECT_EQ(ds.mixers[0].attended_limit, 2048);
  // Kimi K3.1 Pro as released: MXFP4 latent experts (3 x 3072 x 3584), half a byte a weight and one E8M0
  // scale a 32, every other weight bf16.
  const bench::ModelCost k3 =
      bench::model_cost(Config::load((kSource / "bench/shapes/serve/kimi_k3.1_pro_mxfp4.json").string()));
  EXPECT_EQ(k3.num_experts, 896);
  EXPECT_EQ(k3.expert_params, 3.0 * 3072 * 3584);
  EXPECT_NEAR(k3.expert_bytes, 3.0 * 3072 * 3584 * (0.5 + 1.0 / 32), 1);
  // MiniMax-M3.1-Flash as released: NVFP4 experts (3 x 3072 x 6144, half a byte a weight, an E4M3 scale a 16,
  // three fp32 global scales) and MXFP8 projections (a byte a weight and an E8M0 scale a 32): the same
  // model with FP8 128x128 weights reads fewer bytes only in its projections' scales.
  const bench::ModelCost m3 =
      bench::model_cost(Config::load((kSource / "bench/shapes/serve/minimax_m3.1_flash_release.json").string()));
  const bench::ModelCost m3_fp8 =
      bench::model_cost(Config::load((kSource / "bench/shapes/serve/minimax_m3.1_flash.json").string()));
  EXPECT_EQ(m3.expert_params, 3.0 * 3072 * 6144);
  EXPECT_NEAR(m3.expert_bytes, 3.0 * 3072 * 6144 * (0.5 + 1.0 / 16) + 12, 1);
  EXPECT_EQ(m3.dense_params, m3_fp8.dense_params);
  const double fp8_scale = 4.0 / (128 * 128), mx_scale = 1.0 / 32;
  EXPECT_GT(m3.dense_bytes, m3_fp8.dense_bytes);
  EXPECT_LT(m3.dense_bytes, m3_fp8.dense_bytes * (1 + mx_scale) / (1 + fp8_scale));
}

// ---------------------------------------------------------------------------------------------------
// The sweep

TEST(BenchSweep, ArgumentsAndPoints) {
  EXPECT_EQ(bench::parse_concurrencies("1,2,64"), (std::vector<int64_t>{1, 2, 64}));
  EXPECT_TRUE(mentions(error_message([] { bench::parse_concurrencies("1,x"); }), {"--concurrencies", "'x'"}));
  EXPECT_TRUE(mentions(error_message([] { bench::parse_concurrencies("0"); }), {"--concurrencies"}));
  EXPECT_EQ(bench::split_arguments(" dir --served-model-name 'a b'  --x=\"c d\" "),
            (std::vector<std::string>{"dir", "--served-model-name", "a b", "--x=c d"}));
  EXPECT_TRUE(mentions(error_message([] { bench::split_arguments("a 'b"); }), {"quote"}));
  // The roofline's layout must be the GPUs the throughput divides by (before anything is launched).
  bench::SweepOptions layout;
  layout.concurrencies = {1};
  layout.launch = "dir -tp 2 -dp 2";
  layout.num_gpus = 3;
  EXPECT_TRUE(mentions(error_message([&] { bench::run_sweep(layout); }),
                       {"--num-gpus 3", "tensor parallel 2 x data parallel 2"}));

  // A `vllm bench serve --save-result` file is a point too.
  const bench::Json vllm = {{"max_concurrency", 8},  {"completed", 10},          {"total_input_tokens", 10000},
                            {"total_output_tokens", 2000}, {"output_throughput", 400.0}, {"total_token_throughput", 2400.0},
                            {"median_tpot_ms", 20.0},      {"mean_tpot_ms", 25.0}};
  const bench::Json p = bench::sweep_point(vllm, 8, 2);
  EXPECT_EQ(p["concurrency"], 8);
  EXPECT_DOUBLE_EQ(p["tokens_per_s_per_user"].get<double>(), 50.0);
  EXPECT_DOUBLE_EQ(p["mean_tokens_per_s_per_user"].get<double>(), 40.0);
  EXPECT_DOUBLE_EQ(p["tokens_per_s_per_gpu"].get<double>(), 1200.0);
  EXPECT_DOUBLE_EQ(p["output_tokens_per_s_per_gpu"].get<double>(), 200.0);
  EXPECT_DOUBLE_EQ(p["mean_context"].get<double>(), 1000.0 + 100.0);
  EXPECT_FALSE(p.contains("spec_decode_acceptance_length"));
  // A speculating server's counters travel with the point.
  bench::Json speculating = vllm;
  speculating["spec_decode_acceptance_length"] = 3.5;
  speculating["spec_decode_num_drafts"] = 40;
  const bench::Json q = bench::sweep_point(speculating, 8, 2);
  EXPECT_DOUBLE_EQ(q["spec_decode_acceptance_length"].get<double>(), 3.5);
  EXPECT_EQ(q["spec_decode_num_drafts"], 40);
}

// `sparrow serve` as a child process; its port read from the start-up line.
using Server = test::ServeProcess;

// A dummy model folder without a tokenizer: completions take token-id prompts (text ones are refused
// with a clear 400), outputs come back as token ids.
TEST(BenchSweep, DummyServerWithoutTokenizerServesTokenIds) {
  TempDir dir;
  const std::string model = config_only(dir, "minimax_m3");
  Server server({model, "--load-format", "dummy", "--port", "0", "--kv-cache-memory", "64MiB",
                 "--disable-log-requests", "--shutdown-timeout", "5"},
                dir.file("server.log"));
  ASSERT_NE(server.port(), 0) << slurp(dir.file("server.log"));
  httplib::Client client("127.0.0.1", server.port());
  auto ok = client.Post("/v1/completions",
                        R"({"prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": true, "return_token_ids": true,
                            "temperature": 0})",
                        "application/json");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  const nlohmann::json j = nlohmann::json::parse(ok->body);
  EXPECT_EQ(j["usage"]["completion_tokens"], 4) << ok->body;
  EXPECT_EQ(j["choices"][0]["token_ids"].size(), 4u) << ok->body;
  auto refused = client.Post("/v1/completions", R"({"prompt": "hello", "max_tokens": 4})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_NE(refused->body.find("token-id prompts"), std::string::npos) << refused->body;
}

// The whole command: the sweep launches `sparrow serve` on the bundled model, runs two points (each with its
// own prompts) and writes the sweep JSON with the roofline and the serving limit beside each point.
TEST(BenchSweep, TinySweepAgainstALaunchedServer) {
  const fs::path model = kSource / "models" / "minimax_m3";
  if (!fs::exists(model / "model.safetensors")) GTEST_SKIP() << "no bundled model";
  TempDir dir;
  const std::string cmd = std::string(SPARROW_BINARY) + " bench sweep --launch '" + model.string() +
                          " --kv-cache-memory 64MiB' --concurrencies 1,2 --prompts-per-concurrency 2 "
                          "--random-input-len 96 --random-output-len 8 --ignore-eos --disable-tqdm --save-result "
                          "--result-dir " + dir.path() + " --output " + dir.file("sweep.json") + " >" +
                          dir.file("out.log") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  const std::string out = slurp(dir.file("out.log"));
  ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out << slurp(dir.file("sweep.json.server.log"));
  const nlohmann::json sweep = nlohmann::json::parse(slurp(dir.file("sweep.json")));
  EXPECT_EQ(sweep["kind"], "sparrow-bench-sweep");
  EXPECT_EQ(sweep["label"], "sparrow");
  EXPECT_EQ(sweep["model_cost"]["model_type"], "minimax_m3_vl_text");
  ASSERT_EQ(sweep["points"].size(), 2u) << out;
  int64_t expected_concurrency = 1;
  for (const auto& p : sweep["points"]) {
    EXPECT_EQ(p["concurrency"], expected_concurrency);
    EXPECT_EQ(p["completed"], 2 * expected_concurrency) << p;
    EXPECT_EQ(p["failed"], 0) << p;
    EXPECT_DOUBLE_EQ(p["mean_output_len"].get<double>(), 8.0);
    // Each point draws its own prompts (seed + point index): none of them is a prefix-cache hit left by the
    // previous point (with one seed, point 2's first two prompts would be point 1's, a whole 64-token block
    // each already cached).
    EXPECT_EQ(p["seed"], expected_concurrency == 1 ? 0 : 1) << p;
    EXPECT_EQ(p["prefix_cache_hit_rate"], 0.0) << p;
    EXPECT_GT(p["tokens_per_s_per_user"].get<double>(), 0) << p;
    EXPECT_GT(p["tokens_per_s_per_gpu"].get<double>(), p["output_tokens_per_s_per_gpu"].get<double>());
    ASSERT_TRUE(p.contains("roofline")) << p;
    const auto& r = p["roofline"];
    EXPECT_EQ(r["batch"], expected_concurrency);
    EXPECT_DOUBLE_EQ(r["context"].get<double>(), p["mean_context"].get<double>());
    // The CPU is far below an H200's limit.
    EXPECT_GT(r["tokens_per_s_per_user"].get<double>(), p["tokens_per_s_per_user"].get<double>());
    // The serving limit counts the prompts' prefill too: never above the decode roofline; `sparrow bench
    // roofline` gives the same numbers from the config alone.
    ASSERT_TRUE(p.contains("serving_limit")) << p;
    const auto& lim = p["serving_limit"];
    EXPECT_LE(lim["tokens_per_s_per_user"].get<double>(), r["tokens_per_s_per_user"].get<double>());
    const std::string roof_cmd = std::string(SPARROW_BINARY) + " bench roofline --model-config " + model.string() +
                                 " --batch " + std::to_string(expected_concurrency) + " --input-len " +
                                 std::to_string(p["mean_input_len"].get<double>()) + " --output-len 8 >" +
                                 dir.file("roofline.json") + " 2>&1";
    ASSERT_EQ(std::system(roof_cmd.c_str()), 0) << slurp(dir.file("roofline.json"));
    const nlohmann::json alone = nlohmann::json::parse(slurp(dir.file("roofline.json")));
    EXPECT_DOUBLE_EQ(alone["serving"]["tokens_per_s_per_user"].get<double>(), lim["tokens_per_s_per_user"].get<double>());
    EXPECT_DOUBLE_EQ(alone["decode"]["tokens_per_s_per_user"].get<double>(), r["tokens_per_s_per_user"].get<double>());
    EXPECT_TRUE(fs::exists(dir.file("sparrow-concurrency" + std::to_string(expected_concurrency) + ".json")));
    expected_concurrency *= 2;
  }
  EXPECT_EQ(sweep["roofline"].size(), 2u);
  EXPECT_NE(out.find("Saved the sweep to"), std::string::npos) << out;

  // tools/plot_sweep.py is at least valid Python (PlotSweep draws with it where matplotlib is).
  if (std::system("python3 -c 'import sys' >/dev/null 2>&1") == 0)
    EXPECT_EQ(std::system(("python3 -m py_compile " + (kSource / "tools" / "plot_sweep.py").string()).c_str()), 0);
}

// tools/plot_sweep.py on a sweep JSON (sparrow's curve, roofline and serving limit) and vLLM-format
// per-concurrency result files (a peer): a PNG and an SVG.
TEST(PlotSweep, DrawsSweepRooflineAndPeers) {
  if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "no matplotlib (pip install matplotlib) for tools/plot_sweep.py";
  TempDir dir;
  nlohmann::json points = nlohmann::json::array(), roofline = nlohmann::json::array();
  for (int c : {1, 2, 4}) {
    const nlohmann::json r = {{"batch", c}, {"tokens_per_s_per_user", 900.0 / (1 + 0.1 * c)},
                              {"tokens_per_s_per_gpu", 900.0 * c / (1 + 0.1 * c)},
                              {"total_tokens_per_s_per_gpu", 9000.0 * c / (1 + 0.1 * c)}, {"bound", "memory"}};
    const nlohmann::json limit = {{"tokens_per_s_per_user", 800.0 / (1 + 0.2 * c)},
                                  {"total_tokens_per_s_per_gpu", 8000.0 * c / (1 + 0.2 * c)},
                                  {"output_tokens_per_s_per_gpu", 800.0 * c / (1 + 0.2 * c)}, {"bound", "compute"}};
    points.push_back({{"concurrency", c}, {"completed", 10}, {"median_tpot_ms", 5.0 * (1 + 0.2 * c)},
                      {"mean_tpot_ms", 6.0 * (1 + 0.2 * c)}, {"tokens_per_s_per_gpu", 2000.0 * c},
                      {"output_tokens_per_s_per_gpu", 200.0 * c}, {"roofline", r}, {"serving_limit", limit}});
    roofline.push_back(r);
    dir.write("vllm-c" + std::to_string(c) + ".json",
              nlohmann::json({{"max_concurrency", c}, {"completed", 10}, {"median_tpot_ms", 4.0 * (1 + 0.3 * c)},
                              {"mean_tpot_ms", 4.5 * (1 + 0.3 * c)}, {"total_token_throughput", 2500.0 * c},
                              {"output_throughput", 250.0 * c}})
                  .dump());
  }
  dir.write("sweep.json", nlohmann::json({{"kind", "sparrow-bench-sweep"}, {"label", "sparrow"}, {"num_gpus", 1},
                                          {"dataset_name", "random"},
                                          {"workload", {{"input_len", 1024}, {"output_len", 128}}},
                                          {"model_cost", {{"model_type", "deepseek_v32"}, {"layers", 6}}},
                                          {"points", points}, {"roofline", roofline}})
                              .dump());
  const std::string plot = "python3 " + (kSource / "tools" / "plot_sweep.py").string() + " " + dir.file("sweep.json") +
                           " --peer 'vllm=" + dir.path() + "/vllm-c*.json' --output " + dir.file("front") + " >" +
                           dir.file("plot.log") + " 2>&1";
  EXPECT_EQ(std::system(plot.c_str()), 0) << slurp(dir.file("plot.log"));
  EXPECT_GT(fs::file_size(dir.file("front.png")), 1000u);
  EXPECT_NE(slurp(dir.file("front.svg")).find("<svg"), std::string::npos);
}

}  // namespace
}  // namespace sparrow
