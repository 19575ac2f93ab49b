// The OpenAI-compatible API of sparrow serve, on the HTTP layer of http/http_server.h:
//
//   POST /v1/chat/completions, /v1/completions   (JSON, or server-sent events with "stream": true)
//   POST /v1/responses                            (the same; OpenAI's Responses API, responses_api.cpp)
//   GET  /v1/models, /health, /ping, /version, /metrics (POST /ping too)
//   POST /tokenize, /detokenize                   (at the root, as vLLM)
//   GET  /openapi.json                            (built from the routes above: add_routes)
//
// Handlers run on the HTTP layer's worker pool: they parse, validate, render and tokenize, submit to
// the engine, and return. A completion then lives on events (Server::Completion): each engine event
// wakes it, a worker turns what has arrived into stream chunks (or, not streaming, keeps it for the one
// body at the end) and hands them to the connection, which writes them as the client takes them. A
// client that goes away ends its answer at once, and the request is aborted in the engine, which frees
// its cache blocks.
//
// Requests beyond what the engine runs at once (max_num_seqs) wait in the engine's queue, as in vLLM;
// past max_queued_requests more the answer is 503 with Retry-After. Errors are OpenAI error objects
// (api_error.h). drain() is the graceful shutdown behind SIGTERM.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "server/http/http_server.h"
#include "server/serving.h"

namespace sparrow::server {

struct ServerConfig {
  http::HttpConfig http;               // address, port, connection and request limits, access log
  std::optional<std::string> api_key;  // requests must send "Authorization: Bearer <key>"
  int64_t max_num_seqs = 64;           // what the engine runs at once (its --max-num-seqs)
  int64_t max_queued_requests = 1024;  // completions accepted beyond max_num_seqs; more get 503
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
  class Completion;

  void add_routes();
  // A handler with the API key check, its ApiErrors (and anything else) answered as error objects.
  http::Handler guarded(std::function<void(const http::Request&, const http::Responder&)> handler) const;
  void check_api_key(const http::Request& request) const;
  // A place among the completions in flight; nullptr when the queue is full. 503 while draining.
  std::shared_ptr<Completion> admit(const http::Responder& responder);
  // A completion of any endpoint: `start` parses, validates and submits the body (start_chat_completion, ...).
  using JobStart = std::unique_ptr<CompletionJob> (*)(const Json& body, ServingContext& context,
                                                      Clock::time_point arrival);
  void completion(const http::Request& request, const http::Responder& responder, JobStart start);
  Json tokenize(const http::Request& request) const;
  Json detokenize(const http::Request& request) const;
  Json models() const;
  std::string metrics() const;
  Json openapi() const;
  // Runs `task` on a worker, unless the server is being destroyed.
  void post(std::function<void()> task);

  ServingContext& context_;
  ServerConfig config_;

  // Completions in flight, for the queue limit and for drain().
  std::mutex active_mutex_;
  std::condition_variable active_changed_;
  std::set<Completion*> active_;
  bool draining_ = false;

  std::mutex http_mutex_;  // guards http_ against the engine thread's wake-ups while it is destroyed
  std::unique_ptr<http::HttpServer> http_;  // last: goes first, ending its threads before the rest goes
};

}  // namespace sparrow::server
