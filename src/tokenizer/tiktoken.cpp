#include "tokenizer/tiktoken.h"

#include <climits>

#include "core/base64.h"
#include "core/error.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace sparrow {

const char* const kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

namespace {

// tokenization_kimi.py: num_reserved_special_tokens.
constexpr int kReservedSpecialTokens = 256;

// GPT-2's printable form of token bytes: what Kimi's convert_ids_to_tokens shows.
std::string byte_level_text(std::string_view bytes) {
  std::string text;
  for (unsigned char b : bytes) text += byte_level_chars()[b];
  return text;
}

}  // namespace

TiktokenTokenizer::TiktokenTokenizer(std::string_view model_text, const nlohmann::json& tokenizer_config)
    : pattern_(kKimiPattern) {
  std::vector<bool> rank_seen;
  size_t line_number = 0;
  for (size_t pos = 0; pos < model_text.size();) {
    size_t end = model_text.find('\n', pos);
    if (end == std::string_view::npos) end = model_text.size();
    std::string_view line = model_text.substr(pos, end - pos);
    pos = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    size_t space = line.find(' ');
    SPARROW_CHECK(space != std::string_view::npos, "line ", line_number, ": expected \"<base64> <rank>\"");
    std::string bytes;
    try {
      bytes = base64_decode(line.substr(0, space));
    } catch (const Error& e) {
      fail("line ", line_number, ": ", e.what());
    }
    std::string_view rank_text = line.substr(space + 1);
    int64_t rank = 0;
    for (char c : rank_text) {
      SPARROW_CHECK(c >= '0' && c <= '9' && rank < INT32_MAX / 10, "line ", line_number, ": bad rank");
      rank = rank * 10 + (c - '0');
    }
    SPARROW_CHECK(!rank_text.empty(), "line ", line_number, ": bad rank");
    SPARROW_CHECK(ranks_.emplace(bytes, TokenId(rank)).second, "line ", line_number, ": repeated token bytes");
    if (size_t(rank) >= rank_seen.size()) rank_seen.resize(rank + 1);
    SPARROW_CHECK(!rank_seen[rank], "line ", line_number, ": repeated rank ", rank);
    rank_seen[rank] = true;
    set_token(TokenId(rank), byte_level_text(bytes), bytes, false);
  }
  SPARROW_CHECK(!ranks_.empty(), "no tokens");

  // tokenization_kimi.py numbers the special tokens from len(mergeable_ranks).
  const TokenId first_special = TokenId(ranks_.size());
  nlohmann::json names = tokenizer_config.is_object() ? tokenizer_config.value("added_tokens_decoder", nlohmann::json())
                                                      : nlohmann::json();
  std::vector<AddedToken> specials;
  std::vector<std::string> patterns;
  for (TokenId id = first_special; id < first_special + kReservedSpecialTokens; ++id) {
    std::string key = std::to_string(id), name = "<|reserved_token_" + key + "|>";
    if (names.is_object() && names.contains(key)) {
      SPARROW_CHECK(names[key].is_object() && names[key].contains("content") && names[key]["content"].is_string(),
                    "tokenizer_config.json: added_tokens_decoder entry ", key, " has no \"content\"");
      name = names[key]["content"].get<std::string>();
    }
    set_token(id, name, name, true);
    specials.push_back({.content = name, .id = id, .special = true});
    patterns.push_back(name);
  }
  // tiktoken finds special tokens with one regex of alternatives (leftmost match); Kimi's names are
  // never prefixes of one another, so leftmost-longest finds the same.
  specials_ = AddedTokenMatcher(std::move(specials), std::move(patterns));
}

std::vector<TokenId> TiktokenTokenizer::encode(std::string_view text) const {
  SPARROW_CHECK(utf8::is_valid(text), "text to encode is not valid UTF-8");
  std::vector<TokenId> ids;
  for (const auto& segment : specials_.split(text)) {
    if (segment.token >= 0) {
      ids.push_back(segment.token);
      continue;
    }
    // tiktoken runs the pattern over the text between special tokens only.
    std::string_view part = text.substr(segment.begin, segment.end - segment.begin);
    for (auto [begin, end] : pattern_.find_all(part)) {
      std::string_view piece = part.substr(begin, end - begin);
      if (auto it = ranks_.find(piece); it != ranks_.end()) {
        ids.push_back(it->second);
      } else {
        std::vector<TokenId> merged = byte_pair_encode(piece);
        ids.insert(ids.end(), merged.begin(), merged.end());
      }
    }
  }
  return ids;
}

// tiktoken's byte_pair_encode (_byte_pair_merge): start from single bytes and repeatedly join the
// adjacent pair whose joined bytes have the lowest rank (the leftmost among equals). parts[k] is where
// part k starts plus the rank of joining it with the next part.
std::vector<TokenId> TiktokenTokenizer::byte_pair_encode(std::string_view piece) const {
  constexpr TokenId kNone = INT32_MAX;
  auto rank_of = [&](size_t begin, size_t end) {
    auto it = ranks_.find(piece.substr(begin, end - begin));
    return it == ranks_.end() ? kNone : it->second;
  };
  struct Part {
    size_t start;
    TokenId rank;
  };
  std::vector<Part> parts;
  for (size_t i = 0; i + 1 < piece.size(); ++i) parts.push_back({i, rank_of(i, i + 2)});
  parts.push_back({piece.size() - 1, kNone});
  parts.push_back({piece.size(), kNone});
  // The rank of joining parts k and k+1 (which ends where part k+2 starts).
  auto joined_rank = [&](size_t k) {
    return k + 3 < parts.size() ? rank_of(parts[k].start, parts[k + 3].start) : kNone;
  };

  while (true) {
    size_t best = 0;
    for (size_t k = 1; k + 1 < parts.size(); ++k)
      if (parts[k].rank < parts[best].rank) best = k;
    if (parts[best].rank == kNone) break;
    if (best > 0) parts[best - 1].rank = joined_rank(best - 1);
    parts[best].rank = joined_rank(best);
    parts.erase(parts.begin() + best + 1);
  }

  std::vector<TokenId> ids;
  for (size_t k = 0; k + 1 < parts.size(); ++k) {
    TokenId id = rank_of(parts[k].start, parts[k + 1].start);
    SPARROW_CHECK(id != kNone, "tiktoken.model cannot encode a byte: every single byte needs a rank");
    ids.push_back(id);
  }
  return ids;
}

}  // namespace sparrow
