// The only translation unit that includes Boost.Asio and Boost.Beast (slow to compile): everything else
// sees http_server.h. Beast is used for its request parser alone; responses are framed by
// http_message.h, reads, writes and deadlines are Asio's.
#define BOOST_BEAST_USE_STD_STRING_VIEW
#include "server/http/http_server.h"

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "server/http/connection_table.h"

namespace sparrow::server::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using State = ConnectionTable::State;

namespace {

constexpr size_t kReadSize = size_t(16) << 10;

Response plain_text_error(int status, const std::string& message) {
  return Response{status, "text/plain; charset=utf-8", {}, message + "\n"};
}

// The request's id: the client's X-Request-Id (as vLLM's RequestId middleware takes it) when it is
// 1-128 visible ASCII characters, so that it is one word in the log; else 32 random hex digits.
std::string request_id(const Request& request) {
  std::string given = request.field("X-Request-Id");
  if (!given.empty() && given.size() <= 128 &&
      std::all_of(given.begin(), given.end(), [](char c) { return c > 0x20 && c < 0x7f; }))
    return given;
  thread_local std::mt19937_64 random{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(32, '0');
  for (size_t i = 0; i < id.size(); i += 16)
    for (uint64_t bits = random(), j = 0; j < 16; ++j, bits >>= 4) id[i + j] = kHex[bits & 15];
  return id;
}

}  // namespace

class Connection;

struct HttpServer::Impl {
  explicit Impl(HttpConfig config_)
      : config(std::move(config_)), table(config.max_connections), workers(worker_count(config.worker_threads)) {}

  static size_t worker_count(int asked) {
    if (asked > 0) return size_t(asked);
    return std::clamp<size_t>(std::thread::hardware_concurrency(), 4, 16);
  }

  const HttpConfig config;
  ConnectionTable table;
  std::map<std::string, std::map<std::string, Handler>> routes;  // path -> method -> handler
  std::vector<HttpServer::RouteInfo> route_infos;  // the same routes described, in the order added
  std::mutex live_mutex;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> live;  // every open connection, which it keeps alive
  std::atomic<uint64_t> next_id{1};
  asio::thread_pool workers;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};

  void accept();
  void admit(tcp::socket socket);
  void forget(uint64_t id) {
    std::lock_guard<std::mutex> lock(live_mutex);
    live.erase(id);
  }
  Response error(int status, const std::string& message) const {
    return config.error_response ? config.error_response(status, message) : plain_text_error(status, message);
  }
  // The route for a request, or nullptr; then `allowed` lists the path's methods ("" for an unknown path).
  const Handler* find_route(const std::string& method, const std::string& path, std::string& allowed) const;
  // One access-log line. `status` 0: no answer was begun; `latency_ms` < 0: not timed (a request
  // refused before it was read), as is an empty `id`.
  void log(const std::string& remote, const std::string& method, const std::string& path, int status,
           double latency_ms = -1, const std::string& id = "", const char* note = "") const {
    if (!config.log_requests) return;
    std::string status_text = status > 0 ? std::to_string(status) : "-";
    char latency[32] = "-";
    if (latency_ms >= 0) std::snprintf(latency, sizeof latency, "%.1fms", latency_ms);
    std::fprintf(stderr, "%s %s %s %s %s %s%s\n", remote.c_str(), method.c_str(), path.c_str(), status_text.c_str(),
                 latency, id.empty() ? "-" : id.c_str(), note);
  }
};

// One request's answer, shared by its connection and its handler's Responder. Its state lives on the
// connection's strand.
class Exchange {
 public:
  Exchange(std::weak_ptr<Connection> connection, uint64_t number) : number(number), connection_(std::move(connection)) {}

  const uint64_t number;  // which of the connection's requests this answers

  // Runs `action(connection)` on the connection's strand; false (and nothing runs) when it is gone.
  template <typename Action>
  bool on_strand(Action action);

  // On the strand.
  void set_on_done(std::function<void(bool)> done) {
    if (outcome_)
      done(*outcome_);
    else
      on_done_ = std::move(done);
  }
  void finish(bool delivered) {
    if (outcome_) return;
    outcome_ = delivered;
    if (auto done = std::exchange(on_done_, nullptr)) done(delivered);
  }

 private:
  std::weak_ptr<Connection> connection_;
  std::function<void(bool)> on_done_;
  std::optional<bool> outcome_;
};

// One client connection. Every member function runs on the connection's strand (the executor of its
// socket), so none needs a lock.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpServer::Impl& server, tcp::socket socket, uint64_t id)
      : server_(server), socket_(std::move(socket)), timer_(socket_.get_executor()), id_(id), opened_(Clock::now()) {
    error_code ec;
    tcp::endpoint remote = socket_.remote_endpoint(ec);
    if (!ec) remote_address_ = remote.address().to_string();
  }
  ~Connection() {
    if (exchange_) exchange_->finish(false);
    server_.table.remove(id_);
  }

  auto executor() { return socket_.get_executor(); }

  void start() {
    begin_request(opened_);  // a new connection's first request is timed from its opening
    read_some();
  }

  // The connection table picked this connection to make room for a newcomer.
  void shed() {
    if (phase_ == Phase::Closed) return;
    if (phase_ == Phase::Answering) {  // it started answering since it was picked: it stays
      server_.table.readmit(id_, State::Answering, Clock::now(), shed_callback());
      return;
    }
    close();
  }

  ConnectionTable::Shed shed_callback() {
    return [weak = weak_from_this()] {
      if (auto connection = weak.lock()) asio::post(connection->executor(), [connection] { connection->shed(); });
    };
  }

  // At the cap with nothing to shed: 503, best effort, and close (never started, so not on a strand).
  void refuse_busy() {
    Response response = server_.error(503, "the server has too many open connections; retry later");
    response.fields.emplace_back("Retry-After", "1");
    send_now(response_head(response, 11, Framing::ContentLength, false, response.body.size()) + response.body);
    server_.log(remote_address_, "-", "-", 503);
    error_code ec;
    socket_.close(ec);
  }

  // Ends the connection now (the server is stopping, or the client or a deadline said so).
  void close() {
    if (phase_ == Phase::Closed) return;
    if (phase_ == Phase::Answering && exchange_) log_answer(" (client gone)");
    phase_ = Phase::Closed;
    disarm();
    error_code ec;
    socket_.close(ec);
    server_.table.remove(id_);
    if (exchange_) std::exchange(exchange_, nullptr)->finish(false);
    server_.forget(id_);  // may drop the last reference but the caller's
  }

  // The Responder's calls, each naming the request it answers (a late call for an earlier request is
  // ignored).
  void answer(uint64_t number, Response response) {
    if (!answering(number) || answer_ != Answer::None) return;
    answer_ = Answer::Whole;
    note_head(response);
    queue(response_head(response, version_, Framing::ContentLength, keep_alive_, response.body.size()));
    if (!head_only_) queue(response.body);
    answer_complete_ = true;
    flush();
  }
  void start_stream(uint64_t number, Response head) {
    if (!answering(number) || answer_ != Answer::None) return;
    answer_ = Answer::Stream;
    // HTTP/1.0 has no chunks: the body ends with the connection (RFC 9112 section 6.3).
    framing_ = version_ == 10 ? Framing::UntilClose : Framing::Chunked;
    if (framing_ == Framing::UntilClose) keep_alive_ = false;
    note_head(head);
    queue(response_head(head, version_, framing_, keep_alive_, 0));
    queue_body(head.body);
    flush();
  }
  void stream(uint64_t number, const std::string& bytes) {
    if (!answering(number) || answer_ != Answer::Stream || answer_complete_) return;
    queue_body(bytes);
    flush();
  }
  void end_stream(uint64_t number) {
    if (!answering(number) || answer_ != Answer::Stream || answer_complete_) return;
    if (framing_ == Framing::Chunked && !head_only_) queue(kLastChunk);
    answer_complete_ = true;
    flush();
  }

 private:
  enum class Phase { Reading, Answering, Idle, Lingering, Closed };
  enum class Answer { None, Whole, Stream };

  bool answering(uint64_t number) const { return phase_ == Phase::Answering && exchange_ && exchange_->number == number; }

  // What the access log says of the answer begun with `head`; the id header when asked for.
  void note_head(Response& head) {
    status_ = head.status;
    if (!head.log_id.empty()) log_id_ = head.log_id;
    if (server_.config.request_id_headers && !request_id_.empty()) head.fields.emplace_back("X-Request-Id", request_id_);
  }
  // The access-log line of the answer in progress, once it has ended.
  void log_answer(const char* note = "") {
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - received_).count();
    server_.log(remote_address_, method_, path_, status_, ms, log_id_.empty() ? request_id_ : log_id_, note);
  }

  void enter(Phase phase, State state, Clock::time_point since) {
    phase_ = phase;
    server_.table.set_state(id_, state, since);
  }

  // --- deadlines: one timer, re-armed for each phase; a stale expiry is recognised by its epoch.
  void arm(Clock::time_point deadline) {
    ++timer_epoch_;
    timer_.expires_at(deadline);
    timer_.async_wait([self = shared_from_this(), epoch = timer_epoch_](error_code ec) {
      if (!ec && epoch == self->timer_epoch_) self->on_deadline();
    });
  }
  void disarm() {
    ++timer_epoch_;
    timer_.cancel();
  }
  void on_deadline() {
    switch (phase_) {
      case Phase::Reading: {  // the request (or its header section) came too slowly: 408, best effort
        Response response = server_.error(408, "the request did not arrive in time");
        if (!writing_)
          send_now(response_head(response, version_, Framing::ContentLength, false, response.body.size()) +
                   response.body);
        server_.log(remote_address_, parser_ && parser_->is_header_done() ? method_of_parser() : "-", "-", 408);
        close();
        break;
      }
      case Phase::Answering:  // a write did not complete: the client stopped reading
      case Phase::Idle:       // keep-alive timeout
      case Phase::Lingering:
        close();
        break;
      case Phase::Closed:
        break;
    }
  }

  // --- reading. One read is outstanding whenever the connection is open, also while a request is
  // answered: that is how a client that goes away is noticed at once.
  void read_some() {
    if (reading_ || phase_ == Phase::Closed) return;
    if (phase_ == Phase::Answering && input_.size() >= kMaxPipelinedBytes) return;  // resumes after the answer
    reading_ = true;
    socket_.async_read_some(asio::buffer(read_buffer_),
                            [self = shared_from_this()](error_code ec, size_t n) { self->on_read(ec, n); });
  }
  void on_read(error_code ec, size_t n) {
    reading_ = false;
    if (phase_ == Phase::Closed) return;
    if (ec) {  // end of stream or reset: the client is gone (or done, when lingering)
      // A client that read a whole answer may close before the write's completion has run here (the
      // two completions race between io threads): on_written decides whether it was delivered.
      if (writing_ && phase_ == Phase::Answering) {
        peer_gone_ = true;
        return;
      }
      close();
      return;
    }
    if (phase_ == Phase::Lingering) {  // dropped
      read_some();
      return;
    }
    input_.commit(asio::buffer_copy(input_.prepare(n), asio::buffer(read_buffer_.data(), n)));
    switch (phase_) {
      case Phase::Idle:
        begin_request(Clock::now());
        parse();
        break;
      case Phase::Reading:
        parse();
        break;
      case Phase::Answering:  // the next pipelined request: kept for later
        read_some();
        break;
      default:
        break;
    }
  }

  void begin_request(Clock::time_point start) {
    enter(Phase::Reading, State::Reading, start);
    request_start_ = start;
    version_ = 11;
    parser_.emplace();
    parser_->header_limit(uint32_t(std::min<size_t>(server_.config.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(uint64_t(server_.config.max_body_bytes));
    header_checked_ = false;
    header_section_.clear();
    arm(start + std::min(server_.config.header_timeout, server_.config.request_timeout));
  }

  // Feeds the parser what has arrived; answers or reads on.
  void parse() {
    while (phase_ == Phase::Reading) {
      if (!parser_->got_some()) {  // RFC 9112 section 2.2: empty lines before a request line are ignored
        auto bytes = static_cast<const char*>(input_.data().data());
        size_t blank = 0;
        while (blank < input_.size() && (bytes[blank] == '\r' || bytes[blank] == '\n')) ++blank;
        input_.consume(blank);
        if (input_.size() == 0) break;
      }
      error_code ec;
      size_t used = parser_->put(input_.data(), ec);
      // Without eager parsing, the call that completes the header section consumes exactly it.
      if (!header_checked_ && parser_->is_header_done())
        header_section_.assign(static_cast<const char*>(input_.data().data()), used);
      input_.consume(used);
      if (ec == bhttp::error::need_more) break;
      if (ec) {
        refuse_malformed(ec);
        return;
      }
      if (!header_checked_ && parser_->is_header_done()) {
        header_checked_ = true;
        if (!check_header()) return;
      }
      if (parser_->is_done()) {
        dispatch();
        return;
      }
      if (used == 0) break;
    }
    read_some();
  }

  void refuse_malformed(error_code ec) {
    if (ec == bhttp::error::header_limit)
      refuse(431, "the request's header section is larger than " + std::to_string(server_.config.max_header_bytes) +
                      " bytes");
    else if (ec == bhttp::error::body_limit)
      refuse(413, "the request body is too large (the limit is " + std::to_string(server_.config.max_body_bytes) +
                      " bytes)");
    else if (ec == bhttp::error::bad_version)  // the parser takes HTTP/1.0 and HTTP/1.1 only
      refuse(505, "only HTTP/1.0 and HTTP/1.1 are served");
    else
      refuse(400, "malformed HTTP request: " + ec.message());
  }

  // The header section is complete: what can be decided before the body is read.
  bool check_header() {
    const auto& message = parser_->get();
    version_ = message.version() == 10 ? 10 : 11;
    if (version_ == 11 && message.find(bhttp::field::host) == message.end()) {  // RFC 9112 section 3.2
      refuse(400, "an HTTP/1.1 request must have a Host header field");
      return false;
    }
    // RFC 9110 section 10.1.1: a client that asked may wait for the interim answer before it sends the
    // body (curl does for large bodies); HTTP/1.0 requests' expectations are ignored.
    if (version_ == 11 && !parser_->is_done() && equals_ignoring_case(message[bhttp::field::expect], "100-continue")) {
      queue("HTTP/1.1 100 Continue\r\n\r\n");
      flush();
    }
    arm(request_start_ + server_.config.request_timeout);  // the body's deadline
    parser_->eager(true);
    return true;
  }

  std::string method_of_parser() const { return std::string(parser_->get().method_string()); }

  // --- answering
  void begin_answer(std::string method, std::string path) {
    enter(Phase::Answering, State::Answering, Clock::now());
    disarm();
    exchange_ = std::make_shared<Exchange>(weak_from_this(), ++exchanges_);
    answer_ = Answer::None;
    answer_complete_ = false;
    method_ = std::move(method);
    path_ = std::move(path);
    received_ = Clock::now();
    status_ = 0;
    request_id_.clear();
    log_id_.clear();
  }

  void dispatch() {
    auto message = parser_->release();
    parser_.reset();
    Request request;
    request.method = std::string(message.method_string());
    request.target = std::string(message.target());
    request.path = target_path(request.target);
    request.version = version_;
    for (const auto& field : message) request.fields.emplace_back(std::string(field.name_string()), std::string(field.value()));
    request.header_section = std::move(header_section_);
    request.body = std::move(message.body());
    request.remote_address = remote_address_;
    request.received = Clock::now();
    request.id = request_id(request);
    keep_alive_ = message.keep_alive() && server_.config.keep_alive_timeout.count() > 0;
    head_only_ = request.method == "HEAD";
    begin_answer(request.method, request.path);
    received_ = request.received;
    request_id_ = request.id;

    std::string allowed;
    const Handler* handler = server_.find_route(request.method, request.path, allowed);
    if (!handler) {
      if (allowed.empty()) {
        answer(exchange_->number, server_.error(404, "Not Found: " + request.method + " " + request.path));
      } else {  // RFC 9110 section 15.5.6: 405 lists the methods the resource has
        Response response =
            server_.error(405, "Method Not Allowed: " + request.method + " " + request.path + " (allowed: " + allowed + ")");
        response.fields.emplace_back("Allow", allowed);
        answer(exchange_->number, std::move(response));
      }
    } else {
      asio::post(server_.workers, [&server = server_, handler, request = std::move(request),
                                   responder = Responder(exchange_)] {
        try {
          (*handler)(request, responder);
        } catch (const std::exception& e) {
          responder.send(server.error(500, std::string("internal error: ") + e.what()));
        }
      });
    }
    read_some();
  }

  // Answers a request that was not read whole (or not at all) and closes the connection.
  void refuse(int status, const std::string& message) {
    if (parser_) version_ = parser_->get().version() == 10 ? 10 : 11;
    begin_answer(header_checked_ ? method_of_parser() : "-", "-");
    keep_alive_ = false;
    head_only_ = false;
    answer(exchange_->number, server_.error(status, message));
  }

  void finish_answer() {
    log_answer();
    std::exchange(exchange_, nullptr)->finish(true);
    answer_ = Answer::None;
    if (!keep_alive_) {
      linger();
      return;
    }
    if (input_.size() > 0) {  // a pipelined request is waiting
      begin_request(Clock::now());
      parse();
      return;
    }
    Clock::time_point now = Clock::now();
    enter(Phase::Idle, State::Idle, now);
    arm(now + server_.config.keep_alive_timeout);
    read_some();
  }

  // RFC 9112 section 9.6: close in stages, so that a client still sending reads our answer rather than
  // a reset: stop sending, read and drop what still comes for a while, then close.
  void linger() {
    Clock::time_point now = Clock::now();
    enter(Phase::Lingering, State::Lingering, now);
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    input_.consume(input_.size());
    arm(now + kLingerTimeout);
    read_some();
  }

  // --- writing: one write in flight; what is produced meanwhile waits in the outbox.
  void queue(std::string_view bytes) { outbox_.append(bytes); }
  void queue_body(const std::string& bytes) {
    if (head_only_ || bytes.empty()) return;
    if (framing_ == Framing::Chunked)
      queue(chunk(bytes));
    else
      queue(bytes);
  }
  void flush() {
    if (writing_ || phase_ == Phase::Closed) return;
    if (outbox_.empty()) {
      if (phase_ == Phase::Answering && answer_complete_) finish_answer();
      return;
    }
    writing_ = true;
    sending_ = std::exchange(outbox_, std::string());
    // A client that stops reading holds its answer; it is dropped when a write does not complete within
    // as long as a whole request may take.
    if (phase_ == Phase::Answering) arm(Clock::now() + server_.config.request_timeout);
    asio::async_write(socket_, asio::buffer(sending_),
                      [self = shared_from_this()](error_code ec, size_t) { self->on_written(ec); });
  }
  void on_written(error_code ec) {
    writing_ = false;
    if (phase_ == Phase::Closed) return;
    if (ec) {
      close();
      return;
    }
    if (peer_gone_) {  // the client went away while this write was in flight
      if (phase_ == Phase::Answering && answer_complete_ && outbox_.empty()) {  // it had the whole answer
        log_answer();
        std::exchange(exchange_, nullptr)->finish(true);
      }
      close();
      return;
    }
    if (phase_ == Phase::Answering) disarm();
    flush();
  }

  // A write that must not wait: a refusal or a timeout's 408 just before the connection is closed.
  void send_now(const std::string& bytes) {
    error_code ec;
    socket_.non_blocking(true, ec);
    socket_.write_some(asio::buffer(bytes), ec);
  }

  HttpServer::Impl& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  uint64_t timer_epoch_ = 0;
  const uint64_t id_;
  const Clock::time_point opened_;
  std::string remote_address_;
  Phase phase_ = Phase::Reading;

  // Reading.
  std::array<char, kReadSize> read_buffer_;  // the read in flight fills this; on_read moves it to input_
  beast::flat_buffer input_;                 // received, not yet parsed
  bool reading_ = false;
  bool peer_gone_ = false;  // the client closed while a write was in flight (see on_read)
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  bool header_checked_ = false;
  std::string header_section_;
  Clock::time_point request_start_;

  // Answering.
  std::shared_ptr<Exchange> exchange_;
  uint64_t exchanges_ = 0;
  Answer answer_ = Answer::None;
  bool answer_complete_ = false;  // the answer's last bytes are in the outbox (or written)
  Framing framing_ = Framing::ContentLength;
  int version_ = 11;
  bool keep_alive_ = true, head_only_ = false;
  // For the access log.
  std::string method_, path_;
  Clock::time_point received_;     // the request's arrival
  int status_ = 0;                 // the answer's status; 0 until it is begun
  std::string request_id_, log_id_;  // Request::id ("" for a request refused unread); Response::log_id

  // Writing.
  std::string outbox_, sending_;
  bool writing_ = false;
};

template <typename Action>
bool Exchange::on_strand(Action action) {
  std::shared_ptr<Connection> connection = connection_.lock();
  if (!connection) return false;
  asio::post(connection->executor(), [connection, action = std::move(action)]() mutable { action(*connection); });
  return true;
}

void Responder::send(Response response) const {
  exchange_->on_strand([number = exchange_->number, response = std::move(response)](Connection& c) mutable {
    c.answer(number, std::move(response));
  });
}

void Responder::start_stream(Response head) const {
  exchange_->on_strand([number = exchange_->number, head = std::move(head)](Connection& c) mutable {
    c.start_stream(number, std::move(head));
  });
}

void Responder::write(std::string bytes) const {
  if (bytes.empty()) return;
  exchange_->on_strand(
      [number = exchange_->number, bytes = std::move(bytes)](Connection& c) { c.stream(number, bytes); });
}

void Responder::end() const {
  exchange_->on_strand([number = exchange_->number](Connection& c) { c.end_stream(number); });
}

void Responder::on_done(std::function<void(bool delivered)> done) const {
  std::shared_ptr<Exchange> exchange = exchange_;
  // The connection is gone, so the exchange ended undelivered.
  if (!exchange->on_strand([exchange, done](Connection&) { exchange->set_on_done(done); })) done(false);
}

const Handler* HttpServer::Impl::find_route(const std::string& method, const std::string& path,
                                            std::string& allowed) const {
  auto at = routes.find(path);
  if (at == routes.end()) return nullptr;
  const auto& methods = at->second;
  auto found = methods.find(method == "HEAD" ? "GET" : method);  // RFC 9110 section 9.3.2
  if (found != methods.end()) return &found->second;
  for (const auto& [name, handler] : methods) {
    allowed += (allowed.empty() ? "" : ", ") + name;
    if (name == "GET") allowed += ", HEAD";
  }
  return nullptr;
}

void HttpServer::Impl::accept() {
  acceptor.async_accept(asio::make_strand(io), [this](error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (ec == asio::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system ||
        ec == asio::error::no_buffer_space || ec == asio::error::no_memory) {
      // Out of descriptors: the pending connections wait in the listen queue; try again shortly rather
      // than spinning.
      accept_retry.expires_after(std::chrono::milliseconds(50));
      accept_retry.async_wait([this](error_code) { accept(); });
      return;
    }
    if (!ec) admit(std::move(socket));
    accept();
  });
}

void HttpServer::Impl::admit(tcp::socket socket) {
  error_code ec;
  socket.set_option(tcp::no_delay(true), ec);  // stream chunks are small: no waiting to coalesce them
  uint64_t id = next_id++;
  auto connection = std::make_shared<Connection>(*this, std::move(socket), id);
  ConnectionTable::Admission admission = table.admit(id, Clock::now(), connection->shed_callback());
  if (!admission.admitted) {
    connection->refuse_busy();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    live[id] = connection;
  }
  if (admission.shed) admission.shed();
  asio::post(connection->executor(), [connection] { connection->start(); });
}

HttpServer::HttpServer(HttpConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {
  SPARROW_CHECK(impl_->config.max_connections > 0, "the HTTP server needs room for at least one connection");
  SPARROW_CHECK(impl_->config.io_threads > 0, "the HTTP server needs an io thread");
}

HttpServer::~HttpServer() {
  impl_->io.stop();
  impl_->workers.stop();
  impl_->workers.join();
  // No thread runs anymore: close what is still open here, which ends the answers in progress
  // undelivered, before the io_context and its sockets go.
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> live;
  {
    std::lock_guard<std::mutex> lock(impl_->live_mutex);
    live = impl_->live;
  }
  for (auto& [id, connection] : live) connection->close();
}

void HttpServer::route(const std::string& method, const std::string& path, Handler handler, std::string summary,
                       std::string body_type) {
  auto& infos = impl_->route_infos;
  std::erase_if(infos, [&](const RouteInfo& info) { return info.method == method && info.path == path; });
  infos.push_back({method, path, std::move(summary), std::move(body_type)});
  impl_->routes[path][method] = std::move(handler);
}

std::vector<HttpServer::RouteInfo> HttpServer::routes() const {
  std::vector<RouteInfo> out = impl_->route_infos;
  std::stable_sort(out.begin(), out.end(), [](const RouteInfo& a, const RouteInfo& b) {
    return std::tie(a.path, a.method) < std::tie(b.path, b.method);
  });
  return out;
}

int HttpServer::bind() {
  const HttpConfig& config = impl_->config;
  SPARROW_CHECK(config.port >= 0 && config.port <= 65535, "the port must be in 0-65535 (got ", config.port, ")");
  // Each connection holds a descriptor: allow as many as the system lets this process have.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  error_code ec;
  tcp::resolver resolver(impl_->io);
  auto endpoints = resolver.resolve(config.host, std::to_string(config.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  SPARROW_CHECK(!ec && !endpoints.empty(), "cannot listen on ", config.host, ":", config.port, ": ",
                ec ? ec.message() : "no such address");
  tcp::endpoint endpoint = endpoints.begin()->endpoint();
  tcp::acceptor& acceptor = impl_->acceptor;
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  SPARROW_CHECK(!ec, "cannot listen on ", config.host, ":", config.port, ": ", ec.message());
  return acceptor.local_endpoint().port();
}

void HttpServer::run() {
  impl_->accept();
  std::vector<std::thread> others;
  for (int i = 1; i < impl_->config.io_threads; ++i) others.emplace_back([this] { impl_->io.run(); });
  impl_->io.run();
  for (std::thread& thread : others) thread.join();
}

void HttpServer::stop() { impl_->io.stop(); }

void HttpServer::post(std::function<void()> task) {
  asio::post(impl_->workers, [task = std::move(task)] {
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sparrow serve: a worker task failed: %s\n", e.what());
    }
  });
}

size_t HttpServer::open_connections() const { return impl_->table.size(); }

}  // namespace sparrow::server::http
