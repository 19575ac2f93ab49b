// Pieces of the OpenAI response bodies that both endpoints build: ids, usage, logprobs in the chat
// and the legacy completions shapes, and the server-sent-events framing of a stream.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/logprobs.h"
#include "server/json_fields.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::server {

// prefix + 32 random hex digits ("chatcmpl-…", "cmpl-…").
std::string random_id(const std::string& prefix);
// Seconds since the epoch, for "created".
int64_t unix_time();

struct Usage {
  Usage(int64_t prompt, int64_t completion) : prompt_tokens(prompt), completion_tokens(completion) {}
  int64_t prompt_tokens, completion_tokens;
  std::optional<int64_t> cached_tokens;     // prompt_tokens_details.cached_tokens, when reported
  std::optional<int64_t> reasoning_tokens;  // completion_tokens_details.reasoning_tokens, when reported
};
Json usage_json(const Usage& usage);

// The text a token stands for in logprobs (its decoded bytes; a partial UTF-8 character decodes to U+FFFD).
std::string token_text(const Tokenizer& tokenizer, int32_t token);

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
Json chat_logprob_entries(const Tokenizer& tokenizer, const std::vector<TokenLogprob>& logprobs);

// Characters (code points) in UTF-8 text: what OpenAI's text_offset counts.
int64_t character_count(std::string_view text);

// Completions (legacy shape), accumulated over a choice's tokens: tokens[], token_logprobs[],
// top_logprobs[{token: logprob}], text_offset[] (character offsets into the choice's text).
class CompletionLogprobs {
 public:
  void append(const Tokenizer& tokenizer, const std::vector<TokenLogprob>& logprobs, int64_t& text_offset);
  Json json() const;
  bool empty() const { return tokens_.empty(); }

 private:
  Json tokens_ = Json::array(), token_logprobs_ = Json::array(), top_logprobs_ = Json::array(),
       text_offset_ = Json::array();
};

// vLLM's prompt_logprobs: one entry per prompt token, null for the first, else
// {"<token id>": {"logprob", "rank", "decoded_token"}} for the prompt token and the top alternatives.
Json prompt_logprobs_json(const Tokenizer& tokenizer, const std::vector<std::optional<TokenLogprob>>& logprobs);

// Serialises a body; bytes that are not UTF-8 (which should never reach here) become U+FFFD instead of
// throwing.
std::string to_text(const Json& body);

// One server-sent event: "data: <json>\n\n"; the stream ends with kStreamEnd.
std::string sse_event(const Json& data);
inline constexpr const char* kStreamEnd = "data: [DONE]\n\n";
// The end of a stream: when the request set stream_options.include_usage, `chunk` (a chunk with no
// choices) carrying `usage`; then [DONE].
std::string stream_tail(bool include_usage, Json chunk, const Json& usage);

}  // namespace sparrow::server
