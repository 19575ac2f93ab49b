#include "server/server.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "core/error.h"
#include "server/api_error.h"
#include "server/openai_responses.h"

namespace sparrow::server {
namespace {

http::Response json_response(const Json& body, int status = 200) {
  return http::Response{status, "application/json", {}, to_text(body)};
}

http::Response error_response(int status, const std::string& message, const std::string& param = {}) {
  return json_response(error_body(status, message, param), status);
}

// vLLM requires JSON bodies to say so (serve/utils/api_utils.py validate_json_request).
Json json_body(const http::Request& request) {
  if (request.field("Content-Type").rfind("application/json", 0) != 0)
    bad_request("Unsupported Media Type: Only 'application/json' is allowed");
  return parse_json_object(request.body);
}

// Compares in a time that depends on the expected value's length only, so that a client cannot find
// the key byte by byte from how long a refusal takes.
bool same_secret(const std::string& given, const std::string& expected) {
  unsigned char difference = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    difference |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  return difference == 0;
}

// How long a client refused for a full queue is told to wait (RFC 9110 section 10.2.3).
constexpr const char* kRetryAfterSeconds = "1";

}  // namespace

// A completion from its admission to the end of its answer. It holds its place among the server's
// completions (the queue limit counts it, drain() waits for it) until it is destroyed: once its answer
// is written or its client has gone, and no worker is still working on it.
//
// Each engine event wakes it (on the engine's thread); a worker then drains the events that have
// arrived into bytes for the connection. Wakes that come while a worker drains are folded into that
// worker's next round, so one completion never has two workers.
class Server::Completion : public std::enable_shared_from_this<Completion> {
 public:
  Completion(Server& server, http::Responder responder) : server_(server), responder_(std::move(responder)) {}

  ~Completion() {
    {
      std::lock_guard<std::mutex> lock(server_.active_mutex_);
      server_.active_.erase(this);
    }
    server_.active_changed_.notify_all();
    // Then `job_` goes, aborting in the engine whatever still runs.
  }

  void start(std::unique_ptr<CompletionJob> job) {
    {
      std::lock_guard<std::mutex> lock(server_.active_mutex_);  // drain() reads job_
      job_ = std::move(job);
    }
    // The answer's end: when the client went away first, the engine stops the request at its next
    // step. The callback holds this completion until the answer has ended.
    responder_.on_done([self = shared_from_this()](bool delivered) {
      if (!delivered) self->job_->generation().abort();
    });
    std::weak_ptr<Completion> weak = shared_from_this();
    job_->generation().set_wake([weak] {
      if (auto self = weak.lock()) self->wake();
    });
    wake();  // the head (and a stream's first chunks) go out at once
  }

  // Drain() of the server reads this under the active mutex.
  CompletionJob* job() const { return job_.get(); }

 private:
  void wake() {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      if (draining_) {
        wake_again_ = true;
        return;
      }
      draining_ = true;
    }
    server_.post([self = shared_from_this()] { self->drain(); });
  }

  void drain() {
    for (;;) {
      try {
        produce();
      } catch (const std::exception& e) {  // a bug in turning events into chunks: end the answer, not the server
        fail(e.what());
      }
      std::lock_guard<std::mutex> lock(wake_mutex_);
      if (!wake_again_) {
        draining_ = false;
        return;
      }
      wake_again_ = false;
    }
  }

  void produce() {
    if (answered_) return;
    CompletionJob& job = *job_;
    Generation& generation = job.generation();
    if (!started_) {
      started_ = true;
      if (job.streaming()) responder_.start_stream({200, "text/event-stream", {}, job.stream_start(), job.id()});
    }
    std::string out;
    while (std::optional<Generation::Event> event = generation.next()) out += job.on_event(*event);
    if (generation.finished()) {
      // answered_ is set once the job has made its last bytes: if making them throws, fail() answers.
      if (job.streaming()) {
        out += job.stream_end();
        answered_ = true;
        responder_.write(std::move(out));
        responder_.end();
      } else {
        Json body = job.response();
        // An error object's code is its status (a Responses object's "error" is null when it succeeded).
        const bool error = body.contains("error") && body["error"].is_object();
        int status = error ? body["error"]["code"].get<int>() : 200;
        http::Response response = json_response(body, status);
        response.log_id = job.id();
        answered_ = true;
        responder_.send(std::move(response));
      }
    } else if (job.streaming()) {
      responder_.write(std::move(out));
    }
  }

  void fail(const std::string& what) {
    if (answered_) return;
    answered_ = true;
    job_->generation().abort();
    Json error = error_body(500, "internal error: " + what);
    if (started_ && job_->streaming()) {
      responder_.write(sse_event(error) + kStreamEnd);
      responder_.end();
    } else {
      responder_.send(json_response(error, 500));
    }
  }

  Server& server_;
  const http::Responder responder_;
  std::unique_ptr<CompletionJob> job_;  // set by start()
  bool started_ = false, answered_ = false;  // touched by the draining worker only
  std::mutex wake_mutex_;
  bool draining_ = false, wake_again_ = false;
};

Server::Server(ServingContext& context, ServerConfig config) : context_(context), config_(std::move(config)) {
  config_.http.error_response = [](int status, const std::string& message) { return error_response(status, message); };
  http_ = std::make_unique<http::HttpServer>(config_.http);
  add_routes();
}

Server::~Server() {
  std::unique_ptr<http::HttpServer> http;
  {
    std::lock_guard<std::mutex> lock(http_mutex_);
    http = std::move(http_);
  }
  http.reset();  // outside the lock: its workers may still wake completions, which then post nothing
}

int Server::bind() { return http_->bind(); }

void Server::listen() { http_->run(); }

void Server::stop() { http_->stop(); }

void Server::post(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(http_mutex_);
  if (http_) http_->post(std::move(task));
}

void Server::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(active_mutex_);
  draining_ = true;
  if (!active_changed_.wait_for(lock, timeout, [&] { return active_.empty(); })) {
    for (Completion* active : active_)
      if (CompletionJob* job = active->job()) job->generation().abort();
    // The aborted requests end at the engine's next step; then their last chunks are written.
    active_changed_.wait_for(lock, std::chrono::seconds(10), [&] { return active_.empty(); });
  }
  lock.unlock();
  stop();
}

http::Handler Server::guarded(std::function<void(const http::Request&, const http::Responder&)> handler) const {
  return [this, handler = std::move(handler)](const http::Request& request, const http::Responder& responder) {
    try {
      check_api_key(request);
      handler(request, responder);
    } catch (const ApiError& e) {
      responder.send(error_response(e.status(), e.what(), e.param()));
    } catch (const Error& e) {  // the engine, tokenizer or template refusing user input
      responder.send(error_response(400, e.what()));
    } catch (const std::exception& e) {
      responder.send(error_response(500, std::string("internal error: ") + e.what()));
    }
  };
}

void Server::check_api_key(const http::Request& request) const {
  // The probes load balancers and orchestrators send without credentials stay open, as in vLLM.
  if (!config_.api_key || request.path == "/health" || request.path == "/ping" || request.path == "/version" ||
      request.path == "/metrics")
    return;
  // The field exactly as sent: "Bearer KEY " with a trailing space is not the key (http_message.h).
  std::optional<std::string> given = request.verbatim_field("Authorization");
  if (!given || !same_secret(*given, "Bearer " + *config_.api_key))
    throw ApiError(401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)");
}

void Server::add_routes() {
  auto json_route = [this](auto handler) {
    return guarded([handler](const http::Request& request, const http::Responder& responder) {
      responder.send(json_response(handler(request)));
    });
  };
  const std::string json = "application/json";  // the media type of the bodies the POST routes read
  auto completion_route = [this](JobStart start) {
    return guarded([this, start](const auto& request, const auto& responder) { completion(request, responder, start); });
  };
  http_->route("POST", "/v1/chat/completions", completion_route(start_chat_completion),
               "Create a chat completion (streamed as server-sent events with \"stream\": true)", json);
  http_->route("POST", "/v1/completions", completion_route(start_text_completion),
               "Create a text completion (streamed as server-sent events with \"stream\": true)", json);
  http_->route("POST", "/v1/responses", completion_route(start_responses),
               "Create a model response (OpenAI's Responses API; streamed as server-sent events with \"stream\": true)",
               json);
  http_->route("POST", "/tokenize", json_route([this](const auto& request) { return tokenize(request); }),
               "Tokenize a prompt or chat messages", json);
  http_->route("POST", "/detokenize", json_route([this](const auto& request) { return detokenize(request); }),
               "Turn token ids back into text", json);
  http_->route("GET", "/v1/models", json_route([this](const auto&) { return models(); }), "List the served model");
  if (context_.options.runtime_lora_updating) {
    // vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the body names the adapter; the answer is
    // one line of text, as vLLM's.
    auto lora_route = [this](bool load) {
      return guarded([this, load](const http::Request& request, const http::Responder& responder) {
        Json body = json_body(request);
        Fields f(body);
        const std::string name = f.string("lora_name").value_or("");
        if (load) {
          context_.load_lora_adapter(name, f.string("lora_path").value_or(""));
          responder.send({200, "text/plain", {}, "Success: LoRA adapter '" + name + "' added successfully."});
        } else {
          context_.unload_lora_adapter(name);
          responder.send({200, "text/plain", {}, "Success: LoRA adapter '" + name + "' removed successfully."});
        }
      });
    };
    http_->route("POST", "/v1/load_lora_adapter", lora_route(true), "Load a LoRA adapter (docs/lora.md)", json);
    http_->route("POST", "/v1/unload_lora_adapter", lora_route(false), "Unload a LoRA adapter (docs/lora.md)", json);
  }
  // /health, and vLLM's /ping (GET or POST, the SageMaker probe): 200 while serving, 503 while draining.
  auto health = [this](const http::Request&, const http::Responder& responder) {
    std::lock_guard<std::mutex> lock(active_mutex_);
    responder.send({draining_ ? 503 : 200, "", {}, ""});
  };
  http_->route("GET", "/health", health, "Health check: 200 while serving, 503 while draining");
  http_->route("GET", "/ping", health, "Health check (SageMaker's probe): the same as /health");
  http_->route("POST", "/ping", health, "Health check (SageMaker's probe): the same as /health");
  http_->route("GET", "/version", json_route([](const auto&) { return Json{{"version", SPARROW_VERSION}}; }),
               "The server's version");
  http_->route("GET", "/metrics", [this](const http::Request&, const http::Responder& responder) {
    responder.send({200, "text/plain; version=0.0.4; charset=utf-8", {}, metrics()});
  }, "Prometheus metrics");
  // Open, as FastAPI's is in vLLM (its API key guards /v1 only). Built from the HTTP layer's own table
  // on each request, so that it lists exactly what is served.
  http_->route("GET", "/openapi.json", [this](const http::Request&, const http::Responder& responder) {
    responder.send(json_response(openapi()));
  }, "This OpenAPI document");
}

// An OpenAPI 3.1 document of the routes the HTTP layer serves (HttpServer::routes): each path's
// methods with their one-line summary, and the POST routes' request bodies as JSON objects.
Json Server::openapi() const {
  Json paths = Json::object();
  for (const http::HttpServer::RouteInfo& route : http_->routes()) {
    std::string method = route.method;
    std::transform(method.begin(), method.end(), method.begin(), [](unsigned char c) { return std::tolower(c); });
    Json operation = {{"summary", route.summary},
                      {"responses", {{"200", {{"description", "Successful Response"}}}}}};
    if (!route.body_type.empty())
      operation["requestBody"] = {{"required", true}, {"content", {{route.body_type, {{"schema", {{"type", "object"}}}}}}}};
    paths[route.path][method] = std::move(operation);
  }
  return {{"openapi", "3.1.0"},
          {"info", {{"title", "sparrow"}, {"version", SPARROW_VERSION}}},
          {"paths", std::move(paths)}};
}

std::shared_ptr<Server::Completion> Server::admit(const http::Responder& responder) {
  std::lock_guard<std::mutex> lock(active_mutex_);
  if (draining_) throw ApiError(503, "the server is shutting down");
  if (int64_t(active_.size()) >= config_.max_num_seqs + config_.max_queued_requests) return nullptr;
  auto completion = std::make_shared<Completion>(*this, responder);
  active_.insert(completion.get());
  return completion;
}

void Server::completion(const http::Request& request, const http::Responder& responder, JobStart start) {
  std::shared_ptr<Completion> completion = admit(responder);
  if (!completion) {
    http::Response busy =
        error_response(503, "the server is overloaded: " + std::to_string(config_.max_queued_requests) +
                                " requests already wait for the engine (--max-queued-requests); retry later");
    busy.fields.emplace_back("Retry-After", kRetryAfterSeconds);
    responder.send(std::move(busy));
    return;
  }
  Json body = json_body(request);
  // vLLM's base request id (serving_engine.py _base_request_id): the client's X-Request-Id header, before
  // the body's request_id; the response id is then "chatcmpl-" / "cmpl-" / "resp_" and it.
  if (std::string given = request.field("X-Request-Id"); !given.empty() && given == request.id)
    body["request_id"] = given;
  completion->start(start(body, context_, request.received));
}

Json Server::tokenize(const http::Request& request) const {
  Json body = json_body(request);
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
    ids = f.boolean("add_special_tokens").value_or(true) ? tokenizer.encode_with_special_tokens(*prompt)
                                                         : tokenizer.encode(*prompt);
  }
  Json out = {{"count", ids.size()}, {"max_model_len", context_.engine.max_model_len()}, {"tokens", ids}};
  if (f.boolean("return_token_strs").value_or(false)) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(tokenizer.id_to_token(id).value_or(""));
    out["token_strs"] = std::move(strs);
  }
  return out;
}

Json Server::detokenize(const http::Request& request) const {
  Json body = json_body(request);
  Fields f(body);
  context_.check_model(f.string("model").value_or(""));
  auto tokens = f.integers("tokens");
  if (!tokens) bad_request("`tokens` (a list of token ids) is required", "tokens");
  std::vector<int32_t> ids;
  for (int64_t id : *tokens) {
    if (id < 0 || id >= context_.engine.model().vocab_size()) f.invalid("tokens", "holds an id outside the vocabulary");
    ids.push_back(int32_t(id));
  }
  return {{"prompt", context_.require_tokenizer().decode(ids)}};
}

Json Server::models() const {
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
  // LoRA adapters as vLLM lists them: root the adapter's folder, parent the base model's name.
  for (const auto& adapter : context_.lora_adapters())
    data.push_back({{"id", adapter->name},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "sparrow"},
                    {"root", adapter->path},
                    {"parent", context_.model_name()},
                    {"max_model_len", context_.engine.max_model_len()}});
  return {{"object", "list"}, {"data", std::move(data)}};
}

std::string Server::metrics() const {
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
                      {s.prefill_steps.steps, s.prefill_steps.seconds, s.prefill_steps.forward_seconds},
                      s.iteration_tokens.steps_by_log2,
                      s.iteration_tokens.tokens,
                      s.requests_by_group,
                      context_.engine.config().speculative.enabled(),
                      s.spec_decode.drafts,
                      s.spec_decode.draft_tokens,
                      s.spec_decode.accepted_tokens,
                      s.spec_decode.accepted_by_position,
                      s.mm_cache_queries,
                      s.mm_cache_hits,
                      s.encoder_seconds,
                      context_.engine.config().kv_transfer.agent != nullptr,
                      s.kv_transfer.offers,
                      s.kv_transfer.offers_fetched,
                      s.kv_transfer.offers_failed,
                      s.kv_transfer.fetches,
                      s.kv_transfer.fetches_failed,
                      s.kv_transfer.regions,
                      s.kv_transfer.bytes,
                      s.kv_transfer.fetch_seconds};
  const int64_t k = context_.engine.config().speculative.num_speculative_tokens;
  gauges.spec_accepted_by_position.resize(size_t(std::max<int64_t>(k, int64_t(s.spec_decode.accepted_by_position.size()))));
  return context_.metrics.render(gauges);
}

}  // namespace sparrow::server
