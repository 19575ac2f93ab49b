#include "server/pd_proxy.h"

#include <atomic>

#include <httplib.h>

#include "core/error.h"
#include "server/api_error.h"
#include "server/json_fields.h"

namespace sparrow::server {

namespace {

http::Response json_response(int status, const Json& body) { return {status, "application/json", {}, body.dump()}; }

// "http://host:port" -> an httplib client with generous timeouts (a long prefill answers late).
std::unique_ptr<httplib::Client> client_for(const std::string& url) {
  auto client = std::make_unique<httplib::Client>(url);
  client->set_connection_timeout(10);
  client->set_read_timeout(3600);
  client->set_write_timeout(600);
  return client;
}

}  // namespace

struct PdProxy::Impl {
  PdProxyConfig config;
  http::HttpServer server;
  std::atomic<uint64_t> next_prefill{0}, next_decode{0};

  explicit Impl(PdProxyConfig c) : config(std::move(c)), server(config.http) {
    SPARROW_CHECK(!config.prefill_urls.empty() && !config.decode_urls.empty(),
                  "proxy: give at least one --prefill and one --decode instance");
    for (const char* path : {"/v1/completions", "/v1/chat/completions"})
      server.route("POST", path, [this, path](const http::Request& r, const http::Responder& out) { complete(path, r, out); },
                   "a completion through a prefill and a decode instance", "application/json");
    // The decode instances' (in turn): its model list, and its counters (benchmarks read the prefix cache's there).
    for (const char* path : {"/v1/models", "/metrics"})
      server.route("GET", path, [this, path](const http::Request& r, const http::Responder& out) { forward_get(path, r, out); });
    server.route("GET", "/health", [](const http::Request&, const http::Responder& out) { out.send({200, "", {}, ""}); });
  }

  void forward_get(const std::string& path, const http::Request& request, const http::Responder& out) {
    auto client = client_for(config.decode_urls[next_decode++ % config.decode_urls.size()]);
    httplib::Headers headers;
    if (auto auth = request.verbatim_field("Authorization")) headers.emplace("Authorization", *auth);
    auto result = client->Get(path, headers);
    if (!result) return out.send(json_response(502, error_body(502, "proxy: the decode instance did not answer")));
    out.send({result->status, result->get_header_value("Content-Type"), {}, result->body});
  }

  void complete(const std::string& path, const http::Request& request, const http::Responder& out) {
    Json body;
    try {
      body = parse_json_object(request.body);
    } catch (const ApiError& e) {
      return out.send(json_response(e.status(), error_body(e)));
    }
    httplib::Headers headers;
    if (auto auth = request.verbatim_field("Authorization")) headers.emplace("Authorization", *auth);

    // 1. The prefill instance: the prompt and its first token, the cache offered.
    Json prefill = body;
    prefill["kv_transfer_params"] = {{"do_remote_decode", true}, {"do_remote_prefill", false}};
    prefill["stream"] = false;
    prefill.erase("stream_options");
    prefill["max_tokens"] = 1;
    if (prefill.contains("max_completion_tokens")) prefill["max_completion_tokens"] = 1;
    // The prefill instance draws the first token, so min_tokens' hold on end-of-sequence applies there too, at
    // most for that one token.
    if (prefill.contains("min_tokens") && prefill["min_tokens"].is_number_integer() && prefill["min_tokens"].get<int64_t>() > 1)
      prefill["min_tokens"] = 1;
    const std::string prefill_url = config.prefill_urls[next_prefill++ % config.prefill_urls.size()];
    auto prefill_client = client_for(prefill_url);
    auto first = prefill_client->Post(path, headers, prefill.dump(), "application/json");
    if (!first)
      return out.send(json_response(502, error_body(502, "proxy: the prefill instance " + prefill_url + " did not answer")));
    if (first->status != 200) return out.send({first->status, "application/json", {}, first->body});
    Json answer;
    try {
      answer = parse_json_object(first->body);
    } catch (const ApiError&) {
    }
    if (!answer.is_object() || !answer.contains("kv_transfer_params") || !answer["kv_transfer_params"].is_object())
      return out.send(json_response(502, error_body(502, "proxy: the prefill instance " + prefill_url +
                                                             " answered without kv_transfer_params (is it serving with "
                                                             "--kv-transfer-config kv_role kv_producer?)")));

    // 2. The decode instance: the client's request, with the handoff; its answer goes back as it comes.
    Json decode = std::move(body);
    decode["kv_transfer_params"] = answer["kv_transfer_params"];
    const std::string decode_url = config.decode_urls[next_decode++ % config.decode_urls.size()];
    auto decode_client = client_for(decode_url);
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.headers = headers;
    req.body = decode.dump();
    req.set_header("Content-Type", "application/json");
    int status = 0;
    bool streaming = false;
    std::string whole;
    req.response_handler = [&](const httplib::Response& res) {
      status = res.status;
      const std::string type = res.get_header_value("Content-Type");
      streaming = status == 200 && type.rfind("text/event-stream", 0) == 0;
      if (streaming) out.start_stream({200, type, {}, ""});
      return true;
    };
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      if (streaming) out.write(std::string(data, n));
      else whole.append(data, n);
      return true;
    };
    httplib::Response res;
    httplib::Error error = httplib::Error::Success;
    const bool ok = decode_client->send(req, res, error);
    if (streaming) return out.end();  // a cut stream ends as it is: the client sees no [DONE]
    if (!ok) return out.send(json_response(502, error_body(502, "proxy: the decode instance " + decode_url + " did not answer")));
    out.send({status, "application/json", {}, whole});
  }
};

PdProxy::PdProxy(PdProxyConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {}
PdProxy::~PdProxy() = default;
int PdProxy::bind() { return impl_->server.bind(); }
void PdProxy::run() { impl_->server.run(); }
void PdProxy::stop() { impl_->server.stop(); }

}  // namespace sparrow::server
