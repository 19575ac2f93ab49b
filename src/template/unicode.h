// The few Unicode facts the Jinja interpreter needs to behave like Python's str: UTF-8 decoding and
// encoding, and the character classes behind str.isspace / str.isprintable / str.lower / str.upper.
// Strings stay UTF-8 everywhere; code points are decoded only where Python counts characters
// (len, indexing, slicing, strip sets).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer/utf8.h"

namespace sparrow::jinja {

// Code points of valid UTF-8 text and back (single characters: sparrow::utf8::next / append).
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
// Number of code points (Python's len of a str).
size_t utf8_length(std::string_view s);

// Python's str.isspace for one character (the Unicode White_Space / bidi-whitespace set CPython uses).
bool is_space(char32_t c);
// Python's str.isprintable for one character, for the repr of strings: controls, format characters,
// separators other than ' ', surrogates and private-use characters are not printable.
bool is_printable(char32_t c);
// Python's line boundaries for str.splitlines.
bool is_line_break(char32_t c);
// Letters and digits as Python's str.isalpha / str.isdigit / \w see them; outside ASCII every
// character that has a case, and every character of a non-Latin script block, counts as a letter.
bool is_alpha(char32_t c);
bool is_digit(char32_t c);

// Case mapping of Python's str.lower / str.upper for the Latin, Greek, Cyrillic, Armenian and
// full-width blocks (what chat templates meet); other characters are returned unchanged. The
// one-to-many mappings that matter (ß → SS, İ → i̇) are handled by the string versions.
char32_t to_lower(char32_t c);
char32_t to_upper(char32_t c);
bool is_cased(char32_t c);  // has an upper/lower form (for str.title and str.islower)
std::string lower(std::string_view s);
std::string upper(std::string_view s);

}  // namespace sparrow::jinja
