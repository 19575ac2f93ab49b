// Noticing that a client went away while its completion is still being generated, without writing to
// it. cpp-httplib does not hand a request's socket to the handler, so it is found among the process's
// descriptors by its two addresses (local and remote, which identify a TCP connection); then a poll
// for POLLRDHUP says whether the client has closed its end. vLLM does the same check with
// `request.is_disconnected()` and aborts the request.
#pragma once
#include <string>

namespace sparrow::server {

class ClientSocket {
 public:
  ClientSocket() = default;  // none: closed() is always false
  // The connected socket with these addresses (as httplib::Request reports them); none if not found.
  ClientSocket(const std::string& local_addr, int local_port, const std::string& remote_addr, int remote_port);
  // The client closed (or reset) the connection. False when the socket was not found.
  bool closed() const;

 private:
  int fd_ = -1;
};

}  // namespace sparrow::server
