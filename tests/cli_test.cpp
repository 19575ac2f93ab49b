// The `sparrow` binary as a user runs it: exact outputs for score / generate, and one-line errors with
// exit status 1 (never a crash) for bad input.
#include <gtest/gtest.h>

#if SPARROW_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include <sys/wait.h>

#include <cmath>
#include <map>
#include <set>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/vllm_flags.h"
#include "formats/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace sparrow;

namespace {

using CommandResult = sparrow::testing::CliRun;
using sparrow::testing::slurp;

fs::path scratch_dir() {
  fs::path dir = fs::temp_directory_path() / ("sparrow_cli_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

// `within_s` > 0: killed after that many seconds (a server that should have refused to start).
CommandResult run(const std::string& args, int within_s = 0) { return sparrow::testing::run_sparrow(args, "", within_s); }

const fs::path kFixture = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/deepseek_v32";

void expect_one_line_error(const CommandResult& r, const std::string& must_contain) {
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(must_contain), std::string::npos) << r.err;
}

}  // namespace

TEST(Cli, ScoreWritesTheReferenceLogits) {
  if (!fs::exists(kFixture / "reference.safetensors")) GTEST_SKIP() << "fixture missing";
  fs::path out = scratch_dir() / "logits.safetensors";
  CommandResult r = run("score --model " + kFixture.string() + " --prompt-ids " + (kFixture / "prompts.json").string() +
              " --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.err;
  auto ours = SafetensorsFile::open(out.string());
  auto ref = SafetensorsFile::open((kFixture / "reference.safetensors").string());
  ASSERT_EQ(ours->tensors().size(), ref->tensors().size());
  for (const auto& [name, info] : ref->tensors()) {
    ASSERT_TRUE(ours->tensors().count(name)) << name;
    Tensor a = to_float32(ours->tensors().at(name), ours), b = to_float32(info, ref);
    ASSERT_EQ(a.shape(), b.shape()) << name;
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      diff += std::pow(double(a.data()[i]) - b.data()[i], 2);
      norm += std::pow(double(b.data()[i]), 2);
    }
    EXPECT_LE(std::sqrt(diff / norm), 1e-4) << name;
  }
}

TEST(Cli, GreedyGenerateMatchesTheReference) {
  if (!fs::exists(kFixture / "greedy.json")) GTEST_SKIP() << "fixture missing";
  CommandResult r = run("generate --model " + kFixture.string() + " --prompt-ids " + (kFixture / "prompts.json").string() +
              " --max-tokens 40 --temperature 0 --ignore-eos");
  ASSERT_EQ(r.status, 0) << r.err;
  auto got = nlohmann::json::parse(r.out);
  auto want = nlohmann::json::parse(slurp(kFixture / "greedy.json"));
  EXPECT_EQ(got["completions"], want["completions"]);
}

TEST(Cli, SeededSamplingIsReproducible) {
  if (!fs::exists(kFixture / "prompts.json")) GTEST_SKIP() << "fixture missing";
  std::string args = "generate --model " + kFixture.string() + " --prompt-ids " +
                     (kFixture / "prompts.json").string() + " --max-tokens 8 --temperature 0.8 --top-p 0.9 --seed 5";
  CommandResult a = run(args), b = run(args);
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
}

// Without a usable GPU (CI), --device cuda is one clear line, whatever the build.
// bench forward --profile: one part per kind of the stack's pieces (kimi_k3_1_pro's fixture: KDA and MLA +
// DSA mixers, a dense MLP and MoE layers), marked as often a step as the config has layers of that kind, in
// the order first met; the prefill step and each decode step profiled; shares that add up to the whole.
TEST(Cli, BenchForwardProfilesEachPartOfTheStack) {
  const fs::path model = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/kimi_k3_1_pro";
  const CommandResult r = run("bench forward --model " + model.string() +
                              " --prompt-tokens 40 --decode-tokens 3 --batch 2 --repeats 1 --profile");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  const nlohmann::json text = nlohmann::json::parse(slurp(model / "config.json"))["text_config"];
  std::map<std::string, double> expected = {{"embedding", 1}, {"final norm", 1}, {"lm_head", 1}};
  const std::vector<int> kda = text["linear_attn_config"]["kda_layers"];  // 1-indexed
  for (int layer = 0; layer < text["num_hidden_layers"].get<int>(); ++layer) {
    expected[std::count(kda.begin(), kda.end(), layer + 1) ? "mixer kda" : "mixer mla+dsa"] += 1;
    expected[layer < text["first_k_dense_replace"].get<int>() ? "ffn mlp" : "ffn moe"] += 1;
  }
  for (const char* phase : {"prefill", "decode"}) {
    SCOPED_TRACE(phase);
    const nlohmann::json& p = out["profile"][phase];
    EXPECT_EQ(p["steps"], std::string(phase) == "prefill" ? 1 : 3);
    std::map<std::string, double> seen;
    std::vector<std::string> order;
    double share = 0, ms = 0;
    for (const auto& part : p["parts"]) {
      seen[part["part"]] = part["per_step"].get<double>();
      order.push_back(part["part"]);
      share += part["share"].get<double>();
      ms += part["ms_per_step"].get<double>();
      EXPECT_GE(part["ms_per_step"].get<double>(), 0.0) << part;
    }
    EXPECT_EQ(seen, expected);
    EXPECT_EQ(order.front(), "embedding");
    EXPECT_EQ(order.back(), "lm_head");
    EXPECT_NEAR(share, 1.0, 1e-9);
    EXPECT_NEAR(ms, p["ms_per_step"].get<double>(), 1e-9);
    EXPECT_GT(ms, 0.0);
  }
  EXPECT_NE(r.err.find("decode step, profiled (3 steps, eager)"), std::string::npos) << r.err;
  // Without --profile, no profile (and no eager detour).
  const CommandResult plain = run("bench forward --model " + model.string() +
                                  " --prompt-tokens 8 --decode-tokens 1 --repeats 1");
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_FALSE(nlohmann::json::parse(plain.out).contains("profile"));
}

// bench forward --images-per-prompt (issue 30): each prompt holds the images' placeholders (the fixture's processor
// makes 6 of a 97x61 image: a 2x3 grid of merged windows), prefill counts them and includes the tower's time,
// which the JSON reports (and the profile beside the step's parts); a model without a tower or a bad size is one line.
TEST(Cli, BenchForwardWithImagesTimesTheTower) {
  const fs::path model = fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures/minimax_m3_vl";
  const CommandResult r = run("bench forward --model " + model.string() +
                              " --prompt-tokens 10 --decode-tokens 2 --batch 2 --repeats 1 --images-per-prompt 2"
                              " --image-size 97x61 --profile");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["images_per_prompt"], 2);
  EXPECT_EQ(out["image_tokens_per_prompt"], 12);
  EXPECT_GT(out["encoder_ms"].get<double>(), 0.0);
  EXPECT_GT(out["encoder_share_of_prefill"].get<double>(), 0.0);
  EXPECT_LT(out["encoder_share_of_prefill"].get<double>(), 1.0);
  EXPECT_GT(out["profile"]["encoder_ms"].get<double>(), 0.0);
  EXPECT_NE(r.err.find("vision encoder (host, before the prefill step)"), std::string::npos) << r.err;
  expect_one_line_error(run("bench forward --model " + kFixture.string() + " --images-per-prompt 1"), "no vision tower");
  expect_one_line_error(run("bench forward --model " + model.string() + " --images-per-prompt 1 --image-size 97"),
                        "--image-size");
}

TEST(Cli, DeviceCudaWithoutAGpuIsOneLine) {
#if SPARROW_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) GTEST_SKIP() << "a GPU is present";
#endif
  expect_one_line_error(run("score --device cuda --model " + kFixture.string() + " --prompt-ids " +
                            (kFixture / "prompts.json").string() + " --out /tmp/unused.safetensors"),
                        "--device");
}

TEST(Cli, BadInputGivesOneLineErrors) {
  fs::path dir = scratch_dir();
  expect_one_line_error(run("score --model /nonexistent/model --prompt-ids x.json --out y"), "");
  {
    std::ofstream(dir / "bad.json") << "{not json";
    expect_one_line_error(run("generate --model " + kFixture.string() + " --prompt-ids " +
                              (dir / "bad.json").string() + " --max-tokens 2"),
                          "not valid JSON");
  }
  {
    std::ofstream(dir / "empty.json") << R"({"prompts": [[]]})";
    expect_one_line_error(run("generate --model " + kFixture.string() + " --prompt-ids " +
                              (dir / "empty.json").string() + " --max-tokens 2"),
                          "non-empty");
  }
  if (!fs::exists(kFixture / "config.json")) return;
  {
    std::ofstream(dir / "big.json") << R"({"prompts": [[1, 2, 99999999]]})";
    expect_one_line_error(run("generate --model " + kFixture.string() + " --prompt-ids " +
                              (dir / "big.json").string() + " --max-tokens 2"),
                          "vocabulary");
  }
  {
    // Same weights, unknown model_type.
    fs::path model = dir / "unknown_type";
    fs::create_directories(model);
    for (const auto& f : fs::directory_iterator(kFixture))
      if (f.path().extension() == ".safetensors" || f.path().extension() == ".json")
        fs::copy_file(f.path(), model / f.path().filename(), fs::copy_options::overwrite_existing);
    auto config = nlohmann::json::parse(slurp(kFixture / "config.json"));
    config["model_type"] = "llama_turbo";
    std::ofstream(model / "config.json") << config.dump();
    expect_one_line_error(run("generate --model " + model.string() + " --prompt-ids " +
                              (kFixture / "prompts.json").string() + " --max-tokens 2"),
                          "model_type");
  }
  expect_one_line_error(run("generate --model " + kFixture.string() + " --prompt-ids " +
                            (kFixture / "prompts.json").string() + " --max-tokens 2 --temperature -1"),
                        "temperature");
  expect_one_line_error(run("score --device tpu --model " + kFixture.string() + " --prompt-ids " +
                            (kFixture / "prompts.json").string() + " --out " + (dir / "x.safetensors").string()),
                        "unknown device 'tpu'");
}

TEST(Cli, ServeRejectsBadHttpFlagsBeforeLoading) {
  // The flags are checked before the model is looked for (which would fail too, with another message).
  auto serve = [](const std::string& flags) { return run("serve /nonexistent/model " + flags); };
  expect_one_line_error(serve("--port 99999"), "--port must be in 0-65535 (got 99999)");
  expect_one_line_error(serve("--port -1"), "--port must be in 0-65535");
  expect_one_line_error(serve("--http-header-timeout -1"), "--http-header-timeout must be more than 0");
  expect_one_line_error(serve("--http-request-timeout 0"), "--http-request-timeout must be more than 0");
  expect_one_line_error(serve("--http-keep-alive-timeout -5"), "--http-keep-alive-timeout must be 0 or more");
  expect_one_line_error(serve("--http-max-connections 0"), "--http-max-connections");
  expect_one_line_error(serve("--max-queued-requests -1"), "--max-queued-requests");
  expect_one_line_error(serve("--http-max-body-size 12XB"), "--http-max-body-size");
}

// `sparrow serve` refuses what vLLM refuses before it loads anything: a model that is not a local folder
// (a hub id is not downloaded), a --max-model-len beyond the model's positions, a --generation-config
// folder that does not exist, and generation defaults that do not fit their fields.
TEST(Cli, ServeStartUpErrorsAreOneLine) {
  const int within_s = 120;  // they fail at once; a server that started would be killed instead
  expect_one_line_error(run("serve /nonexistent/model --port 0", within_s), "/nonexistent/model: not a directory");
  expect_one_line_error(run("serve deepseek-ai/DeepSeek-V3.2 --port 0", within_s),
                        "not a directory (sparrow reads a local Hugging Face model folder and downloads nothing: fetch "
                        "it first, e.g. `huggingface-cli download deepseek-ai/DeepSeek-V3.2 --local-dir DIR`");
  if (!fs::exists(kFixture / "config.json")) return;
  const std::string model = "serve " + kFixture.string() + " --port 0 --kv-cache-memory 64MiB";
  expect_one_line_error(run(model + " --max-model-len 100000", within_s),
                        "--max-model-len 100000 is more than the model's 256 positions (max_position_embeddings in ");
  expect_one_line_error(run(model + " --generation-config /nonexistent/folder", within_s),
                        "--generation-config /nonexistent/folder: not a directory");
  fs::path defaults = scratch_dir() / "huge_generation_config";
  fs::create_directories(defaults);
  std::ofstream(defaults / "generation_config.json") << R"({"temperature": 1e39})";
  expect_one_line_error(run(model + " --generation-config " + defaults.string(), within_s),
                        "\"temperature\" is out of range (1e+39)");
}

// A vLLM command line starts sparrow (issue 27): the `vllm serve` flags sparrow has no setting for
// (src/cli/vllm_flags.h) are refused with the reason before anything loads, or accepted with a notice;
// those meaning what sparrow does anyway pass silently. tests/server/test_vllm_command_line.py serves
// with a whole vLLM command line.
TEST(Cli, VllmFlagsWithoutASparrowSettingAreRefusedWithTheReason) {
  const int within_s = 120;
  auto serve = [&](const std::string& flags) { return run("serve /nonexistent/model --port 0 " + flags, within_s); };
  expect_one_line_error(serve("--ssl-keyfile key.pem"),
                        "--ssl-keyfile key.pem: not supported: sparrow serves plain HTTP");
  expect_one_line_error(serve("-pp 2"), "--pipeline-parallel-size 2: not supported: pipeline parallelism");
  expect_one_line_error(serve("-dpl=2"), "--data-parallel-size-local 2: not supported: sparrow places the data-parallel ranks");
  expect_one_line_error(serve("--lora-target-modules q_proj"), "--lora-target-modules q_proj: not supported: not part of sparrow's LoRA support");
  expect_one_line_error(serve("--spec-model m"), "--spec-model m: not supported: give speculative decoding as --speculative-config");
  expect_one_line_error(serve(R"(--speculative-config '{"method":"ngram"}')"),
                        "--speculative-config needs \"num_speculative_tokens\"");
  // What sparrow does anyway passes silently: the model-folder error is the only line.
  expect_one_line_error(serve("-dp 1 -pp 1 --dtype auto --enable-chunked-prefill --scheduling-policy fcfs"),
                        "/nonexistent/model: not a directory");
  // Ignored flags print one notice each, then the start-up goes on (here to the model-folder error).
  const CommandResult r = serve("--trust-remote-code --swap-space 4 --disable-chunked-prefill");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("sparrow serve: --trust-remote-code: ignored: sparrow's model code is built in"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sparrow serve: --swap-space 4: ignored: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sparrow serve: --disable-chunked-prefill: ignored: chunked prefill is always on"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("error: /nonexistent/model: not a directory"), std::string::npos) << r.err;
  if (!fs::exists(kFixture / "config.json")) return;
  expect_one_line_error(run("serve " + kFixture.string() + " --port 0 --block-size 16", within_s),
                        "--block-size must be 64, 128 or 256: the block sizes sparrow's packed cache rows and their "
                        "kernels are built for (docs/cache.md); vLLM's default of 16 is not one of them");
}

TEST(Cli, VersionFlagPrintsTheVersion) {
  const CommandResult r = run("--version");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, std::string(SPARROW_VERSION) + "\n");
}

// Every flag of vLLM 0.33.0's `vllm serve` (tests/data/vllm_0.33.0_serve_flags.txt) is one of serve's own
// (its --help lists it) or in the table of vllm_flags.h, so none makes a vLLM command line fail to parse.
TEST(Cli, ServeTakesEveryFlagOfVllmServe) {
  const CommandResult help = run("serve --help");
  ASSERT_EQ(help.status, 0) << help.err;
  std::set<std::string> known;
  for (const sparrow::cli::VllmFlag& flag : sparrow::cli::vllm_only_flags()) {
    std::stringstream names(flag.names);
    for (std::string name; std::getline(names, name, ',');) known.insert(name[0] == '!' ? name.substr(1) : name);
  }
  std::ifstream list(fs::path(SPARROW_SOURCE_DIR) / "tests/data/vllm_0.33.0_serve_flags.txt");
  ASSERT_TRUE(list) << "tests/data/vllm_0.33.0_serve_flags.txt";
  int checked = 0;
  for (std::string name; std::getline(list, name);) {
    if (name.empty() || name[0] == '#') continue;
    ++checked;
    const std::string expanded = sparrow::cli::expand_vllm_short_flag(name);
    const bool own = help.out.find(expanded + " ") != std::string::npos || help.out.find(expanded + ",") != std::string::npos ||
                     help.out.find(expanded + "{") != std::string::npos || help.out.find(expanded + "\n") != std::string::npos;
    EXPECT_TRUE(own || known.count(expanded)) << name << ": neither a serve flag nor in src/cli/vllm_flags.cpp";
  }
  EXPECT_GT(checked, 300);
}
