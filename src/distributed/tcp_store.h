// The rendezvous key/value store over TCP, as torch's c10d TCPStore: rank 0 serves it, and every rank
// (rank 0's included) writes its gloo addresses there and reads the others'. Debian's gloo has only file,
// hash (in-process) and Redis stores; this one needs nothing but rank 0's address and a port.
//
// The protocol is private to this file pair (little-endian integers): a request is a frame
//   u32 body bytes | u8 op | u32 key count | (u32 key bytes | key)... | value (the rest, set only)
// and every request gets one answer frame (u32 body bytes | body): set's is empty, get's the value, wait's
// empty. get and wait are answered when their keys exist, so a client waits on its socket, not by polling.
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace sparrow {

class TcpStore : public gloo::rendezvous::Store {
 public:
  // With `is_server`, listens on addr:port ("0.0.0.0" for every interface; port 0 picks a free port, which
  // port() then says) and serves any number of clients from a background thread until destroyed. Every
  // TcpStore is a client of addr:port: it retries connecting until `timeout` passes (the server may start
  // later), then throws "could not reach the rendezvous at ADDR:PORT within N s ...". `timeout` also
  // bounds get() and wait() without a timeout of their own.
  TcpStore(const std::string& addr, int port, bool is_server, std::chrono::milliseconds timeout);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  int port() const { return port_; }

  // Returns once the server holds the value (a later get from any client sees it).
  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits for the key; a sparrow::Error naming the key and the timeout when it does not appear in time.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  class Server;
  // One request and its answer's body; nullopt when no answer came within `timeout` (the connection is
  // then dropped, so that the late answer is not read as the next request's).
  std::optional<std::string> request(char op, const std::vector<std::string>& keys, const std::vector<char>& value,
                                     std::chrono::milliseconds timeout);
  void disconnect();

  std::string addr_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Server> server_;
  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;    // the connection to the server; -1 until (re)connected
};

}  // namespace sparrow
