// A /v1/completions body, as the server reads it: the JSON parse, then parse_completion_request. A bad
// body must be refused with a 400 (ApiError) or a sparrow::Error, never anything else.
#include <cstdint>

#include "fuzz_util.h"
#include "server/api_error.h"
#include "server/openai_requests.h"

using namespace sparrow;
using namespace sparrow::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Json body = parse_json_object(std::string(fuzz::as_text(data, size)));
    parse_completion_request(body, SamplingParams{}, kMaxLogprobs, /*max_prompts=*/1024);
  } catch (const ApiError&) {
  } catch (const Error&) {
  }
  return 0;
}
