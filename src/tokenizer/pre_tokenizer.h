// The "normalizer" and "pre_tokenizer" of a Hugging Face tokenizer.json: what happens to text between
// the added-token split and the BPE model.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow {

// tokenizer.json "normalizer": null, NFC, or a Sequence of those (nested, possibly empty). Returns
// whether NFC applies; any other normalizer is a one-line error.
bool parse_normalizer(const nlohmann::json& normalizer);

// One pre-tokenizer: splits a piece of text into smaller pieces (and may rewrite them, as ByteLevel
// maps bytes to printable characters). Empty pieces are dropped, as tokenizers drops them.
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void split(std::string_view piece, std::vector<std::string>& out) const = 0;
};

// tokenizer.json "pre_tokenizer": null, Split, ByteLevel, Digits or a Sequence of those, in order.
std::vector<std::unique_ptr<PreTokenizer>> parse_pre_tokenizer(const nlohmann::json& pre_tokenizer);

// GPT-2's byte -> character table used by ByteLevel: printable bytes map to themselves, the others to
// U+0100 onwards. Each entry is the character's UTF-8.
const std::vector<std::string>& byte_level_chars();

}  // namespace sparrow
