#include "tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <cctype>

#include "core/error.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

using nlohmann::json;

std::string type_of(const json& j, const char* what) {
  SPARROW_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), what,
                " without a \"type\"");
  return j["type"].get<std::string>();
}

// tokenizers' SplitDelimiterBehavior: what happens to the matches of a Split pattern.
enum class Behavior { isolated, removed, contiguous, merged_with_previous, merged_with_next };

Behavior parse_behavior(const std::string& name) {
  if (name == "Isolated") return Behavior::isolated;
  if (name == "Removed") return Behavior::removed;
  if (name == "Contiguous") return Behavior::contiguous;
  if (name == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (name == "MergedWithNext") return Behavior::merged_with_next;
  fail("Split behavior '", name,
       "' is not supported (Isolated, Removed, Contiguous, MergedWithPrevious, MergedWithNext)");
}

// A literal string as a regex matching exactly it (tokenizers' Split with {"String": ...}).
std::string escape_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    unsigned char u = c;
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

// Splits on a regex, as tokenizers' NormalizedString::split with a Pattern: the matches and the gaps
// between them cover the piece; `behavior` decides how matches join their neighbours.
class Split : public PreTokenizer {
 public:
  Split(std::string_view pattern, Behavior behavior, bool invert)
      : regex_(pattern), behavior_(behavior), invert_(invert) {}

  void split(std::string_view piece, std::vector<std::string>& out) const override {
    struct Span {
      size_t begin, end;
      bool is_match;
    };
    std::vector<Span> spans;
    size_t previous_end = 0;
    for (auto [begin, end] : regex_.find_all(piece)) {
      if (previous_end != begin) spans.push_back({previous_end, begin, false});
      spans.push_back({begin, end, true});
      previous_end = end;
    }
    if (previous_end != piece.size()) spans.push_back({previous_end, piece.size(), false});
    if (invert_)
      for (Span& s : spans) s.is_match = !s.is_match;

    std::vector<Span> kept;  // is_match now means "remove"
    bool previous_match = false;
    switch (behavior_) {
      case Behavior::isolated:
        for (const Span& s : spans) kept.push_back({s.begin, s.end, false});
        break;
      case Behavior::removed:
        kept = spans;
        break;
      case Behavior::contiguous:
        for (const Span& s : spans) {
          if (s.is_match == previous_match && !kept.empty()) kept.back().end = s.end;
          else kept.push_back({s.begin, s.end, false});
          previous_match = s.is_match;
        }
        break;
      case Behavior::merged_with_previous:
        for (const Span& s : spans) {
          if (s.is_match && !previous_match && !kept.empty()) kept.back().end = s.end;
          else kept.push_back({s.begin, s.end, false});
          previous_match = s.is_match;
        }
        break;
      case Behavior::merged_with_next:
        for (auto s = spans.rbegin(); s != spans.rend(); ++s) {
          if (s->is_match && !previous_match && !kept.empty()) kept.back().begin = s->begin;
          else kept.push_back({s->begin, s->end, false});
          previous_match = s->is_match;
        }
        std::reverse(kept.begin(), kept.end());
        break;
    }
    for (const Span& s : kept)
      if (!s.is_match && s.end > s.begin) out.emplace_back(piece.substr(s.begin, s.end - s.begin));
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

// tokenizers' ByteLevel pre-tokenizer: optionally a leading space and GPT-2's own split, then every
// byte of the piece becomes its printable stand-in character.
class ByteLevel : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space) {
    if (use_regex)
      gpt2_split_ = std::make_unique<Split>(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", Behavior::isolated, false);
  }

  void split(std::string_view piece, std::vector<std::string>& out) const override {
    std::string text = add_prefix_space_ && !piece.starts_with(' ') ? " " + std::string(piece) : std::string(piece);
    std::vector<std::string> pieces;
    if (gpt2_split_) gpt2_split_->split(text, pieces);
    else if (!text.empty()) pieces.push_back(std::move(text));
    const std::vector<std::string>& chars = byte_level_chars();
    for (const std::string& p : pieces) {
      std::string mapped;
      mapped.reserve(p.size() * 2);
      for (unsigned char b : p) mapped += chars[b];
      out.push_back(std::move(mapped));
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Split> gpt2_split_;
};

void collect_pre_tokenizers(const json& j, std::vector<std::unique_ptr<PreTokenizer>>& out) {
  if (j.is_null()) return;
  std::string type = type_of(j, "pre_tokenizer");
  if (type == "Sequence") {
    SPARROW_CHECK(j.contains("pretokenizers") && j["pretokenizers"].is_array(),
                  "Sequence pre_tokenizer without \"pretokenizers\"");
    for (const json& child : j["pretokenizers"]) collect_pre_tokenizers(child, out);
  } else if (type == "Split") {
    const json& pattern = j.value("pattern", json());
    std::string regex;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) regex = pattern["Regex"].get<std::string>();
    else if (pattern.contains("String") && pattern["String"].is_string())
      regex = escape_literal(pattern["String"].get<std::string>());
    else fail("Split pre_tokenizer without a {\"Regex\"} or {\"String\"} pattern");
    out.push_back(std::make_unique<Split>(regex, parse_behavior(j.value("behavior", "")), j.value("invert", false)));
  } else if (type == "ByteLevel") {
    out.push_back(std::make_unique<ByteLevel>(j.value("add_prefix_space", true), j.value("use_regex", true)));
  } else if (type == "Digits") {
    // tokenizers splits on char::is_numeric (general category N), one digit per piece or whole runs.
    bool individual = j.value("individual_digits", false);
    out.push_back(std::make_unique<Split>(R"(\p{N})", individual ? Behavior::isolated : Behavior::contiguous, false));
  } else {
    fail("pre_tokenizer '", type, "' is not supported (Split, ByteLevel, Digits, Sequence)");
  }
}

}  // namespace

bool parse_normalizer(const json& j) {
  if (j.is_null()) return false;
  std::string type = type_of(j, "normalizer");
  if (type == "NFC") return true;
  if (type == "Sequence") {
    SPARROW_CHECK(j.contains("normalizers") && j["normalizers"].is_array(),
                  "Sequence normalizer without \"normalizers\"");
    bool nfc = false;
    for (const json& child : j["normalizers"]) nfc = parse_normalizer(child) || nfc;  // NFC twice is NFC
    return nfc;
  }
  fail("normalizer '", type, "' is not supported (NFC, Sequence)");
}

std::vector<std::unique_ptr<PreTokenizer>> parse_pre_tokenizer(const json& j) {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  collect_pre_tokenizers(j, steps);
  return steps;
}

const std::vector<std::string>& byte_level_chars() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> chars(256);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      utf8::append(chars[b], printable ? char32_t(b) : char32_t(0x100 + next_extra++));
    }
    return chars;
  }();
  return table;
}

}  // namespace sparrow
