// The HTTP front of sparrow serve: an OpenAI-compatible API over cpp-httplib.
//
//   POST /v1/chat/completions, /v1/completions   (JSON, or server-sent events with "stream": true)
//   GET  /v1/models, /health, /metrics
//   POST /tokenize, /detokenize                   (at the root, as vLLM)
//
// Each connection is served by one worker thread of a pool; a completion's worker pulls the engine's
// events from its Generation and writes them out as they come (httplib's chunked content provider,
// also for non-streamed bodies). Between events it checks its client's socket (client_socket.h): a
// client that went away has its request aborted in the engine, which frees its cache blocks.
//
// Errors are OpenAI error objects (api_error.h): 400 bad request, 401 wrong API key, 404 unknown model
// or route, 413 body too large, 503 overloaded (more than max_concurrent_requests completions in flight)
// or shutting down. drain() is the graceful shutdown behind SIGTERM.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "server/serving.h"

namespace httplib {
class Server;
class DataSink;
struct Request;
struct Response;
}  // namespace httplib

namespace sparrow::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;                     // 0: any free port (bind() returns it)
  std::optional<std::string> api_key;  // requests must send "Authorization: Bearer <key>"
  size_t max_body_bytes = size_t(32) << 20;
  int64_t max_concurrent_requests = 256;  // completions in flight; more get 503
  bool log_requests = true;
};

class Server {
 public:
  Server(ServingContext& context, ServerConfig config);
  ~Server();

  // Binds the listening socket; returns the port. Throws sparrow::Error if it cannot.
  int bind();
  // Serves until stop() (or the end of drain()).
  void listen();
  // Graceful shutdown: new requests get 503, completions in flight may finish within `timeout`, the
  // rest are aborted (their clients get finish_reason "abort"), then the server stops.
  void drain(std::chrono::milliseconds timeout);
  void stop();

 private:
  struct ActiveCompletion;
  class InFlightSlot;

  void add_routes();
  // Runs a handler, turning ApiError (and anything else) into an error response.
  void guarded(const httplib::Request& req, httplib::Response& res,
               const std::function<void(const httplib::Request&, httplib::Response&)>& handler) const;
  void check_api_key(const httplib::Request& req) const;
  void completion(const httplib::Request& req, httplib::Response& res, bool chat);
  bool pump(ActiveCompletion& active, httplib::DataSink& sink);
  void tokenize(const httplib::Request& req, httplib::Response& res);
  void detokenize(const httplib::Request& req, httplib::Response& res);
  void models(httplib::Response& res) const;

  ServingContext& context_;
  ServerConfig config_;
  std::unique_ptr<httplib::Server> http_;
  int listen_socket_ = -1;  // the bound socket (a POSIX descriptor), whose accept queue bind() enlarges

  // Completions in flight, for the 503 limit and for drain().
  std::mutex active_mutex_;
  std::condition_variable active_changed_;
  std::set<ActiveCompletion*> active_;
  bool draining_ = false;
};

}  // namespace sparrow::server
