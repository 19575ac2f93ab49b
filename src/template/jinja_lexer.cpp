#include "template/jinja_lexer.h"

#include <cstdlib>

#include "template/jinja_value.h"
#include "template/py_text.h"
#include "template/unicode.h"

namespace sparrow::jinja {
namespace {

// jinja2 turns \r\n and \r into \n and, without keep_trailing_newline, drops one final newline.
std::string normalize_newlines(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool is_digit_char(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit_char(c); }
bool is_hex_char(char c) { return is_digit_char(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Python's unicode-escape decoding of a string literal's body (what jinja2 applies to literals).
std::string unescape(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 >= body.size()) {
      out += body[i];
      continue;
    }
    char e = body[++i];
    auto hex_escape = [&](int digits) {
      if (i + digits >= body.size()) template_fail("truncated \\", e, " escape in a string literal");
      for (int k = 1; k <= digits; ++k)
        if (!is_hex_char(body[i + k])) template_fail("truncated \\", e, " escape in a string literal");
      auto code = static_cast<char32_t>(std::strtoul(std::string(body.substr(i + 1, digits)).c_str(), nullptr, 16));
      if (code > 0x10FFFF) template_fail("illegal Unicode character in a string literal");
      utf8::append(out, code);
      i += digits;
    };
    switch (e) {
      case '\n':
        break;  // line continuation
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        hex_escape(2);
        break;
      case 'u':
        hex_escape(4);
        break;
      case 'U':
        hex_escape(8);
        break;
      case 'N':
        template_fail("\\N{...} escapes are not supported in string literals");
      default:
        if (e >= '0' && e <= '7') {
          char32_t code = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            code = code * 8 + (body[++i] - '0');
          utf8::append(out, code);
        } else {  // unknown escapes stay as written
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) lex_text_and_tag();
    push(Token::Type::End, "", src_.size());
    return std::move(tokens_);
  }

 private:
  enum class Tag { Variable, Block, Comment };

  // The line of a source offset; offsets only grow, so this counts newlines incrementally.
  int line_at(size_t offset) {
    for (; counted_ < offset && counted_ < src_.size(); ++counted_) line_ += src_[counted_] == '\n';
    return line_;
  }

  void push(Token::Type type, std::string text, size_t offset) {
    Token t{type, std::move(text)};
    t.line = line_at(offset);
    tokens_.push_back(std::move(t));
  }

  // Bytes of the Unicode whitespace character at `at`, 0 if none (Python's \s).
  size_t space_at(size_t at) const {
    if (at >= src_.size()) return 0;
    auto b = static_cast<unsigned char>(src_[at]);
    if (b < 0x80) return is_space(b) ? 1 : 0;
    size_t n = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    std::u32string c = utf8_decode(std::string_view(src_).substr(at, n));
    return !c.empty() && is_space(c[0]) ? n : 0;
  }
  size_t skip_spaces(size_t at) const {
    while (size_t n = space_at(at)) at += n;
    return at;
  }
  bool starts_with(size_t at, std::string_view s) const { return std::string_view(src_).substr(at, s.size()) == s; }

  // jinja2's OptionalLStrip: the text before a tag loses its trailing whitespace when the tag opens
  // with '-', or (lstrip_blocks) its last line when that line is only spaces before a block/comment.
  std::string strip_before_tag(std::string_view text, char sign, bool lstrip_applies) const {
    if (sign == '-') return strip(text, std::nullopt, false, true);
    if (sign != '+' && lstrip_applies) {
      size_t line_start = text.rfind('\n');
      line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
      if (line_start > 0 || line_starting_) {
        std::string_view last_line = text.substr(line_start);
        if (!last_line.empty() && strip(last_line, std::nullopt, true, true).empty())
          return std::string(text.substr(0, line_start));
      }
    }
    return std::string(text);
  }

  void lex_text_and_tag() {
    size_t at = pos_;
    Tag tag{};
    for (;; ++at) {
      at = src_.find('{', at);
      if (at == std::string::npos || at + 1 >= src_.size()) {
        push(Token::Type::Text, src_.substr(pos_), pos_);
        pos_ = src_.size();
        return;
      }
      char next = src_[at + 1];
      if (next == '{' || next == '%' || next == '#') {
        tag = next == '{' ? Tag::Variable : next == '%' ? Tag::Block : Tag::Comment;
        break;
      }
    }
    char sign = at + 2 < src_.size() && (src_[at + 2] == '-' || src_[at + 2] == '+') ? src_[at + 2] : 0;
    size_t raw_end = tag == Tag::Block ? raw_open_end(at + 2 + (sign ? 1 : 0)) : std::string::npos;
    std::string text = strip_before_tag(std::string_view(src_).substr(pos_, at - pos_), sign, tag != Tag::Variable);
    if (!text.empty()) push(Token::Type::Text, std::move(text), pos_);
    pos_ = at + 2 + (sign ? 1 : 0);
    line_starting_ = false;
    if (raw_end != std::string::npos) {
      line_starting_ = src_[raw_end - 1] == '\n';
      pos_ = raw_end;
      lex_raw_body();
    } else if (tag == Tag::Comment) {
      lex_comment();
    } else {
      push(tag == Tag::Variable ? Token::Type::VariableBegin : Token::Type::BlockBegin, "", at);
      lex_tag(tag);
    }
  }

  // `{% raw %}`: the end of the opening tag when the block at `at` (after "{%" and its sign) is one.
  size_t raw_open_end(size_t at) const {
    at = skip_spaces(at);
    if (!starts_with(at, "raw")) return std::string::npos;
    at = skip_spaces(at + 3);
    if (starts_with(at, "-%}")) return skip_spaces(at + 3);
    if (starts_with(at, "%}")) return at + 2;
    return std::string::npos;
  }

  void lex_raw_body() {
    for (size_t at = src_.find("{%", pos_); at != std::string::npos; at = src_.find("{%", at + 1)) {
      size_t p = at + 2;
      char sign = p < src_.size() && (src_[p] == '-' || src_[p] == '+') ? src_[p++] : 0;
      p = skip_spaces(p);
      if (!starts_with(p, "endraw")) continue;
      p = skip_spaces(p + 6);
      size_t end = block_end_at(p);
      if (end == std::string::npos) continue;
      std::string text = strip_before_tag(std::string_view(src_).substr(pos_, at - pos_), sign, true);
      if (!text.empty()) push(Token::Type::Text, std::move(text), pos_);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    template_fail("Missing end of raw directive (line ", line_at(pos_), ")");
  }

  void lex_comment() {
    for (size_t at = pos_; at < src_.size(); ++at) {
      size_t end = std::string::npos;
      if (starts_with(at, "+#}"))
        end = at + 3;
      else if (starts_with(at, "-#}"))
        end = skip_spaces(at + 3);
      else if (starts_with(at, "#}"))
        end = at + 2 + (at + 2 < src_.size() && src_[at + 2] == '\n');
      if (end == std::string::npos) continue;
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    throw TemplateError("Missing end of comment tag", line_at(pos_));
  }

  // The end of "%}" (with its whitespace control) at `at`, or npos.
  size_t block_end_at(size_t at) const {
    if (starts_with(at, "+%}")) return at + 3;
    if (starts_with(at, "-%}")) return skip_spaces(at + 3);
    if (starts_with(at, "%}")) return at + 2 + (at + 2 < src_.size() && src_[at + 2] == '\n');  // trim_blocks
    return std::string::npos;
  }

  size_t variable_end_at(size_t at) const {
    if (starts_with(at, "-}}")) return skip_spaces(at + 3);
    if (starts_with(at, "}}")) return at + 2;
    return std::string::npos;
  }

  void lex_tag(Tag tag) {
    std::string open_brackets;  // jinja2 only ends a tag when brackets are balanced
    while (true) {
      if (pos_ >= src_.size()) throw TemplateError("Unexpected end of template inside a tag", line_at(pos_));
      if (open_brackets.empty()) {
        size_t end = tag == Tag::Block ? block_end_at(pos_) : variable_end_at(pos_);
        if (end != std::string::npos) {
          push(tag == Tag::Block ? Token::Type::BlockEnd : Token::Type::VariableEnd, "", pos_);
          line_starting_ = src_[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      if (size_t n = space_at(pos_)) {
        pos_ += n;
        continue;
      }
      char c = src_[pos_];
      if (is_digit_char(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t start = pos_;
        while (pos_ < src_.size() && is_name_char(src_[pos_])) ++pos_;
        push(Token::Type::Name, src_.substr(start, pos_ - start), start);
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        lex_operator(open_brackets);
      }
    }
  }

  // Digits with single underscores between them (Python's (\d+_)*\d+); returns the end.
  size_t digits_end(size_t at) const {
    if (at >= src_.size() || !is_digit_char(src_[at])) return at;
    while (at < src_.size()) {
      if (is_digit_char(src_[at]))
        ++at;
      else if (src_[at] == '_' && at + 1 < src_.size() && is_digit_char(src_[at + 1]))
        ++at;
      else
        break;
    }
    return at;
  }

  void lex_number() {
    size_t start = pos_;
    size_t end = digits_end(start);
    // jinja2's float_re: a fraction and/or an exponent, and not right after a '.'.
    bool after_dot = start > 0 && src_[start - 1] == '.';
    size_t float_end = std::string::npos;
    if (!after_dot) {
      size_t p = end;
      if (p < src_.size() && src_[p] == '.' && digits_end(p + 1) > p + 1) p = digits_end(p + 1);
      size_t q = p;
      if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
        ++q;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (digits_end(q) > q) p = digits_end(q);
      }
      if (p > end) float_end = p;
    }
    if (float_end != std::string::npos) {
      std::string text;
      for (size_t i = start; i < float_end; ++i)
        if (src_[i] != '_') text += src_[i];
      push(Token::Type::Float, src_.substr(start, float_end - start), start);
      tokens_.back().number = std::strtod(text.c_str(), nullptr);
      pos_ = float_end;
      return;
    }
    if (src_[start] == '0') end = start + 1;  // jinja2's integer_re reads "0" alone; hex and such are rare
    std::string text;
    for (size_t i = start; i < end; ++i)
      if (src_[i] != '_') text += src_[i];
    auto value = parse_int(text, 10);
    if (!value) throw TemplateError("integer literal " + text + " is too large", line_at(start));
    push(Token::Type::Integer, src_.substr(start, end - start), start);
    tokens_.back().integer = *value;
    pos_ = end;
  }

  void lex_string(char quote) {
    size_t start = pos_;
    size_t p = start + 1;
    while (p < src_.size() && src_[p] != quote) p += src_[p] == '\\' ? 2 : 1;
    if (p >= src_.size()) throw TemplateError("unterminated string literal", line_at(start));
    try {
      push(Token::Type::String, unescape(std::string_view(src_).substr(start + 1, p - start - 1)), start);
    } catch (TemplateError& e) {
      e.line = line_at(start);
      throw;
    }
    pos_ = p + 1;
  }

  void lex_operator(std::string& open_brackets) {
    static const char* const kTwoChar[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwoChar)
      if (starts_with(pos_, op)) {
        push(Token::Type::Operator, op, pos_);
        pos_ += 2;
        return;
      }
    char c = src_[pos_];
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      size_t n = 1;
      while (pos_ + n < src_.size() && (static_cast<unsigned char>(src_[pos_ + n]) & 0xC0) == 0x80) ++n;
      throw TemplateError("unexpected character '" + src_.substr(pos_, n) + "' in a tag", line_at(pos_));
    }
    if (c == '(' || c == '[' || c == '{') {
      open_brackets += c == '(' ? ')' : c == '[' ? ']' : '}';
    } else if (c == ')' || c == ']' || c == '}') {
      if (open_brackets.empty()) throw TemplateError(std::string("unexpected '") + c + "'", line_at(pos_));
      if (open_brackets.back() != c)
        throw TemplateError(std::string("unexpected '") + c + "', expected '" + open_brackets.back() + "'",
                            line_at(pos_));
      open_brackets.pop_back();
    }
    push(Token::Type::Operator, std::string(1, c), pos_);
    ++pos_;
  }

  std::string src_;
  size_t pos_ = 0;
  size_t counted_ = 0;  // line_ is the line of offset counted_
  int line_ = 1;
  bool line_starting_ = true;  // the last match ended a line (jinja2's line_starting)
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) { return Lexer(source).run(); }

}  // namespace sparrow::jinja
