// Small helpers shared by tests: a temporary directory that cleans up after itself, checks on the
// one-line sparrow::Error messages that user mistakes must produce, offline CPU steps, and an engine's events
// gathered per request.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/planner.h"
#include "core/error.h"
#include "engine/engine_core.h"
#include "runner/dense_sequence_cache.h"
#include "runner/model_runner.h"

namespace sparrow::testing {

// A fresh directory under /tmp, removed with everything in it when the object goes away.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "sparrow_test_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  // Writes `bytes` to <dir>/<name> and returns the full path.
  std::string write(const std::string& name, const std::string& bytes) const {
    std::string full = file(name);
    std::ofstream out(full, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return full;
  }

 private:
  std::string path_;
};

// The message of the sparrow::Error that `f` throws, or "" when it throws none. Any other exception
// escapes and fails the test: user mistakes must surface as sparrow::Error.
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Passes when `message` is one line containing every part.
inline ::testing::AssertionResult mentions(const std::string& message, std::initializer_list<std::string> parts) {
  if (message.empty()) return ::testing::AssertionFailure() << "no sparrow::Error was thrown";
  if (message.find('\n') != std::string::npos) return ::testing::AssertionFailure() << "not one line: " << message;
  for (const std::string& part : parts)
    if (message.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << message << "' does not mention '" << part << "'";
  return ::testing::AssertionSuccess();
}

// A CPU cache of exactly `blocks` block rows (fp32 pages) and the state slots its plan gives recurrent
// models (snapshot slots for prefix caching, and for speculative decoding's rollbacks).
inline CacheConfig cache_with_blocks(const Model& model, int64_t block_size, int64_t blocks, int64_t max_num_seqs,
                                     bool prefix_caching = true, bool rollback_snapshots = false) {
  CacheConfig config;
  config.block_size = block_size;
  config.kv_cache_dtype = "float32";
  config.max_num_seqs = max_num_seqs;
  config.enable_prefix_caching = prefix_caching;
  config.rollback_snapshots = rollback_snapshots;
  config.memory_bytes = int64_t(1) << 30;
  const CachePlan plan = plan_cache(model.cache_spec(), config);
  config.memory_bytes = blocks * plan.row_bytes + (plan.num_state_slots + plan.num_snapshot_slots) * plan.state_slot_bytes;
  return config;
}

// Offline steps on the CPU, as tools run them: a sequence with its own cache, and one step through a
// runner (runner/model_runner.h). A CPU runner keeps nothing between steps, so a fresh one per step runs
// exactly what a long-lived one would.
inline SequenceState new_sequence(const Model& model) { return standalone_sequence(model.cache_spec()); }
inline Tensor run_step(Model& model, const Batch& batch) { return ModelRunner(model).run(batch); }

// A model that runs `inner` except that a batch holding the token `poison` fails, as a GPU out of memory
// would mid-step (the engine's and generate()'s error paths).
class FailingModel : public Model {
 public:
  FailingModel(std::unique_ptr<Model> inner, int32_t poison) : inner_(std::move(inner)), poison_(poison) {}
  const std::string& model_type() const override { return inner_->model_type(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  int64_t num_layers() const override { return inner_->num_layers(); }
  std::vector<LayerCacheSpec> cache_spec() const override { return inner_->cache_spec(); }
  Tensor forward(const Batch& batch, StepMarks* marks) override {
    if (std::count(batch.tokens.begin(), batch.tokens.end(), poison_)) fail("poisoned batch");
    return inner_->forward(batch, marks);
  }

 private:
  std::unique_ptr<Model> inner_;
  int32_t poison_;
};

// What an engine sent for one request id, its events joined: the engine tests compare these.
struct Gathered {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  int64_t cached_tokens = 0;  // the most any event reported
};
using GatheredOutputs = std::map<std::string, Gathered>;

// engine.add(request) with a callback that joins its events into out[request id].
inline void add_gathering(EngineCore& engine, const Request& request, GatheredOutputs& out) {
  engine.add(request, [&out](const RequestOutput& e) {
    Gathered& g = out[e.request_id];
    g.tokens.insert(g.tokens.end(), e.new_tokens.begin(), e.new_tokens.end());
    g.logprobs.insert(g.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    g.prompt_logprobs.insert(g.prompt_logprobs.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
    g.cached_tokens = std::max(g.cached_tokens, e.cached_tokens);
  });
}

// A file's bytes ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// `sparrow ARGS` (the binary under test) from a fresh scratch directory, so that nothing is found relative
// to the current one (the bundled models must be found from the executable); `input` on its stdin; killed
// after `within_s` seconds when positive (a server that should have refused to start).
struct CliRun {
  int status = -1;  // the exit status; -1 when killed by a signal
  std::string out, err;
};
inline CliRun run_sparrow(const std::string& args, const std::string& input = "", int within_s = 0) {
  TempDir dir;
  const std::string stdin_path = dir.write("stdin", input);
  const std::string command = "cd " + dir.path() + " && " +
                              (within_s > 0 ? "timeout " + std::to_string(within_s) + " " : std::string()) +
                              SPARROW_BINARY + " " + args + " <" + stdin_path + " >" + dir.file("out") + " 2>" +
                              dir.file("err");
  const int rc = std::system(command.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(dir.file("out")), slurp(dir.file("err"))};
}

}  // namespace sparrow::testing
