// Mask timings of structured outputs (bench/results/structured.md), run only when asked:
//   SPARROW_STRUCTURED_BENCH=1 build-cpu/sparrow_tests --gtest_filter='StructuredBench.*'
// Vocabularies: the bundled deepseek_v32 tokenizer (4K tokens) and a synthetic 160K one (the 4K tokens, every
// byte, and the most frequent words of the Python standard library, with and without a leading space: the
// repository holds no 160K tokenizer). For a JSON schema and a regex, a valid output is split into tokens by
// longest match; per token the mask is filled and the token accepted, first on a fresh compiled grammar
// ("cold": the token splits are computed as positions are first met), then again ("warm"); batch 64 fills the
// masks of 64 matchers at staggered points of the output one after another, as the engine does. Nothing is
// asserted: timings depend on the machine.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <unordered_map>

#include "core/parallel.h"

#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::structured {
namespace {

using Clock = std::chrono::steady_clock;

std::shared_ptr<const TokenVocabulary> synthetic_vocabulary(const Tokenizer& base, int32_t size) {
  std::vector<std::string> bytes;
  std::vector<char> excluded;
  std::unordered_map<std::string, int> seen;
  auto add = [&](const std::string& b, bool special) {
    if (!special && !b.empty() && seen.count(b)) return;
    if (!special) seen[b] = 1;
    bytes.push_back(b);
    excluded.push_back(special);
  };
  for (int32_t id = 0; id < base.vocab_size(); ++id) {
    const std::string* b = base.token_bytes(id);
    add(b ? *b : "", !b || base.is_special(id));
  }
  for (int c = 0; c < 256; ++c) add(std::string(1, char(c)), false);
  // Words of the standard library's source: letters / digits runs, punctuation runs, whitespace runs.
  std::unordered_map<std::string, int64_t> counts;
  std::vector<std::filesystem::path> files;
  for (const char* dir : {"/usr/lib/python3.11", "/usr/lib/python3.12", "/usr/lib/python3"})
    if (std::filesystem::is_directory(dir))
      for (const auto& e : std::filesystem::recursive_directory_iterator(dir, std::filesystem::directory_options::skip_permission_denied))
        if (e.path().extension() == ".py") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    auto kind = [](unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80 ? 0 : std::isspace(c) ? 1 : 2; };
    for (size_t i = 0; i < text.size();) {
      size_t j = i + 1;
      const bool space = text[i] == ' ' && j < text.size() && kind(uint8_t(text[j])) != 1;
      if (space) ++j;
      const int k = kind(uint8_t(text[j - 1]));
      while (j < text.size() && kind(uint8_t(text[j])) == k && j - i < 24) ++j;
      ++counts[text.substr(i, j - i)];
      i = j;
    }
  }
  std::vector<std::pair<int64_t, std::string>> by_count;
  for (auto& [w, c] : counts) by_count.push_back({-c, w});
  std::sort(by_count.begin(), by_count.end());
  for (const auto& [c, w] : by_count) {
    if (int32_t(bytes.size()) >= size) break;
    add(w, false);
  }
  const int32_t n = int32_t(bytes.size());
  return std::make_shared<const TokenVocabulary>(std::move(bytes), std::move(excluded), n);
}

// Longest-match split of `text` over the vocabulary's trie.
std::vector<int32_t> split(const TokenVocabulary& vocab, const std::string& text) {
  std::vector<int32_t> out;
  const auto& trie = vocab.trie();
  for (size_t i = 0; i < text.size();) {
    int32_t node = 0, best = -1;
    size_t best_end = i;
    for (size_t j = i; j < text.size(); ++j) {
      int32_t next = -1;
      for (int32_t c = node + 1; c < trie[size_t(node)].subtree_end; c = trie[size_t(c)].subtree_end)
        if (trie[size_t(c)].byte == uint8_t(text[j])) next = c;
      if (next < 0) break;
      node = next;
      if (!vocab.tokens_at(node).empty()) best = vocab.tokens_at(node)[0], best_end = j + 1;
    }
    if (best < 0) return {};
    out.push_back(best);
    i = best_end;
  }
  return out;
}

struct Case {
  const char* name;
  StructuredOutputSpec spec;
  std::string output;
};

// Per token: fill the mask, accept the token; the mean seconds per mask.
double walk(GrammarMatcher& m, const std::vector<int32_t>& tokens, std::vector<uint32_t>& words) {
  const auto start = Clock::now();
  for (int32_t t : tokens) {
    m.fill_next_token_bitmask(words.data());
    if (!m.accept_token(t)) ADD_FAILURE() << "token refused";
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / double(tokens.size());
}

// Batch 64: matchers spread over the output; per step every mask is filled (one after another, or with
// parallel_for over the rows), then every matcher advances. The mean seconds of the fills per step.
double batch_step(const std::shared_ptr<const CompiledGrammar>& grammar, const std::vector<int32_t>& tokens,
                  int64_t mask_words, bool parallel) {
  std::vector<std::unique_ptr<GrammarMatcher>> batch;
  std::vector<size_t> at;
  for (int i = 0; i < 64; ++i) {
    batch.push_back(std::make_unique<GrammarMatcher>(grammar, std::vector<int32_t>{0}));
    at.push_back(size_t(i) * tokens.size() / 64);
    for (size_t k = 0; k < at.back(); ++k) batch.back()->accept_token(tokens[k]);
  }
  std::vector<uint32_t> words(64 * size_t(mask_words));
  double total = 0;
  const int steps = 16;
  for (int step = 0; step < steps; ++step) {
    const auto start = Clock::now();
    auto fill = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) batch[size_t(i)]->fill_next_token_bitmask(words.data() + i * mask_words);
    };
    if (parallel) parallel_for(64, fill); else fill(0, 64);
    total += std::chrono::duration<double>(Clock::now() - start).count();
    for (int i = 0; i < 64; ++i) {
      if (at[size_t(i)] >= tokens.size()) {  // wrap around: a fresh matcher
        batch[size_t(i)] = std::make_unique<GrammarMatcher>(grammar, std::vector<int32_t>{0});
        at[size_t(i)] = 0;
      }
      batch[size_t(i)]->accept_token(tokens[at[size_t(i)]++]);
    }
  }
  return total / steps;
}

void bench(const char* vocab_name, std::shared_ptr<const TokenVocabulary> vocab, const Case& c) {
  const std::vector<int32_t> tokens = split(*vocab, c.output);
  ASSERT_FALSE(tokens.empty());
  std::vector<uint32_t> words(size_t(vocab->mask_words()));
  const auto compile_start = Clock::now();
  auto grammar = std::make_shared<CompiledGrammar>(build_grammar(c.spec), vocab);
  const double compile = std::chrono::duration<double>(Clock::now() - compile_start).count();
  // Cold: nothing cached. Then with the whole-mask cache off (every mask built from the token splits:
  // what a state never met before costs), then with both caches (states met again).
  GrammarMatcher cold_matcher(grammar, {0});
  const double cold = walk(cold_matcher, tokens, words);
  auto best_of_three_walks = [&] {
    double best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      GrammarMatcher m(grammar, {0});
      best = std::min(best, walk(m, tokens, words));
    }
    return best;
  };
  grammar->set_mask_cache(false);
  const double splits_only = best_of_three_walks();
  const double batch_splits_only = batch_step(grammar, tokens, vocab->mask_words(), false);
  grammar->set_mask_cache(true);
  const double warm = best_of_three_walks();
  const double batch_warm = batch_step(grammar, tokens, vocab->mask_words(), false);
  grammar->set_mask_cache(false);
  const double batch_parallel = batch_step(grammar, tokens, vocab->mask_words(), true);
  std::printf("| %s (%d) | %s | %zu | %.1f ms | %.0f us | %.1f us | %.1f us | %.2f ms | %.2f ms | %.2f ms |\n",
              vocab_name, vocab->mask_size(), c.name, tokens.size(), 1e3 * compile, 1e6 * cold, 1e6 * splits_only,
              1e6 * warm, 1e3 * batch_splits_only, 1e3 * batch_parallel, 1e3 * batch_warm);
}

TEST(StructuredBench, MaskTimes) {
  if (!std::getenv("SPARROW_STRUCTURED_BENCH")) GTEST_SKIP() << "set SPARROW_STRUCTURED_BENCH=1 to run";
  auto tokenizer = load_tokenizer(SPARROW_SOURCE_DIR "/models/deepseek_v32");
  using Kind = StructuredOutputSpec::Kind;
  const std::vector<Case> cases = {
      {"json schema", {Kind::JsonSchema, R"({"type": "object", "properties": {
          "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string", "format": "email"},
          "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
              "zip": {"type": "string", "pattern": "[0-9]{5}"}}, "required": ["street", "city"]},
          "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
          "required": ["name", "age", "address"]})", {}, true},
       R"({"name": "Alice Johnson", "age": 42, "email": "alice.johnson@example.com", "address": {"street": "1234 Elm Street, Apartment 5", "city": "Springfield", "zip": "62704"}, "tags": ["engineer", "runner", "coffee lover", "open source"], "active": true})"},
      {"string, maxLength 64", {Kind::JsonSchema, R"({"type": "string", "maxLength": 64})", {}, true},
       R"("The quick brown fox jumps over the lazy dog, then naps in a sun.")"},
      {"regex", {Kind::Regex, R"((\+1 )?\(\d{3}\) \d{3}-\d{4}|[a-z][a-z0-9._]*@[a-z]+\.(com|org|net)( and [a-z]+)*)", {}, true},
       "alice.johnson_42@example.org and bob and carol and dave and eve"},
  };
  std::printf("| vocabulary (tokens) | spec | output tokens | compile | mask, cold | mask, splits cached | mask, "
              "all cached | batch 64, splits cached | same, parallel_for (%d threads) | batch 64, all cached |\n",
              int(std::thread::hardware_concurrency()));
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  auto small = TokenVocabulary::from_tokenizer(*tokenizer, tokenizer->vocab_size());
  const auto build_start = Clock::now();
  auto large = synthetic_vocabulary(*tokenizer, 160000);
  const double build = std::chrono::duration<double>(Clock::now() - build_start).count();
  for (const Case& c : cases) bench("deepseek_v32", small, c);
  for (const Case& c : cases) bench("synthetic", large, c);
  std::printf("(synthetic vocabulary: %d tokens, %zu trie nodes, built with its trie in %.2f s)\n", large->mask_size(),
              large->trie().size(), build);
}

}  // namespace
}  // namespace sparrow::structured
