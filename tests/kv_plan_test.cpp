// Capacity planning (cache/kv_plan.h, `sparrow kv-plan`) on the seeds' own figures, from the shape
// configs in bench/shapes/ (written from the articles):
//   - Kimi K3.1 Pro: an FP8 latent is 576 bytes and an FP8 index key 132 per layer; NVFP4 latent (352) +
//     MXFP4 index key (68) hold about 1.7x the tokens (708 / 420); NVFP4 latents alone hold 4.49M tokens
//     where FP8 holds 3.04M (8x GB300, TP8); DCP8 multiplies the tokens by eight.
//   - MiniMax-M3.1: NVFP4 K/V need 34,560 bytes per token instead of FP8's 61,440 (60 layers x 4 KV heads
//     x 128, every KV head on each GPU as in the article's DEP4 deployment; a quarter each under TP4).
//   - the JSON's exact shape, TP / DCP rules, and one-line errors for bad flags (library and CLI).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cache/kv_plan.h"
#include "core/error.h"
#include "formats/config.h"
#include "model/families.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;
constexpr int64_t kMillion = 1048576;  // the seeds' "1M" context

std::string shape(const std::string& name) { return (fs::path(SPARROW_SOURCE_DIR) / "bench/shapes" / name).string(); }

std::vector<LayerCacheSpec> spec_of(const std::string& name) {
  return cache_spec_from_config(Config::load(shape(name)));
}

int64_t component(const KvPlan& plan, const std::string& name) {
  for (const auto& [key, bytes] : plan.bytes_per_token)
    if (key == name) return bytes;
  return -1;
}

KvPlanOptions options(const std::string& kv, const std::string& index, int64_t tp, int64_t dcp, int64_t memory,
                      int64_t max_model_len = kMillion) {
  KvPlanOptions o;
  o.kv_cache_dtype = kv;
  o.indexer_kv_dtype = index;
  o.tensor_parallel_size = tp;
  o.decode_context_parallel_size = dcp;
  o.memory_bytes = memory;
  o.max_model_len = max_model_len;
  return o;
}

}  // namespace

TEST(KvPlan, KimiK31ProBytesPerTokenFollowTheSeed) {
  const auto spec = spec_of("kimi_k3.1_pro.json");
  // 24 MLA + DSA layers. FP8: the 576-byte latent (fp8_per_tensor) and the 132-byte key.
  const KvPlan fp8 = plan_kv(spec, options("fp8_per_tensor", "fp8", 8, 1, 64 * kGiB));
  EXPECT_EQ(component(fp8, "mla_latent"), 24 * 576);
  EXPECT_EQ(component(fp8, "dsa_index_key"), 24 * 132);
  EXPECT_EQ(component(fp8, "total"), 24 * 708);  // 16,992
  // NVFP4 latent (352) + MXFP4 key (68), the seed's "352 字节" and "68 字节".
  const KvPlan fp4 = plan_kv(spec, options("nvfp4", "mxfp4", 8, 1, 64 * kGiB));
  EXPECT_EQ(component(fp4, "mla_latent"), 24 * 352);
  EXPECT_EQ(component(fp4, "dsa_index_key"), 24 * 68);
  EXPECT_EQ(component(fp4, "total"), 24 * 420);  // 10,080
  EXPECT_EQ(fp4.kv_dtype, "nvfp4");
  EXPECT_EQ(fp4.index_dtype, "mxfp4");
  // FlashMLA's FP8 layout (what --kv-cache-dtype fp8 means for MLA, as vLLM's FlashMLA-sparse backend): 656.
  EXPECT_EQ(component(plan_kv(spec, options("fp8", "auto", 8, 1, 64 * kGiB)), "mla_latent"), 24 * 656);
  // The KDA state: 69 layers, 96 heads split over 8 GPUs.
  EXPECT_EQ(fp8.state_bytes_per_sequence.back().second, 464633856 / 8);
  // TP replicates the latent and the keys: the same bytes on every GPU at any TP.
  EXPECT_EQ(component(plan_kv(spec, options("nvfp4", "mxfp4", 1, 1, 512 * kGiB)), "total"), 24 * 420);
}

TEST(KvPlan, KimiK31ProNarrowFormatsHoldAboutOnePointSevenTimesTheTokens) {
  const auto spec = spec_of("kimi_k3.1_pro.json");
  // The seed's 8x GB300, TP8: FP8 KV holds 3.04M tokens, i.e. about 3.04M x 16,992 B of cache per GPU.
  const int64_t memory = int64_t(3.04e6 * 16992.0) + 2 * (464633856 / 8);
  const KvPlan fp8 = plan_kv(spec, options("fp8_per_tensor", "fp8", 8, 1, memory));
  const KvPlan nvfp4_latent = plan_kv(spec, options("nvfp4", "fp8", 8, 1, memory));
  const KvPlan fp4 = plan_kv(spec, options("nvfp4", "mxfp4", 8, 1, memory));
  EXPECT_NEAR(double(fp8.max_tokens), 3.04e6, 0.01e6);
  // "latent 用 NVFP4 时 ... 4.49M" (TP8): 3.04M x 708 / 484 = 4.45M.
  EXPECT_NEAR(double(nvfp4_latent.max_tokens), 4.49e6, 0.02 * 4.49e6);
  // "两者叠加后 ... 能容纳的 token 数是 FP8 的 1.7 倍"
  const double ratio = double(fp4.max_tokens) / double(fp8.max_tokens);
  EXPECT_GT(ratio, 1.65);
  EXPECT_LT(ratio, 1.75);
  // "8× GB300 配 FP8 KV 时 ... 2.9 个并发的 1M token 请求": two whole ones.
  EXPECT_EQ(fp8.max_contexts, 2);

  // DCP8 stores every 8th token on each GPU: eight times the tokens (the seed measures 7.2x, after the
  // DCP workspace), and many more full 1M contexts with both narrow formats ("约 36 个").
  const KvPlan dcp8 = plan_kv(spec, options("fp8_per_tensor", "fp8", 8, 8, memory));
  EXPECT_GT(double(dcp8.max_tokens) / double(fp8.max_tokens), 7.5);  // less the states of 22 contexts
  EXPECT_LE(dcp8.max_tokens, 8 * fp8.max_tokens);
  const KvPlan fp4_dcp8 = plan_kv(spec, options("nvfp4", "mxfp4", 8, 8, memory));
  EXPECT_GE(fp4_dcp8.max_contexts, 36);
  // Each context pays its rows and one state: contexts x (rows + state) never exceed the memory.
  const int64_t rows_per_context = (kMillion + 63) / 64;  // block rows, each holding a GPU's 8 of 64 tokens
  EXPECT_LE(fp4_dcp8.max_contexts * (rows_per_context * fp4_dcp8.row_bytes + fp4_dcp8.state_slot_bytes), memory);
  EXPECT_GT((fp4_dcp8.max_contexts + 1) * (rows_per_context * fp4_dcp8.row_bytes + fp4_dcp8.state_slot_bytes), memory);
}

TEST(KvPlan, MiniMaxM31NeedsThirtyFourThousandFiveHundredSixtyBytesPerToken) {
  const auto spec = spec_of("minimax_m3.1.json");
  // The article's capacity claim is for DEP4 (attention data-parallel): every GPU holds all 4 KV heads
  // of its requests, i.e. tensor parallel 1 for the cache. 60 layers x K and V of 4 heads x 128.
  const KvPlan nvfp4 = plan_kv(spec, options("nvfp4", "nvfp4", 1, 1, 64 * kGiB, 262144));
  const KvPlan fp8 = plan_kv(spec, options("fp8", "fp8", 1, 1, 64 * kGiB, 262144));
  EXPECT_EQ(component(nvfp4, "gqa_kv"), 34560);  // 60 x (512 B of e2m1 + 64 B of scales)
  EXPECT_EQ(component(fp8, "gqa_kv"), 61440);    // 60 x 1,024 B of e4m3
  // The article's figures count K/V only; the 57 MSA layers' index keys come on top (72 / 128 bytes).
  EXPECT_EQ(component(nvfp4, "msa_index_key"), 57 * 72);
  EXPECT_EQ(component(fp8, "msa_index_key"), 57 * 128);
  EXPECT_EQ(component(nvfp4, "total"), 34560 + 57 * 72);
  // Its serve command's TP4 (-tp 4): one KV head a GPU, a quarter of the K/V; index keys whole.
  const KvPlan tp4 = plan_kv(spec, options("nvfp4", "nvfp4", 4, 1, 64 * kGiB, 262144));
  EXPECT_EQ(component(tp4, "gqa_kv"), 34560 / 4);
  EXPECT_EQ(component(tp4, "msa_index_key"), 57 * 72);
  // TP8 cannot split 4 heads further: each GPU keeps one (replicated), as vLLM does.
  EXPECT_EQ(component(plan_kv(spec, options("nvfp4", "nvfp4", 8, 1, 64 * kGiB, 262144)), "gqa_kv"), 34560 / 4);
  EXPECT_TRUE(nvfp4.state_bytes_per_sequence.empty());
  // Without recurrent state: max_tokens is the whole memory in rows, max_contexts its share per context.
  EXPECT_EQ(nvfp4.max_tokens, 64 * kGiB / nvfp4.row_bytes * 64);
  EXPECT_EQ(nvfp4.max_contexts, 64 * kGiB / (262144 / 64 * nvfp4.row_bytes));
  // "auto" plans as a GPU would: bfloat16 K/V, MSA keys in the kv dtype.
  const KvPlan automatic = plan_kv(spec, options("auto", "auto", 1, 1, 64 * kGiB, 262144));
  EXPECT_EQ(component(automatic, "gqa_kv"), 60 * 2048);
  EXPECT_EQ(component(automatic, "msa_index_key"), 57 * 256);
}

TEST(KvPlan, JsonHasExactlyTheDocumentedShape) {
  const KvPlan plan = plan_kv(spec_of("deepseek_v3.2.json"), options("nvfp4", "mxfp4", 8, 2, 80 * kGiB, 163840));
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(plan.json());
  ASSERT_TRUE(j.is_object());
  std::vector<std::string> keys;
  for (const auto& [key, value] : j.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"bytes_per_token", "max_tokens", "max_contexts"}));
  std::vector<std::string> components;
  int64_t sum = 0;
  for (const auto& [key, value] : j["bytes_per_token"].items()) {
    components.push_back(key);
    ASSERT_TRUE(value.is_number_integer()) << key;
    if (key != "total") sum += value.get<int64_t>();
  }
  EXPECT_EQ(components, (std::vector<std::string>{"mla_latent", "dsa_index_key", "total"}));
  // DCP 2: each GPU keeps every other token's rows, half of each token's bytes on average.
  EXPECT_EQ(j["bytes_per_token"]["mla_latent"], 61 * 352 / 2);
  EXPECT_EQ(j["bytes_per_token"]["dsa_index_key"], 61 * 68 / 2);
  EXPECT_EQ(j["bytes_per_token"]["total"], sum);
  EXPECT_TRUE(j["max_tokens"].is_number_integer());
  EXPECT_TRUE(j["max_contexts"].is_number_integer());
  EXPECT_EQ(j["max_tokens"], plan.max_tokens);
  // DCP 2: a block row holds half of its 64 tokens' rows, so one GPU's memory holds twice the tokens.
  EXPECT_EQ(plan.max_tokens, 80 * kGiB / plan.row_bytes * 64);
  EXPECT_EQ(plan.row_bytes, 61 * (32 * 352 + 32 * 68));
  EXPECT_NE(plan.text().find("bytes per token"), std::string::npos);
}

TEST(KvPlan, RejectsWhatItCannotPlanInOneLine) {
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  const auto kimi = spec_of("kimi_k3.1_pro.json");
  const auto minimax = spec_of("minimax_m3.1.json");
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("fp7", "auto", 8, 1, kGiB)); }),
                       {"fp7", "nvfp4", "fp8_per_tensor"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("mxfp4", "auto", 8, 1, kGiB)); }),
                       {"index-key format", "indexer_kv_dtype"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("nvfp4", "int4", 8, 1, kGiB)); }),
                       {"int4", "mxfp4"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("nvfp4", "auto", 8, 3, kGiB)); }),
                       {"--decode-context-parallel-size 3", "divide"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(minimax, options("nvfp4", "auto", 3, 1, kGiB)); }),
                       {"--tensor-parallel-size 3", "4 KV heads"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("nvfp4", "auto", 0, 1, kGiB)); }),
                       {"--tensor-parallel-size"}));
  EXPECT_TRUE(mentions(error_message([&] { plan_kv(kimi, options("nvfp4", "auto", 8, 1, 1000)); }),
                       {"too small"}));
}

// The model registry (model/families.h) is the one model_type dispatch: a type it lacks is one line
// naming every type it has, and a vision-language row reads its text fields from text_config.
TEST(ModelRegistry, OneRowPerModelType) {
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  auto config = [](nlohmann::json j) { return Config(std::move(j), "config.json"); };
  EXPECT_TRUE(mentions(error_message([&] { model_family(config({{"model_type", "llama"}})); }),
                       {"unsupported model_type 'llama'", "deepseek_v32", "kimi_linear", "kimi_k3", "minimax_m3_vl_text",
                        "minimax_m3_vl"}));
  EXPECT_EQ(std::string(model_family(config({{"model_type", "kimi_k3"}})).family), "kimi_linear");
  const ModelFamily& vl = model_family(config({{"model_type", "minimax_m3_vl"}}));
  EXPECT_EQ(std::string(vl.weight_prefix), "model.language_model.");
  EXPECT_EQ(vl.text(config({{"model_type", "minimax_m3_vl"}, {"text_config", {{"hidden_size", 8}}}})).get_int("hidden_size"), 8);
  EXPECT_TRUE(mentions(error_message([&] { cache_spec_from_config(config({{"model_type", "minimax_m3_vl"}})); }),
                       {"text_config"}));
}

// ---- the command ----

namespace {

struct CommandRun {
  int status = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

CommandRun sparrow_kv_plan(const std::string& args) {
  sparrow::testing::TempDir dir;
  const std::string cmd = std::string(SPARROW_BINARY) + " kv-plan " + args + " >" + dir.file("out") + " 2>" +
                          dir.file("err");
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(dir.file("out")), slurp(dir.file("err"))};
}

void expect_one_line_error(const CommandRun& r, const std::string& must_contain) {
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(must_contain), std::string::npos) << r.err;
}

}  // namespace

TEST(KvPlanCli, PrintsTheLibrarysPlanFromAShapeConfigOrAFolder) {
  const CommandRun r = sparrow_kv_plan("--model " + shape("kimi_k3.1_pro.json") +
                                " --kv-cache-dtype nvfp4 --attention-config '{\"indexer_kv_dtype\": \"mxfp4\"}'"
                                " --tensor-parallel-size 8 --decode-context-parallel-size 8 --memory 48 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const KvPlan plan = plan_kv(spec_of("kimi_k3.1_pro.json"), options("nvfp4", "mxfp4", 8, 8, 48 * kGiB));
  EXPECT_EQ(r.out, plan.json() + "\n");

  // A folder holding only config.json; max_model_len from it (MiniMax: 524,288).
  sparrow::testing::TempDir folder;
  fs::copy_file(shape("minimax_m3.1.json"), folder.file("config.json"));
  const CommandRun text = sparrow_kv_plan("--model " + folder.path() + " --memory 64 --kv-cache-dtype nvfp4");
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("gqa_kv 34,560"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("full contexts of 524,288 tokens"), std::string::npos) << text.out;
}

TEST(KvPlanCli, BadFlagsGiveOneLineErrors) {
  const std::string kimi = "--model " + shape("kimi_k3.1_pro.json") + " --memory 64";
  expect_one_line_error(sparrow_kv_plan(kimi + " --kv-cache-dtype fp4"), "supported: auto, float32");
  expect_one_line_error(sparrow_kv_plan(kimi + " --attention-config '{\"indexer_kv_dtype\": \"int8\"}'"),
                        "supported: auto, float32, bfloat16, bf16, fp8, fp8_e4m3, mxfp4, nvfp4");
  expect_one_line_error(sparrow_kv_plan(kimi + " --attention-config '{\"backend\": \"FLASHMLA\"}'"),
                        "supported: indexer_kv_dtype");
  expect_one_line_error(sparrow_kv_plan(kimi + " --attention-config 'indexer_kv_dtype=fp8'"), "JSON object");
  expect_one_line_error(sparrow_kv_plan(kimi + " --attention-config '{\"indexer_kv_dtype\": 8}'"), "string");
  expect_one_line_error(sparrow_kv_plan(kimi + " --tensor-parallel-size 8 --decode-context-parallel-size 3"),
                        "divide");
  expect_one_line_error(sparrow_kv_plan("--model /nonexistent/model --memory 64 --max-model-len 1000"),
                        "/nonexistent/model");
  expect_one_line_error(sparrow_kv_plan("--model " + shape("kimi_k3.1_pro.json") + " --memory -1"), "--memory");
  EXPECT_NE(sparrow_kv_plan("--model " + shape("kimi_k3.1_pro.json")).status, 0);  // --memory is required
}

TEST(KvPlanCli, ServeRejectsBadCacheFlagsBeforeLoading) {
  auto serve = [](const std::string& args) {
    sparrow::testing::TempDir dir;
    const std::string model = (fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/deepseek_v32").string();
    // `timeout`: should a check let the flag through, the server would start and never return.
    const std::string cmd = "timeout 60 " + std::string(SPARROW_BINARY) + " serve " + model + " --port 0 " + args + " >" +
                            dir.file("out") + " 2>" + dir.file("err");
    const int rc = std::system(cmd.c_str());
    return CommandRun{WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(dir.file("out")), slurp(dir.file("err"))};
  };
  expect_one_line_error(serve("--kv-cache-dtype int4"), "supported: auto, float32");
  expect_one_line_error(serve("--attention-config '{\"indexer_kv_dtype\": \"fp6\"}'"), "fp6");
}
