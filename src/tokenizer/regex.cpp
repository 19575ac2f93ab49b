#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <optional>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

constexpr std::array<std::string_view, 39> kGeneralCategories = {
    "C",  "Cc", "Cf", "Cn", "Co", "Cs", "L",  "L&", "Ll", "Lm", "Lo", "Lt", "Lu", "M",  "Mc", "Me", "Mn",
    "N",  "Nd", "Nl", "No", "P",  "Pc", "Pd", "Pe", "Pf", "Pi", "Po", "Ps", "S",  "Sc", "Sk", "Sm", "So",
    "Z",  "Zl", "Zp", "Zs", "Any"};
// Binary properties PCRE2 and both references read alike. Other names are taken as scripts.
constexpr std::array<std::string_view, 8> kBinaryProperties = {
    "White_Space", "Alphabetic", "Join_Control", "Uppercase", "Lowercase", "Emoji", "Emoji_Presentation",
    "Extended_Pictographic"};
// The references' \w (Unicode's "word" characters, UTS #18).
constexpr std::string_view kWordChars = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}";

template <size_t N>
bool contains(const std::array<std::string_view, N>& names, std::string_view name) {
  for (std::string_view n : names)
    if (n == name) return true;
  return false;
}

// A single pass over the pattern, copying what PCRE2 reads alike and rewriting the rest.
class PatternTranslator {
 public:
  explicit PatternTranslator(std::string_view pattern) : p_(pattern) {}

  std::string run() {
    std::string out;
    while (i_ < p_.size()) {
      char c = p_[i_];
      if (c == '\\') {
        out += escape(/*in_class=*/false);
      } else if (c == '[') {
        out += character_class();
      } else if (c == '^' || c == '$') {
        reject("anchors ^ and $ (their meaning differs between the engines)");
      } else {
        copy_char(out);
      }
    }
    return out;
  }

 private:
  // One operand of a class intersection: a union of items, or a negated nested class.
  struct Operand {
    std::string body;
    bool negated = false;
  };

  [[noreturn]] void reject(std::string_view what) const {
    fail("unsupported regex in tokenizer pattern '", p_, "': ", what);
  }

  void copy_char(std::string& out) {
    size_t length = utf8::sequence_length(static_cast<unsigned char>(p_[i_]));
    out.append(p_.substr(i_, length));
    i_ += length;
  }

  // At a backslash: the PCRE2 text for the escape, inside a class or not.
  std::string escape(bool in_class) {
    if (i_ + 1 >= p_.size()) reject("trailing backslash");
    char c = p_[i_ + 1];
    i_ += 2;
    switch (c) {
      case 's': return "\\p{White_Space}";
      case 'S': return "\\P{White_Space}";
      case 'w': return in_class ? std::string(kWordChars) : "[" + std::string(kWordChars) + "]";
      case 'W':
        if (in_class) reject("\\W inside a class");
        return "[^" + std::string(kWordChars) + "]";
      case 'v': return "\\x{0B}";  // a vertical tab in both references; a class of characters in PCRE2
      case 'p':
      case 'P': return property(c == 'P');
      case 'u': {
        if (i_ + 4 > p_.size()) reject("short \\u escape");
        std::string hex(p_.substr(i_, 4));
        i_ += 4;
        return "\\x{" + hex + "}";
      }
      case 'b': case 'B': case 'A': case 'z': case 'Z': case 'G': case 'h': case 'H': case 'R': case 'X':
      case 'K': case 'g': case 'k':
        reject(std::string("\\") + c);
      default: {
        std::string out = "\\";
        --i_;
        copy_char(out);
        return out;
      }
    }
  }

  // After \p or \P: a general category or binary property as is, a script name as \p{sc:Name}.
  std::string property(bool negated) {
    std::string prefix = negated ? "\\P" : "\\p";
    if (i_ >= p_.size()) reject("\\p without a name");
    if (p_[i_] != '{') {
      std::string out = prefix;
      copy_char(out);
      return out;  // one-letter category: \pL
    }
    size_t close = p_.find('}', i_);
    if (close == std::string_view::npos) reject("unterminated \\p{");
    std::string_view name = p_.substr(i_ + 1, close - i_ - 1);
    i_ = close + 1;
    if (name.find_first_of("=:^") != std::string_view::npos) reject("\\p{...} with a key or negation");
    if (contains(kGeneralCategories, name) || contains(kBinaryProperties, name))
      return prefix + "{" + std::string(name) + "}";
    return prefix + "{sc:" + std::string(name) + "}";
  }

  // At '[': a class, with intersections (A&&B) turned into lookaheads.
  std::string character_class() {
    bool negated;
    std::vector<Operand> operands = class_operands(negated);
    auto as_class = [](const Operand& op) { return (op.negated ? "[^" : "[") + op.body + "]"; };
    if (operands.size() == 1) {
      Operand only = operands[0];
      if (negated && only.negated) reject("a negated class holding only a negated class");
      only.negated = only.negated || negated;
      return as_class(only);
    }
    if (negated) reject("a negated class intersection");
    std::string out = "(?:";
    for (size_t k = 1; k < operands.size(); ++k) out += "(?=" + as_class(operands[k]) + ")";
    return out + as_class(operands[0]) + ")";
  }

  std::vector<Operand> class_operands(bool& negated) {
    ++i_;  // '['
    negated = i_ < p_.size() && p_[i_] == '^';
    if (negated) ++i_;
    std::vector<Operand> operands(1);
    bool first = true;
    while (true) {
      if (i_ >= p_.size()) reject("unterminated class");
      char c = p_[i_];
      Operand& current = operands.back();
      if (c == ']' && !first) {
        ++i_;
        break;
      }
      if (c == '&' && i_ + 1 < p_.size() && p_[i_ + 1] == '&') {
        i_ += 2;
        operands.emplace_back();
      } else if (c == '[') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') reject("POSIX classes");
        bool inner_negated;
        std::vector<Operand> inner = class_operands(inner_negated);
        if (inner.size() != 1 || inner[0].negated) reject("nested intersections");
        if (inner_negated) {
          // A negated nested class can only stand alone as an intersection operand: [A&&[^B]].
          if (!current.body.empty() || current.negated) reject("a negated class inside a union");
          current = {inner[0].body, true};
        } else {
          if (current.negated) reject("a union with a negated class");
          current.body += inner[0].body;
        }
      } else if (c == '\\') {
        if (current.negated) reject("a union with a negated class");
        current.body += escape(/*in_class=*/true);
      } else {
        if (current.negated) reject("a union with a negated class");
        copy_char(current.body);
      }
      first = false;
    }
    for (const Operand& op : operands)
      if (op.body.empty()) reject("an empty class operand");
    return operands;
  }

  std::string_view p_;
  size_t i_ = 0;
};

// Per-thread match scratch: one ovector pair and a JIT stack large enough for long whitespace runs.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign(context, nullptr, jit_stack); }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

std::string translate_pattern(std::string_view pattern) { return PatternTranslator(pattern).run(); }

struct Regex::Compiled {
  pcre2_code* code = nullptr;
  ~Compiled() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern) : compiled_(std::make_unique<Compiled>()) {
  std::string translated = translate_pattern(pattern);
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);  // '.' stops at \n only, as in both references
  int error = 0;
  PCRE2_SIZE offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                  PCRE2_UTF | PCRE2_UCP, &error, &offset, context);
  pcre2_compile_context_free(context);
  if (compiled_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    fail("bad regex in tokenizer pattern '", pattern, "': ", reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when unavailable
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view subject) const {
  MatchScratch& s = scratch();
  std::vector<std::pair<size_t, size_t>> matches;
  size_t start = 0;
  std::optional<size_t> last_end;
  while (start <= subject.size()) {
    int rc = pcre2_match(compiled_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                         PCRE2_NO_UTF_CHECK, s.data, s.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      fail("tokenizer regex failed on a text of ", subject.size(), " bytes: ", reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(s.data);
    size_t begin = ovector[0], end = ovector[1];
    if (begin == end && last_end == end) {
      // An empty match where the previous one ended: step over one character and search again.
      if (start >= subject.size()) break;
      start += utf8::sequence_length(static_cast<unsigned char>(subject[start]));
      continue;
    }
    matches.emplace_back(begin, end);
    start = end;
    last_end = end;
  }
  return matches;
}

}  // namespace sparrow
