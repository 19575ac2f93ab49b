// Kimi's tiktoken tokenizer (tiktoken.model with the special tokens of tokenizer_config.json): encode,
// decode and streaming decode of fuzzed bytes (tokenizer_checks.h).
#include <cstdint>
#include <memory>

#include "tokenizer_checks.h"

using namespace sparrow;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<Tokenizer> kimi = load_tokenizer(fuzz::source_path("tests/data/tokenizers/kimi_linear"));
  fuzz::check_tokenizer(*kimi, fuzz::as_text(data, size), /*round_trips=*/true);
  return 0;
}
