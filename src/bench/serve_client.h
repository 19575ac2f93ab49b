// The HTTP side of `sparrow bench serve`: one streamed OpenAI request timed chunk by chunk
// (cpp-httplib's blocking client, one connection per job), the server-sent-events framing, and what a
// chunk of /v1/completions or /v1/chat/completions says.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/serve_metrics.h"

namespace httplib {
class Client;
}

namespace sparrow::bench {

using Clock = std::chrono::steady_clock;

// "http://host:port/prefix" -> origin "http://host:port" and path prefix "/prefix" (no trailing '/').
struct BaseUrl {
  std::string origin, prefix;
};
BaseUrl parse_base_url(const std::string& url);

// Server-sent events: bytes in, the data of each complete event out ("data:" lines joined by '\n';
// comments and other fields ignored; "\n" or "\r\n" line ends).
class SseParser {
 public:
  std::vector<std::string> feed(std::string_view bytes);

 private:
  std::string line_, data_;
  bool has_data_ = false;
};

// What one streamed event says. A chunk carries output when it has text (completions), or content,
// reasoning or tool-call deltas (chat); the role-only first chunk of a chat stream carries none.
struct ChunkInfo {
  bool done = false;     // the [DONE] sentinel
  bool output = false;
  std::string text;      // the output text it adds (for counting tokens locally)
  std::optional<int64_t> prompt_tokens, completion_tokens;  // its usage, when it has one
  std::string error;     // an error object's message, or why the data is not a chunk
};
ChunkInfo read_chunk(const std::string& data, bool chat);

// A connection to the server; `api_key` (OPENAI_API_KEY, as vLLM's client reads it) goes in an
// Authorization header when not empty.
class ServeConnection {
 public:
  ServeConnection(const BaseUrl& url, std::string api_key);
  ~ServeConnection();

  // POSTs `body` (a streaming request) to prefix + path and times its output chunks from the moment of
  // sending. Never throws: a refused connection, an HTTP error, an error event or a stream cut short
  // is a failed result with its reason. prompt_len is the usage's prompt_tokens, -1 without one;
  // output tokens come from the usage chunk, else from `tokenizer` over the text, else one per chunk.
  RequestResult stream(const std::string& path, const std::string& body, bool chat, Clock::time_point bench_start,
                       const Tokenizer* tokenizer);
  // GET prefix + path: the body of a 200 answer, else nothing and the reason in `error`.
  std::optional<std::string> get(const std::string& path, std::string* error = nullptr);

 private:
  BaseUrl url_;
  std::string api_key_;
  std::unique_ptr<httplib::Client> client_;
};

}  // namespace sparrow::bench
