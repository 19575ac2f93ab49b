// Streaming detokenization: generated tokens in, text deltas out.
//
// Deltas never end inside a UTF-8 sequence (bytes of a character split across tokens are held back
// until it completes), and their concatenation equals Tokenizer::decode of all the tokens. With stop
// strings, text that could be the start of a stop string is held back until it is known not to be,
// and the text stops right before the first stop string that appears, even when it spans tokens.
#pragma once
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace sparrow {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, std::vector<std::string> stop_strings = {});

  // Stop strings can be added before the first token. Empty strings are ignored.
  void add_stop_string(std::string stop);

  struct Delta {
    std::string text;     // new text, possibly empty
    bool stopped = false; // a stop string matched: `text` ends right before it, and nothing follows
    int stop_index = -1;  // which stop string (in the order given), when stopped
  };

  // The text that `id` completes. After a stop, returns an empty delta with `stopped` set.
  Delta push(TokenId id);
  // End of generation: everything still held back (bytes that never completed a character become
  // U+FFFD, as in decode()).
  Delta finish();

  bool stopped() const { return stopped_; }

 private:
  Delta release(std::string decoded, bool final);

  const Tokenizer* tokenizer_;  // a pointer, so that detokenizers can be assigned
  std::vector<std::string> stops_;
  std::string pending_bytes_;  // token bytes that do not yet form a whole character
  std::string held_text_;      // decoded text that may be the start of a stop string
  bool stopped_ = false;
  int stop_index_ = -1;
};

}  // namespace sparrow
