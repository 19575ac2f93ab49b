// The checks both tokenizer targets run on one input (encode, decode, streaming decode), and the
// properties tokenizer.h and detokenizer.h promise.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace sparrow::fuzz {

// `bytes` is used three ways: as text to encode (raw, which must be refused unless it is UTF-8, then
// made valid as the engine's detokenizer would), as token ids to decode (each 2 bytes one signed id, so
// that ids past the vocabulary and negative ones come up), and as the stop string of a streaming decode.
// `round_trips`: decode(encode(text)) == text holds for this tokenizer (no normalizer changes the text).
inline void check_tokenizer(const Tokenizer& tokenizer, std::string_view bytes, bool round_trips) {
  refusing_only_with_errors([&] { tokenizer.encode(bytes); });

  const std::string text = utf8::decode_lossy(bytes);
  const std::vector<TokenId> encoded = tokenizer.encode(text);
  for (TokenId id : encoded) require(id >= 0 && id < tokenizer.vocab_size(), "encode returns ids of the vocabulary");
  if (round_trips) require(tokenizer.decode(encoded) == text, "decode(encode(text)) == text");

  std::vector<TokenId> ids;
  for (size_t i = 0; i + 1 < bytes.size(); i += 2)
    ids.push_back(static_cast<int16_t>(static_cast<uint8_t>(bytes[i]) | static_cast<uint8_t>(bytes[i + 1]) << 8));
  const std::string decoded = tokenizer.decode(ids);
  require(utf8::is_valid(decoded), "decode gives valid UTF-8");

  // Streamed, the deltas join to decode()'s text, cut right before the first stop string. The stop
  // string is 1 to 4 characters of the decoded text (so that it matches; valid UTF-8, as a request's
  // stop strings are), its place and length from the input.
  std::string stop;
  if (!decoded.empty() && bytes.size() >= 2) {
    size_t begin = static_cast<uint8_t>(bytes[0]) % decoded.size(), end = begin;
    while (begin > 0 && (static_cast<uint8_t>(decoded[begin]) & 0xC0) == 0x80) --begin;
    for (int n = 0; n <= static_cast<uint8_t>(bytes[1]) % 4 && end < decoded.size(); ++n)
      end += utf8::sequence_length(static_cast<uint8_t>(decoded[end]));
    stop = decoded.substr(begin, end - begin);
  }
  for (bool with_stop : {false, true}) {
    IncrementalDetokenizer detokenizer(tokenizer, with_stop ? std::vector<std::string>{stop} : std::vector<std::string>{});
    std::string joined;
    bool stopped = false;
    for (TokenId id : ids) {
      IncrementalDetokenizer::Delta delta = detokenizer.push(id);
      require(!stopped || delta.text.empty(), "nothing follows a stop");
      require(utf8::is_valid(delta.text), "each delta is valid UTF-8");
      joined += delta.text;
      stopped = stopped || delta.stopped;
    }
    if (!stopped) joined += detokenizer.finish().text;
    size_t cut = with_stop && !stop.empty() ? decoded.find(stop) : std::string::npos;
    require(joined == decoded.substr(0, cut), "the streamed deltas join to decode(), cut at the stop string");
  }
}

}  // namespace sparrow::fuzz
