// The table of vLLM flags sparrow accepts without a setting of its own (src/cli/vllm_flags.h): every entry
// documented in docs/server.md, none shadowing one of sparrow's own options, the short spellings expanded.
#include "cli/vllm_flags.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "test_util.h"

namespace {

using namespace sparrow::cli;

std::string first_name(const VllmFlag& flag) { return flag.names.substr(0, flag.names.find(',')); }

TEST(VllmFlags, DocsServerMdListsEveryEntryWithItsAction) {
  const std::string docs = sparrow::testing::slurp(std::filesystem::path(SPARROW_SOURCE_DIR) / "docs/server.md");
  for (const VllmFlag& flag : vllm_only_flags()) {
    const std::string action = flag.action == VllmFlagAction::Ignore ? "ignored" : "refused";
    const std::string cell = "| `" + first_name(flag) + "`";
    const size_t at = docs.find(cell);
    ASSERT_NE(at, std::string::npos) << first_name(flag) << " is not in docs/server.md's table of vLLM flags";
    const std::string line = docs.substr(at, docs.find('\n', at) - at);
    EXPECT_NE(line.find("| " + action + " |"), std::string::npos) << line << " (want: " << action << ")";
  }
}

TEST(VllmFlags, NamesAreUniqueAndNoneIsASparrowFlag) {
  std::set<std::string> seen;
  for (const VllmFlag& flag : vllm_only_flags()) EXPECT_TRUE(seen.insert(first_name(flag)).second) << first_name(flag);
  // A table entry naming one of serve's own flags would make `sparrow serve` throw CLI::OptionAlreadyAdded
  // at start (so every CLI test would fail); these are the ones most easily added twice.
  for (const char* own : {"--tensor-parallel-size", "--decode-context-parallel-size", "--max-model-len", "--kv-cache-dtype", "--block-size",
                          "--enforce-eager", "--load-format", "--seed", "--device", "--port", "--host"})
    EXPECT_EQ(seen.count(own), 0u) << own;
  CLI::App app;
  EXPECT_NO_THROW(add_vllm_only_flags(&app));
}

TEST(VllmFlags, MultiLetterShortSpellingsExpand) {
  EXPECT_EQ(expand_vllm_short_flag("-tp"), "--tensor-parallel-size");
  EXPECT_EQ(expand_vllm_short_flag("-tp=4"), "--tensor-parallel-size=4");
  EXPECT_EQ(expand_vllm_short_flag("-pp"), "--pipeline-parallel-size");
  EXPECT_EQ(expand_vllm_short_flag("-dcp=2"), "--decode-context-parallel-size=2");
  EXPECT_EQ(expand_vllm_short_flag("-dpl"), "--data-parallel-size-local");
  EXPECT_EQ(expand_vllm_short_flag("-q"), "-q");  // one letter: CLI11 names it itself
  EXPECT_EQ(expand_vllm_short_flag("-tpx"), "-tpx");
  EXPECT_EQ(expand_vllm_short_flag("model-tp"), "model-tp");
}

}  // namespace
