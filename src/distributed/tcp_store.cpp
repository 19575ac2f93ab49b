#include "distributed/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string_view>
#include <thread>

#include "core/error.h"

namespace sparrow {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kSet = 1, kGet = 2, kWait = 3;
// Far above any rendezvous value (gloo's addresses are a few hundred bytes a rank); it bounds what a stray
// connection to the port can make the server buffer.
constexpr uint32_t kMaxFrameBytes = 1u << 30;

void put_u32(std::string& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(char(value >> (8 * i)));
}

uint32_t get_u32(const char* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= uint32_t(uint8_t(in[i])) << (8 * i);
  return value;
}

std::string frame(std::string_view body) {
  std::string out;
  put_u32(out, uint32_t(body.size()));
  out.append(body);
  return out;
}

std::string where(const std::string& addr, int port) {
  return addr.find(':') == std::string::npos ? cat(addr, ":", port) : cat("[", addr, "]:", port);
}

std::string seconds(milliseconds timeout) { return cat(double(timeout.count()) / 1000, " s"); }

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

struct Request {
  char op = 0;
  std::vector<std::string> keys;
  std::string value;
};

std::optional<Request> decode(std::string_view body) {
  Request request;
  if (body.size() < 5) return std::nullopt;
  request.op = body[0];
  uint32_t count = get_u32(body.data() + 1);
  body.remove_prefix(5);
  for (uint32_t i = 0; i < count; ++i) {
    if (body.size() < 4 || body.size() - 4 < get_u32(body.data())) return std::nullopt;
    uint32_t length = get_u32(body.data());
    request.keys.emplace_back(body.substr(4, length));
    body.remove_prefix(4 + length);
  }
  request.value = body;
  bool well_formed = request.op == kSet ? request.keys.size() == 1
                     : request.op == kGet ? request.keys.size() == 1 && request.value.empty()
                                          : request.op == kWait && request.value.empty();
  return well_formed ? std::optional<Request>(std::move(request)) : std::nullopt;
}

// A non-blocking connect bounded by `deadline`; false with the reason in `error` when it fails.
bool connect_before(int fd, const addrinfo& to, Clock::time_point deadline, std::string* error) {
  if (::connect(fd, to.ai_addr, to.ai_addrlen) == 0) return true;
  if (errno != EINPROGRESS) {
    *error = std::strerror(errno);
    return false;
  }
  pollfd pending{fd, POLLOUT, 0};
  int ready;
  do ready = ::poll(&pending, 1, remaining_ms(deadline));
  while (ready < 0 && errno == EINTR);
  if (ready <= 0) {
    *error = ready == 0 ? "connect timed out" : std::strerror(errno);
    return false;
  }
  int status = 0;
  socklen_t length = sizeof status;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &status, &length);
  if (status != 0) *error = std::strerror(status);
  return status == 0;
}

// A blocking connection to addr:port, retried until `timeout` passes: the server may not listen yet.
int connect_to(const std::string& addr, int port, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string error = "no address";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (int rv = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found); rv != 0)
      error = cat("cannot resolve '", addr, "': ", gai_strerror(rv));
    for (addrinfo* to = found; to; to = to->ai_next) {
      int fd = ::socket(to->ai_family, to->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, to->ai_protocol);
      if (fd < 0) {
        error = std::strerror(errno);
        continue;
      }
      if (connect_before(fd, *to, deadline, &error)) {
        ::freeaddrinfo(found);
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        int on = 1;  // requests are small and each waits for its answer
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
        return fd;
      }
      ::close(fd);
    }
    if (found) ::freeaddrinfo(found);
    if (Clock::now() >= deadline)
      fail("could not reach the rendezvous at ", where(addr, port), " within ", seconds(timeout),
           " (is rank 0 running? --master-addr / MASTER_ADDR): ", error);
    std::this_thread::sleep_for(std::min<Clock::duration>(milliseconds(100), deadline - Clock::now()));
  }
}

bool send_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    bytes.remove_prefix(size_t(sent));
  }
  return true;
}

enum class Received { Done, TimedOut, Closed };

// Reads exactly `size` bytes into `out` before `deadline`.
Received recv_all(int fd, char* out, size_t size, Clock::time_point deadline) {
  while (size > 0) {
    pollfd readable{fd, POLLIN, 0};
    int ready = ::poll(&readable, 1, remaining_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return Received::TimedOut;
    if (ready < 0) return Received::Closed;
    ssize_t got = ::recv(fd, out, size, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return Received::Closed;
    out += got;
    size -= size_t(got);
  }
  return Received::Done;
}

}  // namespace

// The server: one thread polling the listening socket, a wake pipe (the destructor's stop signal) and every
// client. Clients are non-blocking both ways, so a client that stops reading or vanishes never stalls the
// others or the shutdown; a get or wait whose keys are missing parks its client until a set provides them.
class TcpStore::Server {
 public:
  Server(const std::string& addr, int port) {
    listen_fd_ = listen_on(addr, port);
    if (::pipe2(wake_, O_CLOEXEC) != 0) {
      ::close(listen_fd_);
      fail("rendezvous server: pipe: ", std::strerror(errno));
    }
    thread_ = std::thread([this] { serve(); });
  }

  ~Server() {
    char stop = 0;
    while (::write(wake_[1], &stop, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
    for (Client& client : clients_) ::close(client.fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const {
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
    return bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }

 private:
  struct Client {
    explicit Client(int fd) : fd(fd) {}
    int fd;
    std::string inbox, outbox;       // bytes received and not yet parsed; answers not yet sent
    std::optional<Request> waiting;  // a get / wait whose keys are not all set yet
    bool closed = false;
  };

  static int listen_on(const std::string& addr, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (int rv = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found); rv != 0)
      fail("cannot listen for the rendezvous on ", where(addr, port), ": ", gai_strerror(rv));
    std::string error = "no address";
    for (addrinfo* at = found; at; at = at->ai_next) {
      int fd = ::socket(at->ai_family, at->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, at->ai_protocol);
      if (fd < 0) {
        error = std::strerror(errno);
        continue;
      }
      // A restarted rank 0 must not wait for the previous run's connections to leave TIME_WAIT.
      int on = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
      if (::bind(fd, at->ai_addr, at->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        ::freeaddrinfo(found);
        return fd;
      }
      error = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(found);
    fail("cannot listen for the rendezvous on ", where(addr, port), ": ", error);
  }

  void serve() {
    for (;;) {
      std::vector<pollfd> polled{{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
      for (const Client& client : clients_)
        polled.push_back({client.fd, short(POLLIN | (client.outbox.empty() ? 0 : POLLOUT)), 0});
      if (::poll(polled.data(), polled.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;  // cannot happen with valid descriptors; the clients then time out and say so
      }
      if (polled[0].revents) return;
      bool stored = false;
      for (size_t i = 0; i < clients_.size(); ++i) {
        const short events = polled[2 + i].revents;
        if (events & (POLLIN | POLLHUP | POLLERR)) stored |= read_from(clients_[i]);
        if (events & POLLOUT) flush(clients_[i]);
      }
      // A set may complete the keys parked requests wait for, and answering one may release more of its
      // client's requests, sets among them.
      while (stored) {
        stored = false;
        for (Client& client : clients_)
          if (client.waiting && answer(client, *client.waiting)) {
            client.waiting.reset();
            stored |= handle_requests(client);
          }
      }
      std::erase_if(clients_, [](const Client& client) {
        if (client.closed) ::close(client.fd);
        return client.closed;
      });
      if (polled[1].revents & POLLIN) accept_clients();
    }
  }

  void accept_clients() {
    for (;;) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: none left; anything else concerns that connection only
      int on = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
      clients_.emplace_back(fd);
    }
  }

  // Reads what the client sent and handles its complete requests; whether one of them was a set.
  bool read_from(Client& client) {
    char buffer[65536];
    for (;;) {
      ssize_t got = ::recv(client.fd, buffer, sizeof buffer, 0);
      if (got > 0) {
        client.inbox.append(buffer, size_t(got));
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) client.closed = true;
      break;
    }
    return handle_requests(client);
  }

  bool handle_requests(Client& client) {
    bool stored = false;
    while (!client.closed && !client.waiting && client.inbox.size() >= 4) {
      const uint32_t length = get_u32(client.inbox.data());
      if (length > kMaxFrameBytes) {
        client.closed = true;
        break;
      }
      if (client.inbox.size() - 4 < length) break;
      std::optional<Request> request = decode(std::string_view(client.inbox).substr(4, length));
      client.inbox.erase(0, 4 + size_t(length));
      if (!request) {
        client.closed = true;  // not our protocol: a stray connection
        break;
      }
      if (request->op == kSet) {
        data_[request->keys[0]] = std::move(request->value);
        reply(client, "");
        stored = true;
      } else if (!answer(client, *request)) {
        client.waiting = std::move(request);
      }
    }
    return stored;
  }

  // Answers a get or wait whose keys are all set; false (nothing sent) otherwise.
  bool answer(Client& client, const Request& request) {
    for (const std::string& key : request.keys)
      if (!data_.count(key)) return false;
    reply(client, request.op == kGet ? data_[request.keys[0]] : std::string());
    return true;
  }

  void reply(Client& client, std::string_view body) {
    client.outbox += frame(body);
    flush(client);
  }

  void flush(Client& client) {
    while (!client.outbox.empty()) {
      ssize_t sent = ::send(client.fd, client.outbox.data(), client.outbox.size(), MSG_NOSIGNAL);
      if (sent > 0) {
        client.outbox.erase(0, size_t(sent));
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) client.closed = true;
      return;  // the rest when poll says the socket takes more
    }
  }

  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::map<std::string, std::string> data_;
  std::vector<Client> clients_;  // the server thread's alone
  std::thread thread_;
};

TcpStore::TcpStore(const std::string& addr, int port, bool is_server, milliseconds timeout)
    : addr_(addr), port_(port), timeout_(timeout) {
  if (is_server) {
    server_ = std::make_unique<Server>(addr, port);
    port_ = server_->port();
  }
  fd_ = connect_to(addr_, port_, timeout_);
}

TcpStore::~TcpStore() {
  disconnect();
  server_.reset();
}

void TcpStore::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::optional<std::string> TcpStore::request(char op, const std::vector<std::string>& keys,
                                             const std::vector<char>& value, milliseconds timeout) {
  std::string body(1, op);
  put_u32(body, uint32_t(keys.size()));
  for (const std::string& key : keys) {
    put_u32(body, uint32_t(key.size()));
    body += key;
  }
  body.append(value.begin(), value.end());
  SPARROW_CHECK(body.size() <= kMaxFrameBytes, "rendezvous: a value of ", value.size(), " bytes is too large");

  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) fd_ = connect_to(addr_, port_, timeout_);
  const Clock::time_point deadline = Clock::now() + timeout;
  char header[4];
  std::string answer;
  Received received = Received::Closed;
  if (send_all(fd_, frame(body))) {
    received = recv_all(fd_, header, sizeof header, deadline);
    if (received == Received::Done) {
      answer.resize(get_u32(header));
      received = recv_all(fd_, answer.data(), answer.size(), deadline);
    }
  }
  if (received == Received::Done) return answer;
  disconnect();
  SPARROW_CHECK(received == Received::TimedOut, "the rendezvous at ", where(addr_, port_),
                " closed the connection (did rank 0 exit?)");
  return std::nullopt;
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  SPARROW_CHECK(request(kSet, {key}, data, timeout_), "rendezvous at ", where(addr_, port_), ": setting key '", key,
                "' was not acknowledged within ", seconds(timeout_));
}

std::vector<char> TcpStore::get(const std::string& key) {
  std::optional<std::string> value = request(kGet, {key}, {}, timeout_);
  SPARROW_CHECK(value, "rendezvous at ", where(addr_, port_), ": key '", key, "' did not appear within ",
                seconds(timeout_), " (did every rank start?)");
  return std::vector<char>(value->begin(), value->end());
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  if (request(kWait, keys, {}, timeout)) return;
  std::string names;
  for (const std::string& key : keys) names += cat(names.empty() ? "'" : ", '", key, "'");
  fail("rendezvous at ", where(addr_, port_), ": key(s) ", names, " did not all appear within ", seconds(timeout),
       " (did every rank start?)");
}

}  // namespace sparrow
