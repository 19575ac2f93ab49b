// `sparrow bench kv-quality` and `sparrow perplexity --kv-cache-dtype` (issue 7's quality table,
// bench/results/kv-quant.md) on a bundled trained model with an indexer: the float32 cache against itself
// has no logit error and recalls the exact top-k set, narrower formats do not.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource = SPARROW_SOURCE_DIR;

// `sparrow ARGS`: exit status and stdout (stderr appended to the message on failure).
std::pair<int, std::string> run(const std::string& args) {
  const sparrow::testing::CliRun r = sparrow::testing::run_sparrow(args);
  return {r.status, r.out + r.err};
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
  return lines;
}

const std::string kModel = (kSource / "models/deepseek_v32").string();
const std::string kText = (kSource / "tests/data/perplexity/imghdr.py.txt").string();

}  // namespace

// 256-token windows: beyond the model's index_topk of 128, so the indexer selects.
TEST(KvQualityCli, Float32IsExactAndNarrowKeysLoseRecall) {
  const auto [status, out] = run("bench kv-quality --model " + kModel + " --file " + kText +
                                 " --context 256 --kv-cache-dtype float32,fp8 --indexer-kv-dtype float32,mxfp4");
  ASSERT_EQ(status, 0) << out;
  const std::vector<nlohmann::json> lines = json_lines(out);
  ASSERT_EQ(lines.size(), 4u) << out;
  for (const nlohmann::json& j : lines)
    for (const char* key : {"model_type", "kv_cache_dtype", "indexer_kv_dtype", "tokens", "perplexity",
                            "perplexity_float32", "perplexity_bfloat16", "logit_max_abs_error",
                            "logit_mean_abs_error", "topk_recall", "recall_rows"})
      ASSERT_TRUE(j.contains(key)) << key << " missing in " << j.dump();
  const nlohmann::json &fp32 = lines[0], &fp8 = lines[1], &fp32_keys = lines[2], &mxfp4_keys = lines[3];
  EXPECT_EQ(fp32["kv_cache_dtype"], "float32");
  EXPECT_EQ(fp32["indexer_kv_dtype"], "float32");
  EXPECT_EQ(fp8["indexer_kv_dtype"], "fp8");  // auto on the CPU: the kv dtype's counterpart
  EXPECT_EQ(mxfp4_keys["indexer_kv_dtype"], "mxfp4");
  for (const nlohmann::json* exact : {&fp32, &fp32_keys}) {
    EXPECT_EQ((*exact)["logit_max_abs_error"].get<double>(), 0.0);
    EXPECT_EQ((*exact)["logit_mean_abs_error"].get<double>(), 0.0);
    EXPECT_EQ((*exact)["topk_recall"].get<double>(), 1.0);
    EXPECT_GT((*exact)["recall_rows"].get<int64_t>(), 0);
    EXPECT_EQ((*exact)["perplexity"].get<double>(), (*exact)["perplexity_float32"].get<double>());
  }
  EXPECT_GT(fp8["logit_max_abs_error"].get<double>(), 0.0);
  EXPECT_GT(fp8["logit_max_abs_error"].get<double>(), fp8["logit_mean_abs_error"].get<double>());
  EXPECT_LT(mxfp4_keys["topk_recall"].get<double>(), 1.0);
  EXPECT_GT(mxfp4_keys["topk_recall"].get<double>(), 0.5);
}

// perplexity through a paged float32 cache equals the model's own sequence cache; bfloat16 is close.
TEST(KvQualityCli, PerplexityTakesTheCacheFormatFlags) {
  const auto plain = run("perplexity --model " + kModel + " --file " + kText + " --context 256");
  const auto paged = run("perplexity --model " + kModel + " --file " + kText + " --context 256 --kv-cache-dtype float32");
  const auto bf16 = run("perplexity --model " + kModel + " --file " + kText +
                        " --context 256 --kv-cache-dtype bfloat16 --attention-config '{\"indexer_kv_dtype\": \"mxfp4\"}'");
  ASSERT_EQ(plain.first, 0) << plain.second;
  ASSERT_EQ(paged.first, 0) << paged.second;
  ASSERT_EQ(bf16.first, 0) << bf16.second;
  const nlohmann::json a = json_lines(plain.second).at(0), b = json_lines(paged.second).at(0),
                       c = json_lines(bf16.second).at(0);
  EXPECT_NEAR(b["perplexity"].get<double>(), a["perplexity"].get<double>(), 1e-4 * a["perplexity"].get<double>());
  EXPECT_EQ(b["kv_cache_dtype"], "float32");
  EXPECT_EQ(c["indexer_kv_dtype"], "mxfp4");
  EXPECT_NEAR(c["perplexity"].get<double>(), a["perplexity"].get<double>(), 0.05 * a["perplexity"].get<double>());
  const auto bad = run("perplexity --model " + kModel + " --file " + kText + " --kv-cache-dtype int8");
  EXPECT_NE(bad.first, 0);
  EXPECT_NE(bad.second.find("int8"), std::string::npos) << bad.second;
}
