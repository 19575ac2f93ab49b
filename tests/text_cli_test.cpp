// The text commands of the `sparrow` binary on the bundled trained models, as a user runs them:
// perplexity equal to what transformers measures (tools/perplexity_reference.py wrote the reference),
// generate --prompt continuing Python with the default model (as generate --prompt-ids does for the same
// ids: one engine loop under both), and chat calling the calculator tool.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/generate.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource = SPARROW_SOURCE_DIR;
const fs::path kPerplexityData = kSource / "tests/data/perplexity";

using CommandResult = sparrow::testing::CliRun;
using sparrow::testing::slurp;

// Runs `sparrow ARGS` with `input` on its stdin, from a scratch directory (so that the bundled model
// must be found from the executable, not the current directory).
CommandResult run(const std::string& args, const std::string& input = "") {
  return sparrow::testing::run_sparrow(args, input);
}

// The OpenAI tools list of the calculator the bundled models were trained to call.
const char* kCalculatorTool = R"([{"type": "function", "function": {
  "name": "calculator",
  "description": "Evaluate an arithmetic expression with + - * / and parentheses; returns its value.",
  "parameters": {"type": "object", "properties": {
    "expression": {"type": "string", "description": "The expression, for example \"(12 + 7) * 3\"."}},
    "required": ["expression"]}}}])";

}  // namespace

TEST(TextCli, PerplexityEqualsTransformersOnEveryBundledModel) {
  const nlohmann::json reference = nlohmann::json::parse(slurp(kPerplexityData / "reference.json"));
  const fs::path text = kPerplexityData / reference["text"].get<std::string>();
  ASSERT_GE(reference["models"].size(), 2u);
  for (const auto& [name, expected] : reference["models"].items()) {
    SCOPED_TRACE(name);
    CommandResult r = run("perplexity --model " + (kSource / "models" / name).string() + " --file " + text.string());
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json got = nlohmann::json::parse(r.out);
    EXPECT_EQ(got["tokens"], expected["tokens"]);
    EXPECT_EQ(got["window"], expected["window"]);
    const double want = expected["perplexity"].get<double>();
    EXPECT_NEAR(got["perplexity"].get<double>(), want, 0.005 * want);
  }
}

TEST(TextCli, PerplexityWindowChangesTheResult) {
  // A shorter window gives each token less context, so the reference's window really is the one used.
  const fs::path text = kPerplexityData / "imghdr.py.txt";
  CommandResult full = run("perplexity --file " + text.string());
  CommandResult short_windows = run("perplexity --file " + text.string() + " --context 64");
  ASSERT_EQ(full.status, 0) << full.err;
  ASSERT_EQ(short_windows.status, 0) << short_windows.err;
  const auto a = nlohmann::json::parse(full.out), b = nlohmann::json::parse(short_windows.out);
  EXPECT_EQ(b["window"], 64);
  EXPECT_GT(b["perplexity"].get<double>(), a["perplexity"].get<double>());
}

TEST(TextCli, GenerateContinuesPythonWithTheDefaultModel) {
  CommandResult r = run("generate --prompt 'def fibonacci(n):' --temperature 0 --max-tokens 40");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.back(), '\n');
  const std::string text = r.out.substr(0, r.out.size() - 1);
  EXPECT_EQ(text.find("def fibonacci(n):"), std::string::npos) << "the prompt must not be repeated: " << text;
  EXPECT_TRUE(text.find("return") != std::string::npos || text.find(':') != std::string::npos ||
              text.find('\n') != std::string::npos)
      << text;
  // Greedy generation is deterministic.
  EXPECT_EQ(run("generate --prompt 'def fibonacci(n):' --temperature 0 --max-tokens 40").out, r.out);
}

// `generate --prompt` runs the engine's loop as `generate --prompt-ids` does: the text it streams is the
// decoding of the tokens the JSON form returns for the prompt's ids (less the end token), greedy or
// seeded, and at the model's context it stops where a request for the room left would.
TEST(TextCli, GenerateTextIsTheDecodedContinuationOfItsPromptIds) {
  sparrow::testing::TempDir dir;
  const std::string bundled = (kSource / "models/minimax_m3").string();
  auto tokenizer = sparrow::load_tokenizer(bundled);
  const std::set<int32_t> end_tokens = sparrow::eos_token_ids(bundled);
  const std::string prompt = "def fibonacci(n):";
  const std::vector<int32_t> prompt_ids = tokenizer->encode_with_special_tokens(prompt);
  const std::string prompt_ids_path = dir.write("prompt.json", nlohmann::json({{"prompts", {prompt_ids}}}).dump());
  auto expect_same_continuation = [&](const std::string& model, const std::string& text_flags,
                                      const std::string& ids_flags) {
    SCOPED_TRACE(text_flags);
    CommandResult text = run("generate --model " + model + " --prompt '" + prompt + "' " + text_flags);
    CommandResult ids = run("generate --model " + model + " --prompt-ids " + prompt_ids_path + " " + ids_flags);
    ASSERT_EQ(text.status, 0) << text.err;
    ASSERT_EQ(ids.status, 0) << ids.err;
    std::vector<int32_t> completion = nlohmann::json::parse(ids.out)["completions"][0].get<std::vector<int32_t>>();
    ASSERT_FALSE(completion.empty());
    if (end_tokens.count(completion.back())) completion.pop_back();  // kept in the ids, not written as text
    EXPECT_EQ(text.out, tokenizer->decode(completion) + "\n");
  };
  for (const std::string& flags : {"--temperature 0 --max-tokens 40", "--temperature 1 --seed 3 --max-tokens 300",
                                   "--temperature 1 --seed 3 --max-tokens 300 --ignore-eos"})
    expect_same_continuation(bundled, flags, flags);

  // A context of the prompt and 5 more tokens.
  const fs::path short_context = fs::path(dir.path()) / "short_context";
  fs::create_directories(short_context);
  for (const auto& entry : fs::directory_iterator(bundled))
    if (entry.path().filename() != "config.json")
      fs::create_symlink(entry.path(), short_context / entry.path().filename());
  nlohmann::json config = nlohmann::json::parse(slurp(fs::path(bundled) / "config.json"));
  config["seq_length"] = prompt_ids.size() + 5;
  std::ofstream(short_context / "config.json") << config.dump();
  expect_same_continuation(short_context.string(), "--temperature 0 --max-tokens 40 --ignore-eos",
                           "--temperature 0 --max-tokens 5 --ignore-eos");
}

TEST(TextCli, ChatShowsReasoningAndTheCalculatorCall) {
  sparrow::testing::TempDir dir;
  const std::string tools = dir.write("tools.json", kCalculatorTool);
  CommandResult r = run("chat --tools " + tools, "What is 48 * 17?\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("thinking: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tool call: calculator {\"expression\":\"48 * 17\"}"), std::string::npos) << r.out;
  // Markup of the tool-call syntax never reaches the screen.
  EXPECT_EQ(r.out.find("<invoke"), std::string::npos) << r.out;
}

TEST(TextCli, ChatAnswersFromAPastedToolResult) {
  sparrow::testing::TempDir dir;
  const std::string tools = dir.write("tools.json", kCalculatorTool);
  CommandResult r = run("chat --tools " + tools, "What is 48 * 17?\n/tool {\"result\": 816}\n/exit\nnot read\n");
  ASSERT_EQ(r.status, 0) << r.err;
  const size_t call = r.out.find("tool call: calculator");
  ASSERT_NE(call, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("816", call), std::string::npos) << r.out;
}

TEST(TextCli, BadUseIsAOneLineError) {
  for (const std::string& args : {std::string("generate"), std::string("generate --prompt x --prompt-ids y.json"),
                                  std::string("perplexity --file /nonexistent.txt"),
                                  std::string("chat --model /nonexistent/model")}) {
    SCOPED_TRACE(args);
    CommandResult r = run(args);
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// Every command takes the context length by one rule (cli/common.cpp, model_context_length): the
// smallest of config.json's length fields, and a one-line error when it has none.
TEST(TextCli, ContextLengthIsTheSmallestLengthFieldForEveryCommand) {
  sparrow::testing::TempDir dir;
  const fs::path bundled = kSource / "models/minimax_m3";
  nlohmann::json config = nlohmann::json::parse(slurp(bundled / "config.json"));
  auto model_with = [&](const std::string& name, const nlohmann::json& edited) {
    fs::path folder = fs::path(dir.path()) / name;
    fs::create_directories(folder);
    for (const auto& entry : fs::directory_iterator(bundled))
      if (entry.path().filename() != "config.json") fs::create_symlink(entry.path(), folder / entry.path().filename());
    std::ofstream(folder / "config.json") << edited.dump();
    return folder.string();
  };
  nlohmann::json short_context = config;
  short_context["seq_length"] = 4;  // smaller than max_position_embeddings: this one counts
  const std::string short_model = model_with("short", short_context);
  CommandResult generated = run("generate --model " + short_model + " --prompt 'def fibonacci(n):'");
  EXPECT_EQ(generated.status, 1) << generated.err;
  auto line = [](const std::string& err) { return err.substr(0, err.find('\n')); };
  EXPECT_TRUE(sparrow::testing::mentions(line(generated.err), {"more than the model's context of 4"})) << generated.err;
  CommandResult scored = run("perplexity --model " + short_model + " --file " + short_model + "/README.md --context 8");
  EXPECT_EQ(scored.status, 1) << scored.err;
  EXPECT_TRUE(sparrow::testing::mentions(line(scored.err), {"model's context (4)"})) << scored.err;
  nlohmann::json no_length = config;
  no_length.erase("max_position_embeddings");
  if (no_length.contains("text_config")) no_length["text_config"].erase("max_position_embeddings");
  CommandResult r = run("generate --model " + model_with("none", no_length) + " --prompt x");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(sparrow::testing::mentions(line(r.err), {"error: ", "config.json: no context length"})) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}
