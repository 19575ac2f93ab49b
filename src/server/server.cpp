#include "server/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <cstdio>

#include "core/error.h"
#include "server/api_error.h"
#include "server/client_socket.h"
#include "server/openai_responses.h"

namespace sparrow::server {
namespace {

// How long a worker waits for the engine before it looks at its client again.
constexpr auto kClientCheckInterval = std::chrono::milliseconds(100);

void send_json(httplib::Response& res, const Json& body, int status = 200) {
  res.status = status;
  res.set_content(to_text(body), "application/json");
}

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& param = {}) {
  send_json(res, error_body(status, message, param), status);
}

// vLLM requires JSON bodies to say so (serve/utils/api_utils.py validate_json_request).
Json json_body(const httplib::Request& req) {
  std::string type = req.get_header_value("Content-Type");
  if (type.rfind("application/json", 0) != 0) bad_request("Unsupported Media Type: Only 'application/json' is allowed");
  return parse_json_object(req.body);
}

}  // namespace

// A completion in flight. It holds its place among the server's completions from before its request is
// validated until its response is written (the 503 limit counts it, drain() waits for it).
struct Server::ActiveCompletion {
  // Takes a place, or throws 503 when the server is draining or full.
  explicit ActiveCompletion(Server& server) : server(server) {
    std::lock_guard<std::mutex> lock(server.active_mutex_);
    if (server.draining_) throw ApiError(503, "the server is shutting down");
    if (int64_t(server.active_.size()) >= server.config_.max_concurrent_requests)
      throw ApiError(503, "the server is overloaded (" + std::to_string(server.config_.max_concurrent_requests) +
                              " requests in flight); retry later");
    server.active_.insert(this);
  }
  ~ActiveCompletion() {
    {
      std::lock_guard<std::mutex> lock(server.active_mutex_);
      server.active_.erase(this);
    }
    server.active_changed_.notify_all();
    // Then `job` goes, aborting in the engine whatever still runs.
  }
  void start(std::unique_ptr<CompletionJob> started, ClientSocket socket) {
    std::lock_guard<std::mutex> lock(server.active_mutex_);  // drain() reads `job`
    job = std::move(started);
    client = socket;
  }

  Server& server;
  std::unique_ptr<CompletionJob> job;  // set once the request is submitted
  ClientSocket client;
  bool started = false;
};

Server::Server(ServingContext& context, ServerConfig config)
    : context_(context), config_(std::move(config)), http_(std::make_unique<httplib::Server>()) {
  // Every connection holds a worker while its completion streams: size the pool for the allowed
  // completions plus room for /health, /metrics and the 503 answers beyond the limit.
  size_t workers = size_t(config_.max_concurrent_requests) + 16;
  http_->new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  http_->set_payload_max_length(config_.max_body_bytes);
  http_->set_keep_alive_timeout(5);
  // Debian's cpp-httplib is built with a listen backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG): a burst of
  // more new connections than that (a benchmark opening 64 or 256 streams at once) overflows the accept
  // queue, and some of those clients see their connection reset. The listening socket is kept here
  // so bind() can raise its backlog to the system's limit.
  http_->set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_socket_ = sock;
  });
  add_routes();
}

Server::~Server() = default;

int Server::bind() {
  int port = config_.port;
  if (port == 0)
    port = http_->bind_to_any_port(config_.host);
  else if (!http_->bind_to_port(config_.host, port))
    port = -1;
  SPARROW_CHECK(port > 0, "cannot listen on ", config_.host, ":", config_.port,
                " (address in use, or not an address of this machine)");
  if (listen_socket_ >= 0) ::listen(listen_socket_, SOMAXCONN);  // listen() again only resizes the queue
  return port;
}

void Server::listen() { http_->listen_after_bind(); }

void Server::stop() { http_->stop(); }

void Server::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(active_mutex_);
  draining_ = true;
  if (!active_changed_.wait_for(lock, timeout, [&] { return active_.empty(); })) {
    for (ActiveCompletion* active : active_)
      if (active->job) active->job->generation().abort();
    // The aborted requests end at the engine's next step; their workers then write the final chunk.
    active_changed_.wait_for(lock, std::chrono::seconds(10), [&] { return active_.empty(); });
  }
  lock.unlock();
  stop();
}

void Server::guarded(const httplib::Request& req, httplib::Response& res,
                     const std::function<void(const httplib::Request&, httplib::Response&)>& handler) const {
  try {
    check_api_key(req);
    handler(req, res);
  } catch (const ApiError& e) {
    send_error(res, e.status(), e.what(), e.param());
  } catch (const Error& e) {  // the engine, tokenizer or template refusing user input
    send_error(res, 400, e.what());
  } catch (const std::exception& e) {
    send_error(res, 500, std::string("internal error: ") + e.what());
  }
}

void Server::check_api_key(const httplib::Request& req) const {
  if (!config_.api_key || req.path == "/health" || req.path == "/metrics") return;
  if (req.get_header_value("Authorization") != "Bearer " + *config_.api_key)
    throw ApiError(401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)");
}

void Server::add_routes() {
  auto route = [this](auto handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) { guarded(req, res, handler); };
  };
  http_->Post("/v1/chat/completions", route([this](const auto& req, auto& res) { completion(req, res, true); }));
  http_->Post("/v1/completions", route([this](const auto& req, auto& res) { completion(req, res, false); }));
  http_->Post("/tokenize", route([this](const auto& req, auto& res) { tokenize(req, res); }));
  http_->Post("/detokenize", route([this](const auto& req, auto& res) { detokenize(req, res); }));
  http_->Get("/v1/models", route([this](const auto&, auto& res) { models(res); }));
  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(active_mutex_);
    res.status = draining_ ? 503 : 200;
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    Engine::Stats s = context_.engine.stats();
    EngineGauges gauges{s.running,
                        s.waiting,
                        s.kv_blocks_used,
                        s.kv_blocks_total,
                        s.prefix_queries,
                        s.prefix_hits,
                        s.preemptions,
                        s.prompt_tokens_total,
                        s.generation_tokens_total,
                        {s.decode_steps.steps, s.decode_steps.seconds, s.decode_steps.forward_seconds},
                        {s.prefill_steps.steps, s.prefill_steps.seconds, s.prefill_steps.forward_seconds}};
    res.set_content(context_.metrics.render(gauges), "text/plain; version=0.0.4; charset=utf-8");
  });

  // What httplib answers by itself (unknown route, body too large) gets an OpenAI error body too.
  http_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404)
      send_error(res, 404, "Not Found: " + req.method + " " + req.path);
    else if (res.status == 413)
      send_error(res, 413, "the request body is too large");
    else
      send_error(res, res.status, "HTTP error " + std::to_string(res.status));
  });
  http_->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    send_error(res, 500, "internal error");
  });
  if (config_.log_requests)
    http_->set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "%s %s %s %d\n", req.remote_addr.c_str(), req.method.c_str(), req.path.c_str(), res.status);
    });
}

void Server::completion(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto arrival = Clock::now();
  auto active = std::make_shared<ActiveCompletion>(*this);
  Json body = json_body(req);
  active->start(chat ? start_chat_completion(body, context_, arrival) : start_text_completion(body, context_, arrival),
                ClientSocket(req.local_addr, req.local_port, req.remote_addr, req.remote_port));
  // Non-streamed bodies go out through the same provider, so that the worker watches the client while
  // it waits.
  bool stream = active->job->streaming();
  res.set_chunked_content_provider(
      stream ? "text/event-stream" : "application/json",
      [this, active](size_t, httplib::DataSink& sink) { return pump(*active, sink); },
      [active](bool completed) {
        if (!completed) active->job->generation().abort();  // the client went away
      });
}

bool Server::pump(ActiveCompletion& active, httplib::DataSink& sink) {
  CompletionJob& job = *active.job;
  Generation& generation = job.generation();
  auto write = [&](const std::string& bytes) { return bytes.empty() || sink.write(bytes.data(), bytes.size()); };
  if (!active.started) {  // the headers (and the role chunks) go out at once
    active.started = true;
    return write(job.streaming() ? job.stream_start() : "");
  }
  if (active.client.closed()) return false;  // httplib then calls the releaser, which aborts
  std::string out;
  for (auto event = generation.next(kClientCheckInterval); event; event = generation.next(std::chrono::milliseconds(0)))
    out += job.on_event(*event);  // whatever has arrived goes out in one write
  if (generation.finished()) {
    out += job.streaming() ? job.stream_end() : to_text(job.response());
    bool written = write(out);
    sink.done();
    return written;
  }
  return write(out);
}

void Server::tokenize(const httplib::Request& req, httplib::Response& res) {
  Json body = json_body(req);
  Fields f(body);
  context_.check_model(f.string("model").value_or(""));
  const Tokenizer& tokenizer = context_.require_tokenizer();
  std::vector<int32_t> ids;
  if (f.has("messages")) {  // the chat form: render first (the template writes any BOS)
    if (!context_.chat_template) bad_request("the served model has no chat template", "messages");
    Json input = Json::object();
    for (const char* key :
         {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents"})
      if (f.has(key)) input[key] = body[key];
    ids = tokenizer.encode(context_.chat_template->render(input));
  } else {
    auto prompt = f.string("prompt");
    if (!prompt) bad_request("`prompt` (a string) or `messages` is required", "prompt");
    if (f.boolean("add_special_tokens").value_or(true) && context_.options.prepend_bos && tokenizer.bos_id())
      ids.push_back(*tokenizer.bos_id());
    std::vector<int32_t> encoded = tokenizer.encode(*prompt);
    ids.insert(ids.end(), encoded.begin(), encoded.end());
  }
  Json out = {{"count", ids.size()}, {"max_model_len", context_.engine.max_model_len()}, {"tokens", ids}};
  if (f.boolean("return_token_strs").value_or(false)) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(tokenizer.id_to_token(id).value_or(""));
    out["token_strs"] = std::move(strs);
  }
  send_json(res, out);
}

void Server::detokenize(const httplib::Request& req, httplib::Response& res) {
  Json body = json_body(req);
  Fields f(body);
  context_.check_model(f.string("model").value_or(""));
  auto tokens = f.integers("tokens");
  if (!tokens) bad_request("`tokens` (a list of token ids) is required", "tokens");
  std::vector<int32_t> ids;
  for (int64_t id : *tokens) {
    if (id < 0 || id >= context_.engine.model().vocab_size()) f.invalid("tokens", "holds an id outside the vocabulary");
    ids.push_back(int32_t(id));
  }
  send_json(res, {{"prompt", context_.require_tokenizer().decode(ids)}});
}

void Server::models(httplib::Response& res) const {
  Json data = Json::array();
  int64_t created = unix_time();
  for (const std::string& name : context_.options.served_model_names)
    data.push_back({{"id", name},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "sparrow"},
                    {"root", context_.options.model_path},
                    {"parent", nullptr},
                    {"max_model_len", context_.engine.max_model_len()}});
  send_json(res, {{"object", "list"}, {"data", std::move(data)}});
}

}  // namespace sparrow::server
