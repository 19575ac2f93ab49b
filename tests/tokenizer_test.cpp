// Tokenizers against the committed expectations of the reference libraries (tests/data/tokenizers,
// written by tools/tokenizer_corpus.py), plus the pieces they are built from: UTF-8 handling, NFC,
// pattern translation, the incremental detokenizer, loading errors and the tokenize / detokenize
// commands. tests/tokenizer_live_test.py compares with the libraries themselves.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/regex.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/normalization.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace sparrow;
using sparrow::testing::error_message;
using sparrow::testing::mentions;
using sparrow::testing::TempDir;

namespace {

const fs::path kData = fs::path(SPARROW_SOURCE_DIR) / "tests/data/tokenizers";
const std::vector<std::string> kFamilies = {"deepseek_v32", "minimax_m3", "kimi_linear"};

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = read_json(kData / "corpus.json")["texts"];
  return texts;
}

// tools/tokenizer_reference.py digest(): FNV-1a 64 of the compact JSON of the id list.
std::string digest(const std::vector<TokenId>& ids) {
  std::string text = json(ids).dump();
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001B3ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

// Compares encode() of the first `count` corpus texts with [[id count, digest], ...].
void expect_encodings(const Tokenizer& tokenizer, const json& expected, const std::string& name) {
  size_t mismatches = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    std::vector<TokenId> ids = tokenizer.encode(corpus()[i]);
    if (ids.size() == expected[i][0].get<size_t>() && digest(ids) == expected[i][1].get<std::string>()) continue;
    if (++mismatches <= 5)
      ADD_FAILURE() << name << ": text " << i << " " << json(corpus()[i].substr(0, 200)).dump() << " gives "
                    << ids.size() << " ids " << json(ids).dump().substr(0, 300) << ", the reference "
                    << expected[i][0] << " (run tests/tokenizer_live_test.py for the reference ids)";
  }
  EXPECT_EQ(mismatches, 0u) << name;
}

// tools/tokenizer_reference.py apply_patch(): sets "a.b.c" paths; in a list a path element is an index
// or an added token's content.
json apply_patch(json tokenizer, const json& patch) {
  for (const auto& [path, value] : patch.items()) {
    json* node = &tokenizer;
    std::stringstream keys(path);
    std::string key;
    while (std::getline(keys, key, '.')) {
      if (node->is_object()) {
        node = &(*node)[key];
      } else if (!key.empty() && std::all_of(key.begin(), key.end(), ::isdigit)) {
        node = &(*node)[std::stoul(key)];
      } else {
        auto it = std::find_if(node->begin(), node->end(),
                               [&](const json& t) { return t.value("content", "") == key; });
        EXPECT_NE(it, node->end()) << path;
        node = &*it;
      }
    }
    *node = value;
  }
  return tokenizer;
}

std::string dump(const std::string& text) { return json(text).dump(); }

}  // namespace

// ---- the three families against the reference libraries' output ----

class TokenizerFamily : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tokenizer_ = load_tokenizer((kData / GetParam()).string());
    expected_ = read_json(kData / GetParam() / "expected.json");
  }
  std::unique_ptr<Tokenizer> tokenizer_;
  json expected_;
};

TEST_P(TokenizerFamily, EncodesTheCorpusAsTheReference) {
  ASSERT_EQ(expected_["encode"].size(), corpus().size());
  ASSERT_GT(corpus().size(), 10000u);
  expect_encodings(*tokenizer_, expected_["encode"], GetParam());
}

TEST_P(TokenizerFamily, DecodesItsOwnEncodingAsTheReference) {
  const json& changed = expected_["roundtrip_changed"];  // where decode(encode(text)) != text (NFC)
  size_t mismatches = 0;
  for (size_t i = 0; i < corpus().size(); ++i) {
    std::string key = std::to_string(i);
    std::string want = changed.contains(key) ? changed[key].get<std::string>() : corpus()[i];
    std::string got = tokenizer_->decode(tokenizer_->encode(corpus()[i]));
    if (got != want && ++mismatches <= 5) ADD_FAILURE() << "text " << i << ": " << dump(got) << " != " << dump(want);
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_P(TokenizerFamily, DecodesRandomIdsAsTheReference) {
  // Random ids split characters across tokens (invalid UTF-8 -> U+FFFD) and mix in special tokens.
  const json& ids = expected_["decode_ids"];
  const json& texts = expected_["decode_texts"];
  ASSERT_EQ(ids.size(), texts.size());
  size_t replaced = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string got = tokenizer_->decode(ids[i].get<std::vector<TokenId>>());
    EXPECT_EQ(got, texts[i].get<std::string>()) << ids[i].dump();
    replaced += got.find("\xEF\xBF\xBD") != std::string::npos;
  }
  EXPECT_GT(replaced, 10u) << "the random ids should exercise invalid UTF-8";
}

TEST_P(TokenizerFamily, StreamsTheSameTextAsDecode) {
  std::mt19937 rng(42);
  for (size_t i = 0; i < corpus().size(); i += 7) {
    std::vector<TokenId> ids = tokenizer_->encode(corpus()[i]);
    for (int k = 0; k < 3; ++k) ids.push_back(TokenId(rng() % tokenizer_->vocab_size()));  // broken UTF-8 too
    IncrementalDetokenizer stream(*tokenizer_);
    std::string joined;
    for (TokenId id : ids) {
      IncrementalDetokenizer::Delta delta = stream.push(id);
      ASSERT_TRUE(utf8::is_valid(delta.text));
      ASSERT_FALSE(delta.stopped);
      joined += delta.text;
    }
    joined += stream.finish().text;
    ASSERT_EQ(joined, tokenizer_->decode(ids)) << "text " << i;
  }
}

TEST_P(TokenizerFamily, EncodesTenThousandTextsQuickly) {
  auto start = std::chrono::steady_clock::now();
  size_t total = 0;
  for (const std::string& text : corpus()) total += tokenizer_->encode(text).size();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 3.0) << total << " ids";
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerFamily, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return info.param; });

// ---- tokenizer.json options the families do not use (tests/data/tokenizers/variants.json) ----

TEST(TokenizerVariants, EncodeAsTheReference) {
  json variants = read_json(kData / "variants.json")["variants"];
  json expected = read_json(kData / "variants_expected.json");
  ASSERT_GE(variants.size(), 10u);
  for (const json& variant : variants) {
    std::string name = variant["name"];
    TempDir dir;
    json base = read_json(kData / variant["base"].get<std::string>() / "tokenizer.json");
    dir.write("tokenizer.json", apply_patch(base, variant["patch"]).dump());
    auto tokenizer = load_tokenizer(dir.path());
    expect_encodings(*tokenizer, expected[name], name);
  }
}

// ---- the tokenizer interface ----

TEST(Tokenizer, SpecialTokensAndLookups) {
  auto deepseek = load_tokenizer((kData / "deepseek_v32").string());
  EXPECT_EQ(deepseek->bos_id(), 0);
  EXPECT_EQ(deepseek->eos_id(), 1);
  EXPECT_EQ(deepseek->id_to_token(0), "<｜begin▁of▁sentence｜>");
  EXPECT_TRUE(deepseek->is_special(0));
  TokenId think = deepseek->token_to_id("<think>").value();
  EXPECT_FALSE(deepseek->is_special(think));  // DeepSeek marks <think> special=false
  EXPECT_EQ(deepseek->encode("<think>"), std::vector<TokenId>{think});
  EXPECT_EQ(deepseek->decode(std::vector<TokenId>{0, think}), "<｜begin▁of▁sentence｜><think>");
  EXPECT_EQ(deepseek->vocab_size(), 3033);
  EXPECT_EQ(deepseek->id_to_token(3033), std::nullopt);
  EXPECT_EQ(deepseek->decode(std::vector<TokenId>{3033, -1, 99999}), "");  // unknown ids vanish
  // A byte-level token: id_to_token shows the GPT-2 characters, decode the bytes.
  TokenId space_the = deepseek->encode(" the").at(0);
  EXPECT_EQ(deepseek->id_to_token(space_the), "Ġthe");
  EXPECT_EQ(*deepseek->token_bytes(space_the), " the");

  auto kimi = load_tokenizer((kData / "kimi_linear").string());
  EXPECT_EQ(kimi->vocab_size(), 3000 + 256);
  EXPECT_EQ(kimi->bos_id(), 3000);
  EXPECT_EQ(kimi->eos_id(), 3001);
  EXPECT_EQ(kimi->token_to_id("<|im_end|>"), 3002);
  EXPECT_EQ(kimi->id_to_token(3005), "<|reserved_token_3005|>");
  EXPECT_TRUE(kimi->is_special(3255));
  EXPECT_EQ(kimi->encode("a<|im_end|>"), (std::vector<TokenId>{'a', 3002}));
  EXPECT_EQ(kimi->id_to_token(' '), "Ġ");

  auto minimax = load_tokenizer((kData / "minimax_m3").string());
  EXPECT_EQ(minimax->bos_id(), minimax->token_to_id("]~!b["));
  EXPECT_EQ(minimax->eos_id(), minimax->token_to_id("[e~["));
}

// tokenizer_config.json's add_bos_token decides the BOS of every raw-text prompt, as transformers'
// tokenizer(text) (add_special_tokens=True) does.
TEST(Tokenizer, AddBosTokenIsTheOneBosRule) {
  TempDir dir;
  dir.write("tokenizer.json", read_json(kData / "deepseek_v32" / "tokenizer.json").dump());
  json config = read_json(kData / "deepseek_v32" / "tokenizer_config.json");
  auto with = [&](json add_bos) {
    json edited = config;
    edited["add_bos_token"] = add_bos;
    dir.write("tokenizer_config.json", edited.dump());
    return load_tokenizer(dir.path());
  };
  std::vector<TokenId> text = with(false)->encode("hello world");
  EXPECT_EQ(with(false)->encode_with_special_tokens("hello world"), text);
  std::vector<TokenId> with_bos{0};
  with_bos.insert(with_bos.end(), text.begin(), text.end());
  EXPECT_EQ(with(true)->encode_with_special_tokens("hello world"), with_bos);
  EXPECT_EQ(with(true)->encode("hello world"), text);  // encode() itself adds nothing
  EXPECT_TRUE(mentions(error_message([&] { with("yes"); }), {"tokenizer_config.json", "add_bos_token must be true or false"}));
  config["bos_token"] = "<not-a-token>";
  EXPECT_TRUE(mentions(error_message([&] { with(true); }), {"tokenizer_config.json", "add_bos_token is set but bos_token"}));
  EXPECT_EQ(with(false)->encode_with_special_tokens("hello world"), text);
}

// ---- UTF-8 ----

TEST(Utf8, LossyDecodingReplacesMaximalSubparts) {
  EXPECT_EQ(utf8::decode_lossy("a\xF0\x9F\x98"), "a\uFFFD");              // cut-off emoji: one U+FFFD
  EXPECT_EQ(utf8::decode_lossy("\xE0\x80\x80"), "\uFFFD\uFFFD\uFFFD");    // overlong: E0 then 80 80
  EXPECT_EQ(utf8::decode_lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");    // surrogate
  EXPECT_EQ(utf8::decode_lossy("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // above U+10FFFF
  EXPECT_EQ(utf8::decode_lossy("\xC3\xA9\xC3"), "é\uFFFD");
  EXPECT_EQ(utf8::decode_lossy("\xF0\x9F\x98x"), "\uFFFDx");
  EXPECT_EQ(utf8::decode_lossy("\xFF\xC0\xC1\xF5"), "\uFFFD\uFFFD\uFFFD\uFFFD");
}

TEST(Utf8, StreamingHoldsBackOnlySequencesThatCanComplete) {
  std::string out;
  EXPECT_EQ(utf8::decode_lossy("ab\xF0\x9F\x98", /*final=*/false, out), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(utf8::decode_lossy("ab\xF5", /*final=*/false, out), 3u);  // F5 never starts a character
  EXPECT_EQ(out, "ab\uFFFD");
  EXPECT_TRUE(utf8::is_valid("héllo 😀"));
  EXPECT_FALSE(utf8::is_valid("h\xC3"));
}

// ---- NFC ----

TEST(Unicode, Nfc) {
  EXPECT_EQ(unicode::nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(unicode::nfc("\u212b"), "\u00c5");                  // singleton decomposition
  EXPECT_EQ(unicode::nfc("\u1100\u1161\u11a8"), "\uac01");      // Hangul jamo compose
  EXPECT_EQ(unicode::nfc("\u0958"), "\u0915\u093c");            // composition exclusion
  EXPECT_EQ(unicode::nfc("a\u0328\u0301"), "\u0105\u0301");     // ogonek (202) orders before acute (230)
  EXPECT_EQ(unicode::nfc("\u1e9b\u0323"), "\u1e9b\u0323");
  EXPECT_EQ(unicode::nfc("a\u0315\u0300\u05ae\u0300b"), "\u00e0\u05ae\u0300\u0315b");  // reordering, blocking
  EXPECT_EQ(unicode::nfc("plain ascii"), "plain ascii");
}

// ---- split patterns ----

TEST(Regex, TranslatesTheReferenceSyntax) {
  EXPECT_EQ(translate_pattern(R"(\s+(?!\S))"), R"(\p{White_Space}+(?!\P{White_Space}))");
  EXPECT_EQ(translate_pattern(R"([^\s\p{L}])"), R"([^\p{White_Space}\p{L}])");
  EXPECT_EQ(translate_pattern(R"([\p{Lu}\p{M}&&[^\p{Han}]]+)"), R"((?:(?=[^\p{sc:Han}])[\p{Lu}\p{M}])+)");
  EXPECT_EQ(translate_pattern(R"(\p{Greek}\pL\p{N}{1,3})"), R"(\p{sc:Greek}\pL\p{N}{1,3})");
  EXPECT_EQ(translate_pattern(R"([!\-\[\\\]^_`])"), R"([!\-\[\\\]^_`])");
  EXPECT_TRUE(mentions(error_message([] { translate_pattern("^a"); }), {"anchors", "^a"}));
  EXPECT_TRUE(mentions(error_message([] { translate_pattern(R"(\bword)"); }), {"\\b"}));
  EXPECT_TRUE(mentions(error_message([] { Regex("(unclosed"); }), {"(unclosed"}));
}

TEST(Regex, MatchesAsTheReferenceEngines) {
  using Spans = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(Regex(R"(\s)").find_all("a\u180e\u0085"), (Spans{{4, 6}}));  // U+180E is not white space
  EXPECT_EQ(Regex(R"(\p{Han}+)").find_all("漢、字"), (Spans{{0, 3}, {6, 9}}));  // 、 is Common script
  EXPECT_EQ(Regex("x*").find_all("ab"), (Spans{{0, 0}, {1, 1}, {2, 2}}));
  EXPECT_EQ(Regex("x*").find_all("xxa"), (Spans{{0, 2}, {3, 3}}));  // no empty match right after a match
  EXPECT_EQ(Regex(kKimiPattern).find_all("Hello世界"), (Spans{{0, 5}, {5, 11}}));
}

// ---- incremental detokenization ----

namespace {

struct Streamed {
  std::string text;
  bool stopped = false;
  int stop_index = -1;
  size_t stopped_after = 0;  // tokens pushed when the stop was reported
};

Streamed stream(const Tokenizer& tokenizer, const std::vector<TokenId>& ids, std::vector<std::string> stops) {
  IncrementalDetokenizer detokenizer(tokenizer, std::move(stops));
  Streamed out;
  for (size_t i = 0; i < ids.size() && !out.stopped; ++i) {
    auto delta = detokenizer.push(ids[i]);
    EXPECT_TRUE(utf8::is_valid(delta.text));
    out.text += delta.text;
    out.stopped = delta.stopped;
    out.stop_index = delta.stop_index;
    out.stopped_after = i + 1;
  }
  if (!out.stopped) out.text += detokenizer.finish().text;
  return out;
}

}  // namespace

TEST(IncrementalDetokenizer, StopsAtStopStringsAcrossTokens) {
  auto tokenizer = load_tokenizer((kData / "minimax_m3").string());
  // One token per character (ASCII), so every stop string spans several tokens.
  auto bytes_of = [&](const std::string& text) {
    std::vector<TokenId> ids;
    for (char c : text) ids.push_back(tokenizer->encode(std::string(1, c)).at(0));
    return ids;
  };
  Streamed s = stream(*tokenizer, bytes_of("Hello world. END here"), {"END", "xyz"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.stop_index, 0);
  EXPECT_EQ(s.text, "Hello world. ");
  EXPECT_EQ(s.stopped_after, 16u);  // reported on the token that completes "END"

  // The earliest stop string wins, wherever it is listed.
  s = stream(*tokenizer, bytes_of("abc STOP def END"), {"END", "STOP"});
  EXPECT_EQ(s.stop_index, 1);
  EXPECT_EQ(s.text, "abc ");

  // A prefix of a stop string is held back, then released when it does not complete.
  IncrementalDetokenizer held(*tokenizer, {"</answer>"});
  std::string shown;
  for (TokenId id : bytes_of("x </ans")) shown += held.push(id).text;
  EXPECT_EQ(shown, "x ");
  for (TokenId id : bytes_of("wer> not")) shown += held.push(id).text;
  EXPECT_EQ(shown, "x ");
  EXPECT_TRUE(held.stopped());
  EXPECT_TRUE(held.push(bytes_of("z")[0]).stopped);

  IncrementalDetokenizer released(*tokenizer, {"</answer>"});
  shown.clear();
  for (TokenId id : bytes_of("x </an!")) shown += released.push(id).text;
  EXPECT_EQ(shown, "x </an!");
  shown.clear();
  for (TokenId id : bytes_of("y </a")) shown += released.push(id).text;
  shown += released.finish().text;  // end of generation: held text comes out
  EXPECT_EQ(shown, "y </a");
}

TEST(IncrementalDetokenizer, HoldsBackSplitCharacters) {
  auto tokenizer = load_tokenizer((kData / "kimi_linear").string());
  // "😀" is four bytes: single-byte tokens 0xF0 0x9F 0x98 0x80 (ranks = byte values).
  IncrementalDetokenizer stream(*tokenizer, {"😀!"});
  EXPECT_EQ(stream.push('a').text, "a");
  EXPECT_EQ(stream.push(0xF0).text, "");
  EXPECT_EQ(stream.push(0x9F).text, "");
  EXPECT_EQ(stream.push(0x98).text, "");
  EXPECT_EQ(stream.push(0x80).text, "");  // complete, but may start the stop string "😀!"
  auto delta = stream.push('?');
  EXPECT_EQ(delta.text, "😀?");
  EXPECT_EQ(stream.push(0xF0).text, "");
  EXPECT_EQ(stream.finish().text, "\uFFFD");  // never completed
}

// ---- loading errors ----

TEST(TokenizerLoading, ErrorsAreOneLine) {
  TempDir dir;
  EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(dir.file("missing")); }), {"missing", "not a directory"}));
  EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(dir.path()); }), {"no tokenizer.json or tiktoken.model"}));
  dir.write("tokenizer.json", "{not json");
  EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(dir.path()); }), {"tokenizer.json", "not valid JSON"}));

  json base = read_json(kData / "minimax_m3" / "tokenizer.json");
  auto expect_error = [&](json patch, std::initializer_list<std::string> parts) {
    dir.write("tokenizer.json", apply_patch(base, patch).dump());
    EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(dir.path()); }), parts)) << patch.dump();
  };
  expect_error({{"normalizer", {{"type", "Lowercase"}}}}, {"tokenizer.json", "normalizer 'Lowercase'"});
  expect_error({{"pre_tokenizer", {{"type", "Metaspace"}}}}, {"pre_tokenizer 'Metaspace'"});
  expect_error({{"pre_tokenizer.pretokenizers.0.pattern.Regex", "(?<x"}}, {"bad regex", "(?<x"});
  expect_error({{"pre_tokenizer.pretokenizers.0.behavior", "Sideways"}}, {"Split behavior 'Sideways'"});
  expect_error({{"decoder", {{"type", "Metaspace"}}}}, {"ByteLevel decoder"});
  expect_error({{"model.byte_fallback", true}}, {"byte_fallback"});
  expect_error({{"model.merges.0", "Ġ"}}, {"merge 0"});
  expect_error({{"model.merges.0", json::array({"Ġ", "nope"})}}, {"merge 0", "nope"});

  TempDir kimi;
  kimi.write("tiktoken.model", "IQ== 0\nnot-base64! 1\n");
  EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(kimi.path()); }), {"tiktoken.model", "line 2"}));
  kimi.write("tiktoken.model", "IQ== 0\nIg== 0\n");
  EXPECT_TRUE(mentions(error_message([&] { load_tokenizer(kimi.path()); }), {"repeated rank 0"}));

  auto tokenizer = load_tokenizer((kData / "kimi_linear").string());
  EXPECT_TRUE(mentions(error_message([&] { tokenizer->encode("bad \xC3"); }), {"not valid UTF-8"}));
}

// ---- the sparrow tokenize / detokenize commands ----

namespace {

struct CommandResult {
  int status = -1;
  std::string out, err;
};

CommandResult run_sparrow(const std::string& args, const TempDir& dir) {
  std::string cmd = std::string(SPARROW_BINARY) + " " + args + " >" + dir.file("out") + " 2>" + dir.file("err");
  int rc = std::system(cmd.c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(dir.file("out")), slurp(dir.file("err"))};
}

}  // namespace

TEST(TokenizeCommand, EncodesAndDecodesJsonFiles) {
  TempDir dir;
  std::string model = (kData / "deepseek_v32").string();
  std::vector<std::string> texts = {"Hello <think>world</think> 你好 😀", "", "  12345\n"};
  dir.write("texts.json", json{{"texts", texts}}.dump());
  CommandResult r = run_sparrow("tokenize --model " + model + " --input " + dir.file("texts.json"), dir);
  ASSERT_EQ(r.status, 0) << r.err;
  auto tokenizer = load_tokenizer(model);
  json ids = json::parse(r.out)["ids"];
  ASSERT_EQ(ids.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(ids[i].get<std::vector<TokenId>>(), tokenizer->encode(texts[i]));

  dir.write("ids.json", json{{"ids", ids}}.dump());
  r = run_sparrow("detokenize --model " + model + " --input " + dir.file("ids.json"), dir);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["texts"].get<std::vector<std::string>>(), texts);
}

TEST(TokenizeCommand, BadInputIsAOneLineError) {
  TempDir dir;
  std::string model = (kData / "kimi_linear").string();
  auto expect_error = [&](const std::string& args, const std::string& part) {
    CommandResult r = run_sparrow(args, dir);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(mentions(r.err.substr(0, r.err.size() - 1), {"error: ", part}));
  };
  dir.write("bad.json", "{\"texts\": [1]}");
  expect_error("tokenize --model " + model + " --input " + dir.file("bad.json"), "text 0 is not a string");
  dir.write("bad.json", "{\"texts\": [\"\xC3\"]}");
  expect_error("tokenize --model " + model + " --input " + dir.file("bad.json"), "not valid JSON");
  dir.write("bad.json", "{\"ids\": [[1, -2]]}");
  expect_error("detokenize --model " + model + " --input " + dir.file("bad.json"), "-2, not a token id");
  dir.write("bad.json", "{\"ids\": [1, 2]}");
  expect_error("detokenize --model " + model + " --input " + dir.file("bad.json"), "entry 0 is not a list");
  expect_error("tokenize --model " + dir.path() + " --input " + dir.file("bad.json"), "no tokenizer.json");
  expect_error("tokenize --model " + model + " --input " + dir.file("none.json"), "cannot open");
}
