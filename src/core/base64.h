// Base64 (RFC 4648's standard alphabet, with padding) decoding: tiktoken model files and the OpenAI API's data: URLs.
#pragma once
#include <string>
#include <string_view>

namespace sparrow {

// The bytes `text` encodes; throws sparrow::Error ("bad base64 ...") for a character outside the alphabet, a
// length that is not a multiple of 4, or padding anywhere but at the end.
std::string base64_decode(std::string_view text);
// The padded encoding of `bytes`.
std::string base64_encode(std::string_view bytes);

}  // namespace sparrow
