#include "tokenizer/hf_tokenizer.h"

#include <map>

#include "core/error.h"
#include "tokenizer/normalization.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

using nlohmann::json;

const json& model_json(const json& j) {
  SPARROW_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), "no \"model\"");
  const json& model = j["model"];
  std::string type = model.value("type", "BPE");
  SPARROW_CHECK(type == "BPE", "model type '", type, "' is not supported (BPE)");
  return model;
}

AddedToken parse_added_token(const json& t) {
  SPARROW_CHECK(t.is_object() && t.contains("content") && t["content"].is_string(),
                "an added token without \"content\"");
  AddedToken token;
  token.content = t["content"].get<std::string>();
  token.special = t.value("special", false);
  token.normalized = t.value("normalized", !token.special);
  token.lstrip = t.value("lstrip", false);
  token.rstrip = t.value("rstrip", false);
  token.single_word = t.value("single_word", false);
  return token;
}

bool same_token(const AddedToken& a, const AddedToken& b) {
  return a.content == b.content && a.special == b.special && a.normalized == b.normalized && a.lstrip == b.lstrip &&
         a.rstrip == b.rstrip && a.single_word == b.single_word;
}

// The bytes the ByteLevel decoder makes of a token string: each character mapped back to its byte,
// or, when some character is not a byte stand-in (special tokens like <｜User｜>), the string's own
// UTF-8 (tokenizers' ByteLevel::decode_chain).
std::string byte_level_bytes(std::string_view token) {
  static const std::map<char32_t, unsigned char> byte_of = [] {
    std::map<char32_t, unsigned char> m;
    for (int b = 0; b < 256; ++b) {
      size_t i = 0;
      m[utf8::next(byte_level_chars()[b], i)] = static_cast<unsigned char>(b);
    }
    return m;
  }();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    auto it = byte_of.find(utf8::next(token, i));
    if (it == byte_of.end()) return std::string(token);
    bytes += static_cast<char>(it->second);
  }
  return bytes;
}

}  // namespace

HfTokenizer::HfTokenizer(const json& j)
    : nfc_(parse_normalizer(j.value("normalizer", json()))),
      pre_tokenizers_(parse_pre_tokenizer(j.value("pre_tokenizer", json()))),
      model_(model_json(j)) {
  const json& decoder = j.value("decoder", json());
  SPARROW_CHECK(decoder.is_object() && decoder.value("type", "") == "ByteLevel",
                "only the ByteLevel decoder is supported");

  for (const auto& [text, id] : model_.vocab()) set_token(id, text, byte_level_bytes(text), false);

  // tokenizers ignores the ids written in "added_tokens": AddedVocabulary::add_tokens gives each token
  // the id of its content when the vocabulary has it, else the next id after the vocabulary.
  std::map<TokenId, AddedToken> added;
  StringMap<TokenId> added_ids;
  TokenId next_id = TokenId(model_.vocab().size());
  for (const json& t : j.value("added_tokens", json::array())) {
    AddedToken token = parse_added_token(t);
    if (token.content.empty()) continue;
    auto known = added_ids.find(token.content);
    if (known != added_ids.end() && same_token(added[known->second], token)) continue;
    if (known != added_ids.end()) token.id = known->second;
    else if (auto v = model_.vocab().find(token.content); v != model_.vocab().end()) token.id = v->second;
    else token.id = next_id++;
    added_ids[token.content] = token.id;
    added[token.id] = token;
  }

  std::vector<AddedToken> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const auto& [id, token] : added) {
    // A normalized token is matched, and decoded, in its normalized form.
    std::string form = token.normalized && nfc_ ? unicode::nfc(token.content) : token.content;
    set_token(id, token.content, byte_level_bytes(form), token.special);
    (token.normalized ? normalized : raw).push_back(token);
    (token.normalized ? normalized_patterns : raw_patterns).push_back(form);
  }
  raw_tokens_ = AddedTokenMatcher(std::move(raw), std::move(raw_patterns));
  normalized_tokens_ = AddedTokenMatcher(std::move(normalized), std::move(normalized_patterns));
}

std::vector<TokenId> HfTokenizer::encode(std::string_view text) const {
  SPARROW_CHECK(utf8::is_valid(text), "text to encode is not valid UTF-8");
  std::vector<TokenId> ids;
  for (const auto& segment : raw_tokens_.split(text)) {
    if (segment.token >= 0) {
      ids.push_back(segment.token);
      continue;
    }
    std::string_view part = text.substr(segment.begin, segment.end - segment.begin);
    std::string normalized = nfc_ ? unicode::nfc(part) : std::string(part);
    for (const auto& inner : normalized_tokens_.split(normalized)) {
      if (inner.token >= 0) ids.push_back(inner.token);
      else encode_plain_text(std::string_view(normalized).substr(inner.begin, inner.end - inner.begin), ids);
    }
  }
  return ids;
}

void HfTokenizer::encode_plain_text(std::string_view text, std::vector<TokenId>& ids) const {
  if (text.empty()) return;
  std::vector<std::string> pieces{std::string(text)}, next;
  for (const auto& step : pre_tokenizers_) {
    next.clear();
    for (const std::string& piece : pieces) step->split(piece, next);
    pieces.swap(next);
  }
  for (const std::string& piece : pieces) model_.encode(piece, ids);
}

}  // namespace sparrow
