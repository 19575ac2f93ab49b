// The messages of the HTTP layer (http_server.h): a request as a handler receives it, a response as a
// handler gives it back, and how a response is framed on the wire (RFC 9112). Nothing here knows about
// OpenAI, and nothing here needs Boost: the server's routes (server.cpp) and the tests include this.
#pragma once
#include <chrono>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sparrow::server::http {

// Header fields in the order received; names compare without regard to case (RFC 9110 section 5.1).
using Fields = std::vector<std::pair<std::string, std::string>>;

bool equals_ignoring_case(std::string_view a, std::string_view b);

struct Request {
  std::string method;          // as sent: "GET", "POST", ...
  std::string target;          // the request target as sent: "/v1/models?x=1"
  std::string path;            // the target's path: no query, no scheme or authority
  int version = 11;            // 10 for HTTP/1.0, 11 for HTTP/1.1
  Fields fields;               // values without the whitespace around them (RFC 9110 section 5.5)
  std::string header_section;  // the request line and header fields exactly as received
  std::string body;            // chunked bodies arrive joined
  std::string remote_address;  // the client's IP address
  std::chrono::steady_clock::time_point received;  // when the whole request had arrived
  std::string id;  // the client's X-Request-Id when it gave a usable one, else 32 random hex digits

  // The first field of this name; "" when there is none.
  std::string field(std::string_view name) const;
  // The value of the one field of this name as the client wrote it: only the whitespace after the colon
  // is dropped, trailing whitespace is kept. RFC 9110 section 5.5 has recipients drop it, but credentials
  // are compared as sent: `Bearer secret ` is not the key `secret`. Nothing when the field is absent or
  // given more than once.
  std::optional<std::string> verbatim_field(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type;  // empty: no Content-Type field
  Fields fields;             // more fields, e.g. Allow, Retry-After
  std::string body;          // a whole response's body; a stream's first bytes
  // Not sent: what the access log calls this answer (the server layer puts its completion id here);
  // empty: the request's id.
  std::string log_id = {};
};

// How the end of a response body is found (RFC 9112 section 6.3).
enum class Framing {
  ContentLength,  // a whole body, its length in Content-Length
  Chunked,        // a stream to an HTTP/1.1 client: chunks, then the last chunk (section 7.1)
  UntilClose,     // a stream to an HTTP/1.0 client, which knows no chunks: the body ends when the connection does
};

// The status line and header section of `response`: Date, Content-Type, its own fields, the framing
// field and Connection. `content_length` is used with Framing::ContentLength only.
std::string response_head(const Response& response, int version, Framing framing, bool keep_alive,
                          size_t content_length, std::time_t now = std::time(nullptr));
// One chunk of a chunked body (empty data gives nothing: an empty chunk would end the body).
std::string chunk(std::string_view data);
inline constexpr std::string_view kLastChunk = "0\r\n\r\n";
// RFC 9110 section 15's reason phrase for a status ("" for one it does not name).
std::string_view reason_phrase(int status);
// An IMF-fixdate (RFC 9110 section 5.6.7): "Sun, 06 Nov 1994 08:49:37 GMT".
std::string http_date(std::time_t time);
// A request target's path: the origin form without its query, or an absolute form's path
// (RFC 9112 section 3.2).
std::string target_path(std::string_view target);

}  // namespace sparrow::server::http
