// Split patterns of tokenizer files, run with PCRE2.
//
// The patterns are written for the reference libraries' engines: Oniguruma (Hugging Face tokenizers)
// and Rust's fancy-regex (tiktoken). Most of the syntax means the same in PCRE2 (UTF + UCP mode);
// translate_pattern() rewrites the parts that do not:
//   \s, \S          White_Space in both references; PCRE2's \s also matches U+180E
//                   -> \p{White_Space}, \P{White_Space}
//   \w, \W          Alphabetic, marks, Nd, Pc and Join_Control in both; PCRE2 10.42 differs
//                   -> the explicit class
//   \p{Han}         a script name means the Script property in both; PCRE2 means Script_Extensions
//                   -> \p{sc:Han} (general categories and binary properties are left alone)
//   [A&&[^B]]       class intersection (Kimi's pat_str); PCRE2 has none -> (?:(?![B])[A])
//   \uHHHH          Oniguruma's escape -> \x{HHHH}
// Constructs whose meaning differs and that no real tokenizer uses (anchors, \b, POSIX classes,
// nested classes other than an intersection operand) are rejected with a one-line error.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sparrow {

std::string translate_pattern(std::string_view pattern);

class Regex {
 public:
  // `pattern` in the references' syntax (see above); errors name the pattern.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The byte ranges [begin, end) of the non-overlapping matches in `subject` (valid UTF-8), left to
  // right. Like Rust's find_iter and Oniguruma's: after a match the search resumes at its end, and an
  // empty match right where the previous match ended is skipped.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace sparrow
