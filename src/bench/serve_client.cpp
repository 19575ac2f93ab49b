#include "bench/serve_client.h"

#include <httplib.h>

#include "core/error.h"

namespace sparrow::bench {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The message of an OpenAI error body ({"error": {"message": ...}}), else the body itself, cut short.
std::string error_message(const std::string& body) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error")) {
    const auto& e = j["error"];
    if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"].get<std::string>();
    return e.is_string() ? e.get<std::string>() : e.dump();
  }
  std::string text = body.substr(0, 300);
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return text;
}

}  // namespace

BaseUrl parse_base_url(const std::string& url) {
  const size_t scheme_end = url.find("://");
  const std::string scheme = scheme_end == std::string::npos ? "" : url.substr(0, scheme_end);
  SPARROW_CHECK(scheme == "http" || scheme == "https", "--base-url '", url,
                "' must start with http:// or https://");
  const size_t path = url.find('/', scheme_end + 3);
  BaseUrl out{url.substr(0, path), path == std::string::npos ? "" : url.substr(path)};
  SPARROW_CHECK(out.origin.size() > scheme_end + 3, "--base-url '", url, "' has no host");
  while (!out.prefix.empty() && out.prefix.back() == '/') out.prefix.pop_back();
  return out;
}

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (char c : bytes) {
    if (c != '\n') {
      line_ += c;
      continue;
    }
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (line_.empty()) {  // a blank line ends the event
      if (has_data_) events.push_back(std::move(data_));
      data_.clear();
      has_data_ = false;
    } else if (line_.rfind("data:", 0) == 0) {
      std::string_view value = std::string_view(line_).substr(5);
      if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
      if (has_data_) data_ += '\n';
      data_ += value;
      has_data_ = true;
    }  // comments (":...") and other fields (event:, id:, retry:) carry nothing we time
    line_.clear();
  }
  return events;
}

ChunkInfo read_chunk(const std::string& data, bool chat) {
  ChunkInfo info;
  if (data == "[DONE]") {
    info.done = true;
    return info;
  }
  nlohmann::json j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    info.error = "not a JSON chunk: " + data.substr(0, 200);
    return info;
  }
  if (j.contains("error")) {
    info.error = error_message(data);
    return info;
  }
  // A chunk is one step's tokens even when their text is empty (held back by the detokenizer, or ids a
  // dummy model's tokenizer has no text for): servers stream a chunk per step that made tokens, and
  // vLLM's bench client times every chunk with a choice. Only a chat stream's opening role chunk is
  // not a token: sparrow sends it before the first token.
  auto add_text = [&](const nlohmann::json& v) {
    if (v.is_string()) {
      info.text += v.get_ref<const std::string&>();
      info.output = true;
    }
  };
  if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
    const nlohmann::json& choice = j["choices"][0];
    if (!chat) {
      if (choice.contains("text")) add_text(choice["text"]);
    } else if (choice.contains("delta") && choice["delta"].is_object() && !choice["delta"].contains("role")) {
      const nlohmann::json& delta = choice["delta"];
      for (const char* key : {"content", "reasoning_content", "reasoning"})
        if (delta.contains(key)) add_text(delta[key]);
      if (delta.contains("tool_calls") && delta["tool_calls"].is_array())
        for (const nlohmann::json& call : delta["tool_calls"]) {
          info.output = true;
          if (call.contains("function") && call["function"].is_object() && call["function"].contains("arguments"))
            add_text(call["function"]["arguments"]);
        }
    }
  }
  if (j.contains("usage") && j["usage"].is_object()) {
    const nlohmann::json& usage = j["usage"];
    if (usage.contains("prompt_tokens") && usage["prompt_tokens"].is_number_integer())
      info.prompt_tokens = usage["prompt_tokens"].get<int64_t>();
    if (usage.contains("completion_tokens") && usage["completion_tokens"].is_number_integer())
      info.completion_tokens = usage["completion_tokens"].get<int64_t>();
  }
  return info;
}

ServeConnection::ServeConnection(const BaseUrl& url, std::string api_key)
    : url_(url), api_key_(std::move(api_key)), client_(std::make_unique<httplib::Client>(url.origin)) {
  client_->set_connection_timeout(30);
  client_->set_read_timeout(3600);  // between two reads: a long prefill sends nothing for a while
  client_->set_write_timeout(600);
  client_->set_keep_alive(true);    // an agentic session's turns reuse one connection
}

ServeConnection::~ServeConnection() = default;

RequestResult ServeConnection::stream(const std::string& path, const std::string& body, bool chat,
                                      Clock::time_point bench_start, const Tokenizer* tokenizer) {
  RequestResult r;
  httplib::Request req;
  req.method = "POST";
  req.path = url_.prefix + path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  if (!api_key_.empty()) req.set_header("Authorization", "Bearer " + api_key_);

  int status = 0;
  std::string error_body, stream_error, text;
  SseParser sse;
  bool done = false, got_output = false;
  int64_t chunks = 0;
  std::optional<int64_t> prompt_tokens, completion_tokens;
  Clock::time_point last;
  const Clock::time_point sent = Clock::now();
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();  // every event in this read arrived now
    if (status != 200) {
      if (error_body.size() < 65536) error_body.append(data, n);
      return true;
    }
    for (const std::string& event : sse.feed({data, n})) {
      ChunkInfo c = read_chunk(event, chat);
      done = done || c.done;
      if (!c.error.empty() && stream_error.empty()) stream_error = c.error;
      if (c.prompt_tokens) prompt_tokens = c.prompt_tokens;
      if (c.completion_tokens) completion_tokens = c.completion_tokens;
      if (!c.output) continue;
      if (got_output)
        r.itl.push_back(seconds(now - last));
      else
        r.ttft = seconds(now - sent);
      got_output = true;
      last = now;
      ++chunks;
      text += c.text;
    }
    return true;
  };
  r.start_time = seconds(sent - bench_start);
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool ok = client_->send(req, res, error);
  r.latency = seconds(Clock::now() - sent);

  if (!ok)
    r.error = "connection error: " + httplib::to_string(error);
  else if (status != 200)
    r.error = "HTTP " + std::to_string(status) + ": " + error_message(error_body.empty() ? res.body : error_body);
  else if (!stream_error.empty())
    r.error = stream_error;
  else if (!done)
    r.error = "the stream ended before [DONE]";
  else if (!got_output)
    r.error = "no output token received";
  r.success = r.error.empty();
  if (!r.success) {
    r.ttft = 0;
    r.itl.clear();
  }
  r.prompt_len = prompt_tokens.value_or(-1);
  r.output_len = completion_tokens ? *completion_tokens
                 : tokenizer       ? int64_t(tokenizer->encode(text).size())
                                   : chunks;
  return r;
}

std::optional<std::string> ServeConnection::get(const std::string& path, std::string* error) {
  httplib::Headers headers;
  if (!api_key_.empty()) headers.emplace("Authorization", "Bearer " + api_key_);
  httplib::Result res = client_->Get((url_.prefix + path).c_str(), headers);
  std::string why;
  if (!res)
    why = httplib::to_string(res.error());
  else if (res->status != 200)
    why = "HTTP " + std::to_string(res->status) + ": " + error_message(res->body);
  else
    return res->body;
  if (error) *error = why;
  return std::nullopt;
}

}  // namespace sparrow::bench
