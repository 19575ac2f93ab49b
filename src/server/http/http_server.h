// An HTTP/1.1 server built for hostile networks, on Boost.Asio and Boost.Beast's parser; it knows
// nothing of OpenAI (server.h puts the API on top).
//
// Threads: one io_context run by a couple of io threads does every socket read and write, parse and
// timer; handlers run on a small worker pool, so a slow handler never holds up another connection.
// There is no thread per connection and none per request in flight: a handler answers through its
// Responder whenever it likes, from any thread, and may stream.
//
// What a connection may do (RFC 9112, and the limits in HttpConfig):
// - The request line and header section must arrive within `header_timeout` of the request's first
//   byte (for a new connection, of its opening), the whole request within `request_timeout`; else 408
//   and close. An idle keep-alive connection closes after `keep_alive_timeout`. A connection may send
//   any number of requests.
// - Requests sent back to back (pipelining) are answered one after another, in order; the bytes of the
//   next request wait while the current one is answered (up to kMaxPipelinedBytes).
// - HTTP/1.0 requests get HTTP/1.0 answers: a stream is delimited by closing the connection, and the
//   connection persists only when the client asked for keep-alive and the body had a length.
// - `Connection: close` is honoured; `Expect: 100-continue` gets its interim response; chunked request
//   bodies are accepted. A body longer than `max_body_bytes` gets 413, from Content-Length before it is
//   read; a header section longer than `max_header_bytes` gets 431; a malformed request 400; an unknown
//   path 404, a known path with another method 405 with Allow. These answers close the connection
//   (after reading and dropping what the client still sends, RFC 9112 section 9.6), except 404/405.
// - At most `max_connections` are open (connection_table.h says which one a newcomer replaces).
// - While a request is answered the connection keeps reading: a client that closes its end or resets
//   the connection ends the answer at once (Responder::on_done says so), as does a failed write or a
//   write that does not complete within `request_timeout`.
#pragma once
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "server/http/http_message.h"

namespace sparrow::server::http {

class Exchange;  // one request's answer in progress (http_server.cpp)

// How a handler answers its request: a whole response, or a stream. Thread-safe, cheap to copy, and
// harmless to keep after the connection is gone (calls then do nothing).
class Responder {
 public:
  explicit Responder(std::shared_ptr<Exchange> exchange) : exchange_(std::move(exchange)) {}

  // A whole response, framed by Content-Length. Only the first send() or start_stream() counts.
  void send(Response response) const;
  // A streamed response: its head and first bytes (response.body) now, more with write(), then end().
  // HTTP/1.1 clients get chunks; HTTP/1.0 clients get the bytes until the connection closes.
  void start_stream(Response head) const;
  void write(std::string bytes) const;
  void end() const;
  // `done(delivered)` runs once, when this answer ends: delivered when all of it was handed to the
  // socket, not delivered when the client went away (or the server stopped) first. It runs on an io
  // thread and must be quick. Registered after the end, it runs at once.
  void on_done(std::function<void(bool delivered)> done) const;

 private:
  std::shared_ptr<Exchange> exchange_;
};

// Runs on a worker thread. May answer before returning or later; an exception escaping it is a 500.
using Handler = std::function<void(const Request&, const Responder&)>;

struct HttpConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (bind() returns it)
  size_t max_body_bytes = size_t(32) << 20;
  size_t max_header_bytes = size_t(64) << 10;  // request line and header fields together
  std::chrono::milliseconds header_timeout{10'000};
  std::chrono::milliseconds request_timeout{60'000};
  std::chrono::milliseconds keep_alive_timeout{5'000};  // 0: one request per connection
  size_t max_connections = 1024;
  int io_threads = 2;
  int worker_threads = 0;  // 0: one per core, at least 4 and at most 16
  // A line per request on stderr when its answer ends: address, method, path, status, milliseconds from
  // the request's arrival to its last byte handed to the socket (a stream's too), and its id
  // (Response::log_id, else Request::id). An answer cut short by the client ends in "(client gone)".
  bool log_requests = true;
  // vLLM's --enable-request-id-headers: every response carries X-Request-Id, the request's id.
  bool request_id_headers = false;
  // The response to the errors this layer answers by itself (400, 404, 405, 408, 413, 431, 503, 505,
  // and 500 when a handler throws), from the status and a one-line message. Default: plain text.
  std::function<Response(int status, const std::string& message)> error_response;
};

// Bytes of the next pipelined request kept while the current one is answered; past this the
// connection stops reading until the answer is done.
inline constexpr size_t kMaxPipelinedBytes = size_t(64) << 10;
// How long a connection closed by the server keeps reading (and dropping) what the client still sends,
// so that the client reads the answer instead of a reset (RFC 9112 section 9.6).
inline constexpr std::chrono::milliseconds kLingerTimeout{5'000};

class HttpServer {
 public:
  explicit HttpServer(HttpConfig config);
  ~HttpServer();  // stops the threads; answers in progress end undelivered
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // What a route says of itself, for a document of the routes (the server's /openapi.json).
  struct RouteInfo {
    std::string method, path;
    std::string summary;    // one line
    std::string body_type;  // the media type of the request body it reads; "" for none
  };

  // Routes match the path exactly. A GET route answers HEAD too (without the body). Add every route
  // before run().
  void route(const std::string& method, const std::string& path, Handler handler, std::string summary = "",
             std::string body_type = "");
  // Every route added, by path then method.
  std::vector<RouteInfo> routes() const;
  // Binds the listening socket; returns its port. Throws sparrow::Error if it cannot.
  int bind();
  // Serves on the calling thread and the other io threads until stop().
  void run();
  // Any thread; run() returns soon after.
  void stop();
  // Runs `task` on the worker pool.
  void post(std::function<void()> task);
  size_t open_connections() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::server::http
