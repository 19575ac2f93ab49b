#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "tokenizer/hf_tokenizer.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK(in, path.string(), ": cannot open");
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

json read_json(const fs::path& path) {
  json j = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded(), path.string(), ": not valid JSON");
  return j;
}

// tokenizer_config.json writes a token as a string or as {"content": ...} (an AddedToken).
std::optional<std::string> config_token(const json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

// Runs `make`, putting the file's path in front of the message of any error.
template <typename F>
std::unique_ptr<Tokenizer> naming_file(const fs::path& file, F&& make) {
  try {
    return make();
  } catch (const Error& e) {
    fail(file.string(), ": ", e.what());
  }
}

}  // namespace

void Tokenizer::set_token(TokenId id, std::string text, std::string bytes, bool special) {
  if (size_t(id) >= tokens_.size()) tokens_.resize(size_t(id) + 1);
  ids_by_text_[text] = id;
  tokens_[id] = {std::move(text), std::move(bytes), true, special};
}

const std::string* Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || size_t(id) >= tokens_.size() || !tokens_[id].present) return nullptr;
  return &tokens_[id].bytes;
}

std::string Tokenizer::decode(std::span<const TokenId> ids) const {
  std::string bytes;
  for (TokenId id : ids)
    if (const std::string* b = token_bytes(id)) bytes += *b;
  return utf8::decode_lossy(bytes);
}

std::optional<std::string> Tokenizer::id_to_token(TokenId id) const {
  if (token_bytes(id) == nullptr) return std::nullopt;
  return tokens_[id].text;
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  auto it = ids_by_text_.find(token);
  if (it == ids_by_text_.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_special(TokenId id) const { return token_bytes(id) != nullptr && tokens_[id].special; }

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& model_dir) {
  fs::path dir(model_dir);
  SPARROW_CHECK(fs::is_directory(dir), model_dir, ": not a directory");
  json config;
  if (fs::exists(dir / "tokenizer_config.json")) config = read_json(dir / "tokenizer_config.json");

  fs::path hf_file = dir / "tokenizer.json", tiktoken_file = dir / "tiktoken.model";
  std::unique_ptr<Tokenizer> tokenizer;
  if (fs::exists(hf_file)) {
    json j = read_json(hf_file);
    tokenizer = naming_file(hf_file, [&] { return std::make_unique<HfTokenizer>(j); });
  } else if (fs::exists(tiktoken_file)) {
    std::string text = read_file(tiktoken_file);
    tokenizer = naming_file(tiktoken_file, [&] { return std::make_unique<TiktokenTokenizer>(text, config); });
  } else {
    fail(model_dir, ": no tokenizer.json or tiktoken.model");
  }

  auto special_id = [&](const char* key) -> std::optional<TokenId> {
    std::optional<std::string> text = config_token(config, key);
    return text ? tokenizer->token_to_id(*text) : std::nullopt;
  };
  tokenizer->bos_id_ = special_id("bos_token");
  tokenizer->eos_id_ = special_id("eos_token");
  if (config.is_object() && config.contains("add_bos_token") && !config["add_bos_token"].is_null()) {
    SPARROW_CHECK(config["add_bos_token"].is_boolean(), (dir / "tokenizer_config.json").string(),
                  ": add_bos_token must be true or false");
    tokenizer->add_bos_ = config["add_bos_token"].get<bool>();
    // transformers refuses this too (its tokenizer raises a ValueError when it must add a BOS it lacks).
    SPARROW_CHECK(!tokenizer->add_bos_ || tokenizer->bos_id_, (dir / "tokenizer_config.json").string(),
                  ": add_bos_token is set but bos_token is missing or not in the vocabulary");
  }
  return tokenizer;
}

std::vector<TokenId> Tokenizer::encode_with_special_tokens(std::string_view text) const {
  std::vector<TokenId> ids;
  if (add_bos_) ids.push_back(*bos_id_);
  std::vector<TokenId> encoded = encode(text);
  ids.insert(ids.end(), encoded.begin(), encoded.end());
  return ids;
}

}  // namespace sparrow
