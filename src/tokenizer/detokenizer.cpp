#include "tokenizer/detokenizer.h"

#include "tokenizer/utf8.h"

namespace sparrow {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, std::vector<std::string> stop_strings)
    : tokenizer_(&tokenizer) {
  for (std::string& stop : stop_strings) add_stop_string(std::move(stop));
}

void IncrementalDetokenizer::add_stop_string(std::string stop) {
  if (!stop.empty()) stops_.push_back(std::move(stop));
}

IncrementalDetokenizer::Delta IncrementalDetokenizer::push(TokenId id) {
  if (stopped_) return {"", true, stop_index_};
  if (const std::string* bytes = tokenizer_->token_bytes(id)) pending_bytes_ += *bytes;
  std::string decoded;
  pending_bytes_.erase(0, utf8::decode_lossy(pending_bytes_, /*final=*/false, decoded));
  return release(std::move(decoded), /*final=*/false);
}

IncrementalDetokenizer::Delta IncrementalDetokenizer::finish() {
  if (stopped_) return {"", true, stop_index_};
  std::string decoded;
  utf8::decode_lossy(pending_bytes_, /*final=*/true, decoded);
  pending_bytes_.clear();
  return release(std::move(decoded), /*final=*/true);
}

IncrementalDetokenizer::Delta IncrementalDetokenizer::release(std::string decoded, bool final) {
  held_text_ += decoded;

  // The first stop string to appear (the earlier listed one when two start at the same place). The
  // held text never contains a whole stop string, so any match is new.
  size_t stop_at = std::string::npos;
  for (size_t k = 0; k < stops_.size(); ++k) {
    size_t at = held_text_.find(stops_[k]);
    if (at < stop_at) {
      stop_at = at;
      stop_index_ = int(k);
    }
  }
  if (stop_at != std::string::npos) {
    stopped_ = true;
    Delta delta{held_text_.substr(0, stop_at), true, stop_index_};
    held_text_.clear();
    return delta;
  }

  // Hold back the longest end of the text that begins some stop string.
  size_t hold = 0;
  if (!final)
    for (const std::string& stop : stops_)
      for (size_t n = std::min(stop.size() - 1, held_text_.size()); n > hold; --n)
        if (held_text_.compare(held_text_.size() - n, n, stop, 0, n) == 0) {
          hold = n;
          break;
        }
  Delta delta{held_text_.substr(0, held_text_.size() - hold)};
  held_text_.erase(0, held_text_.size() - hold);
  return delta;
}

}  // namespace sparrow
