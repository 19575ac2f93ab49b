// Agreement with Hugging Face transformers on the committed fixtures (tests/fixtures/<name>/, written by
// tools/make_fixtures.py): tiny random checkpoints of every family with the logits and greedy tokens
// transformers 5.17 computes for them. Each fixture folder is its own instance of every test below:
//   - one prefill per prompt gives transformers' logits at every position (relative L2 <= 1e-4);
//   - greedy decoding against the cache, one token at a time, gives transformers' 40 tokens exactly;
//   - prefill then decode, and prefill in chunks of 7, equal one long prefill;
//   - sequences batched together equal the same sequences run alone.
// The fixtures are built so that no top-k or greedy choice is a near-tie (see the tool), so any token
// difference is a real difference. SPARROW_FIXTURES=<folder> runs the tests on another set of fixtures.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cuda/model_test_util.h"  // device-free: row errors, argmax
#include "formats/safetensors.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

// The committed fixtures, or SPARROW_FIXTURES=<folder> to run the same tests on fixtures written
// elsewhere (e.g. by make_fixtures.py --out /tmp/f --override ...).
fs::path fixture_root() {
  const char* chosen = std::getenv("SPARROW_FIXTURES");
  return chosen && *chosen ? fs::path(chosen) : fs::path(SPARROW_SOURCE_DIR) / "tests/fixtures";
}

// Relative L2 error allowed per position. Ours vs transformers: the phase's target. Ours vs ours along
// another path (cache, chunks, batch): pure fp32 reordering, measured at <= 4e-6 on these fixtures; a
// real bug (a lost cache entry, a leak between sequences) is orders of magnitude larger.
constexpr double kReferenceTolerance = 1e-4;
constexpr double kConsistencyTolerance = 2e-5;
constexpr int64_t kChunk = 7;

using Tokens = std::vector<int32_t>;

// Every fixture folder with a reference, sorted so test names are stable.
std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  if (!fs::is_directory(fixture_root())) return names;
  for (const fs::directory_entry& entry : fs::directory_iterator(fixture_root()))
    if (entry.is_directory() && fs::exists(entry.path() / "reference.safetensors"))
      names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return nlohmann::json::parse(in);
}

std::vector<Tokens> read_token_lists(const fs::path& path, const char* key) {
  const nlohmann::json json = read_json(path);  // named: a range-for would not keep it alive
  std::vector<Tokens> lists;
  for (const auto& list : json.at(key)) lists.push_back(list.get<Tokens>());
  return lists;
}

struct Fixture {
  std::vector<Tokens> prompts;
  std::vector<Tokens> completions;  // greedy continuation of each prompt
  std::vector<Tensor> logits;       // [prompt length, vocab] per prompt
};

Fixture read_fixture(const fs::path& dir) {
  Fixture f;
  f.prompts = read_token_lists(dir / "prompts.json", "prompts");
  f.completions = read_token_lists(dir / "greedy.json", "completions");
  std::shared_ptr<SafetensorsFile> file = SafetensorsFile::open((dir / "reference.safetensors").string());
  for (size_t i = 0; i < f.prompts.size(); ++i) {
    const std::string name = "logits." + std::to_string(i);
    auto it = file->tensors().find(name);
    if (it == file->tensors().end()) throw std::runtime_error("reference.safetensors has no " + name);
    f.logits.push_back(to_float32(it->second, file));
  }
  return f;
}

using model_test::argmax;       // the largest logit, ties to the smaller id
using model_test::relative_l2;  // ||ours - ref|| / ||ref|| over one row, in double

// Passes when every row of `ours` is within `tolerance` (relative L2) of the same row of `ref`;
// otherwise names the worst position, its error and both argmaxes.
::testing::AssertionResult rows_match(const Tensor& ours, const Tensor& ref, double tolerance) {
  if (ours.shape() != ref.shape())
    return ::testing::AssertionFailure() << "logits shape " << shape_str(ours.shape()) << ", expected "
                                         << shape_str(ref.shape());
  const int64_t vocab = ref.dim(1);
  int64_t worst = 0;
  double worst_error = -1;
  for (int64_t t = 0; t < ref.dim(0); ++t) {
    double error = relative_l2(ours.row(t), ref.row(t), vocab);
    if (!(error <= worst_error)) {  // NaN counts as worst
      worst = t;
      worst_error = error;
    }
  }
  if (worst_error <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "worst position " << worst << " of " << ref.dim(0) << ": relative L2 error "
                                       << worst_error << " > " << tolerance << " (argmax ours "
                                       << argmax(ours.row(worst), vocab) << ", expected "
                                       << argmax(ref.row(worst), vocab) << ")";
}

// Runs one batch of (state, new tokens) pairs and returns the logits of every new token.
Tensor run(Model& model, const std::vector<std::pair<SequenceState*, Tokens>>& parts) {
  Batch batch = make_batch(parts);
  batch.all_logits = true;
  return sparrow::testing::run_step(model, batch);
}

// The logits of `tokens` as one prefill of a fresh sequence.
Tensor prefill(Model& model, const Tokens& tokens) {
  SequenceState state = sparrow::testing::new_sequence(model);
  return run(model, {{&state, tokens}});
}

// The logits of a sequence fed in several steps, laid end to end.
Tensor concat_rows(const std::vector<Tensor>& pieces, int64_t vocab) {
  int64_t rows = 0;
  for (const Tensor& p : pieces) rows += p.dim(0);
  Tensor out = Tensor::empty({rows, vocab});
  int64_t at = 0;
  for (const Tensor& p : pieces) {
    std::copy(p.data(), p.data() + p.numel(), out.row(at));
    at += p.dim(0);
  }
  return out;
}

Tokens slice(const Tokens& tokens, size_t begin, size_t end) {
  return Tokens(tokens.begin() + begin, tokens.begin() + end);
}

std::string describe(const Tokens& prompt, size_t index) {
  return "prompt " + std::to_string(index) + " (" + std::to_string(prompt.size()) + " tokens)";
}

class Reference : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fixture_root() / GetParam();
    try {
      fixture_ = read_fixture(dir_);
    } catch (const std::exception& e) {
      GTEST_FAIL() << "cannot read fixture " << dir_ << ": " << e.what();
    }
    ASSERT_EQ(fixture_.prompts.size(), fixture_.completions.size()) << "prompts.json vs greedy.json";
    ASSERT_GE(fixture_.prompts.size(), 2u) << "a fixture needs at least two prompts";
    try {
      model_ = load_model(dir_.string());
    } catch (const Error& e) {
      GTEST_FAIL() << "load_model(" << dir_.string() << ") failed: " << e.what();
    }
    ASSERT_TRUE(model_);
    vocab_ = model_->vocab_size();
    ASSERT_EQ(vocab_, fixture_.logits[0].dim(1)) << "vocab_size vs reference logits";
  }

  // The longest prompt, which runs past every sparse budget.
  const Tokens& longest_prompt() const {
    return *std::max_element(fixture_.prompts.begin(), fixture_.prompts.end(),
                             [](const Tokens& a, const Tokens& b) { return a.size() < b.size(); });
  }

  fs::path dir_;
  Fixture fixture_;
  std::unique_ptr<Model> model_;
  int64_t vocab_ = 0;
};

TEST_P(Reference, PrefillLogitsMatchTransformers) {
  for (size_t i = 0; i < fixture_.prompts.size(); ++i) {
    Tensor ours = prefill(*model_, fixture_.prompts[i]);
    EXPECT_TRUE(rows_match(ours, fixture_.logits[i], kReferenceTolerance)) << describe(fixture_.prompts[i], i);
  }
}

TEST_P(Reference, GreedyDecodeMatchesTransformers) {
  for (size_t i = 0; i < fixture_.prompts.size(); ++i) {
    const Tokens& expected = fixture_.completions[i];
    SequenceState state = sparrow::testing::new_sequence(*model_);
    Batch batch = make_batch({{&state, fixture_.prompts[i]}});
    batch.all_logits = false;
    Tensor last = sparrow::testing::run_step(*model_, batch);
    Tokens generated;
    while (generated.size() < expected.size()) {
      ASSERT_EQ(last.shape(), Shape({1, vocab_})) << "logits of the last token only";
      generated.push_back(argmax(last.row(0), vocab_));
      Batch step = make_batch({{&state, {generated.back()}}});
      step.all_logits = false;
      last = sparrow::testing::run_step(*model_, step);
    }
    auto first_difference = std::mismatch(generated.begin(), generated.end(), expected.begin()).first;
    EXPECT_EQ(generated, expected) << describe(fixture_.prompts[i], i) << ": first difference at step "
                                   << (first_difference - generated.begin());
  }
}

TEST_P(Reference, PrefillThenDecodeEqualsOnePrefill) {
  const Tokens& prompt = longest_prompt();
  Tensor whole = prefill(*model_, prompt);
  SequenceState state = sparrow::testing::new_sequence(*model_);
  const size_t half = prompt.size() / 2;
  std::vector<Tensor> pieces = {run(*model_, {{&state, slice(prompt, 0, half)}})};
  for (size_t t = half; t < prompt.size(); ++t) pieces.push_back(run(*model_, {{&state, {prompt[t]}}}));
  EXPECT_EQ(state.length, int64_t(prompt.size()));
  EXPECT_TRUE(rows_match(concat_rows(pieces, vocab_), whole, kConsistencyTolerance))
      << "prefill of " << half << " tokens, then " << prompt.size() - half << " decodes";
}

TEST_P(Reference, ChunkedPrefillEqualsOnePrefill) {
  const Tokens& prompt = longest_prompt();
  Tensor whole = prefill(*model_, prompt);
  SequenceState state = sparrow::testing::new_sequence(*model_);
  std::vector<Tensor> pieces;
  for (size_t begin = 0; begin < prompt.size(); begin += kChunk)
    pieces.push_back(run(*model_, {{&state, slice(prompt, begin, std::min(prompt.size(), begin + kChunk))}}));
  EXPECT_TRUE(rows_match(concat_rows(pieces, vocab_), whole, kConsistencyTolerance))
      << "chunks of " << kChunk << " tokens";
}

// Two sequences share every batch: first both prefill, then one decodes a token while the other
// continues with several (a mixed prefill / decode step). Each must see only its own history.
TEST_P(Reference, BatchedSequencesEqualSeparateRuns) {
  const Tokens& a_prompt = fixture_.prompts.back();
  const Tokens& b_prompt = fixture_.prompts.front();
  const Tokens a_next = slice(fixture_.completions.back(), 0, 1);
  const Tokens b_next = slice(fixture_.completions.front(), 0, std::min<size_t>(5, fixture_.completions[0].size()));

  SequenceState a = sparrow::testing::new_sequence(*model_), b = sparrow::testing::new_sequence(*model_);
  Tensor first = run(*model_, {{&a, a_prompt}, {&b, b_prompt}});
  Tensor second = run(*model_, {{&a, a_next}, {&b, b_next}});

  Tokens a_all = a_prompt, b_all = b_prompt;
  a_all.insert(a_all.end(), a_next.begin(), a_next.end());
  b_all.insert(b_all.end(), b_next.begin(), b_next.end());
  Tensor a_alone = prefill(*model_, a_all), b_alone = prefill(*model_, b_all);

  const int64_t a_len = int64_t(a_prompt.size()), b_len = int64_t(b_prompt.size());
  const int64_t a_more = int64_t(a_next.size()), b_more = int64_t(b_next.size());
  ASSERT_EQ(first.shape(), Shape({a_len + b_len, vocab_}));
  ASSERT_EQ(second.shape(), Shape({a_more + b_more, vocab_}));
  EXPECT_TRUE(rows_match(concat_rows({first.rows(0, a_len), second.rows(0, a_more)}, vocab_), a_alone,
                         kConsistencyTolerance))
      << "sequence A (" << a_len << " + " << a_more << " tokens) batched with B";
  EXPECT_TRUE(rows_match(concat_rows({first.rows(a_len, a_len + b_len), second.rows(a_more, a_more + b_more)}, vocab_),
                         b_alone, kConsistencyTolerance))
      << "sequence B (" << b_len << " + " << b_more << " tokens) batched with A";
}

// Test names must be identifiers: fixture folder names are, but keep it safe.
std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
}

}  // namespace

// An empty fixture list leaves Reference uninstantiated, which GoogleTest reports as a failure.
INSTANTIATE_TEST_SUITE_P(, Reference, ::testing::ValuesIn(fixture_names()), test_name);
