// The Hugging Face byte-level BPE tokenizers (tokenizer.json) of the bundled models and of the test
// tokenizers: encode, decode and streaming decode of fuzzed bytes (tokenizer_checks.h). Input: one byte
// choosing the tokenizer, then the bytes.
#include <cstdint>
#include <memory>
#include <vector>

#include "tokenizer_checks.h"

using namespace sparrow;

namespace {

struct Loaded {
  std::unique_ptr<Tokenizer> tokenizer;
  bool round_trips;
};

const std::vector<Loaded>& tokenizers() {
  static const std::vector<Loaded> all = [] {
    std::vector<Loaded> t;
    // MiniMax's tokenizer applies NFC, so decode(encode(text)) may differ from the text; the others keep
    // every text as it is (tests/data/tokenizers/*/expected.json "roundtrip_changed" is empty for them).
    for (auto [dir, round_trips] : {std::pair{"models/kimi_k3", true}, {"models/minimax_m3", false},
                                    {"models/deepseek_v32", true}, {"tests/data/tokenizers/deepseek_v32", true},
                                    {"tests/data/tokenizers/minimax_m3", false}})
      t.push_back({load_tokenizer(fuzz::source_path(dir)), round_trips});
    return t;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Loaded& chosen = tokenizers()[data[0] % tokenizers().size()];
  fuzz::check_tokenizer(*chosen.tokenizer, fuzz::as_text(data + 1, size - 1), chosen.round_trips);
  return 0;
}
