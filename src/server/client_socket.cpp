#include "server/client_socket.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <filesystem>

namespace sparrow::server {
namespace {

// An address as httplib formats it (getnameinfo with NI_NUMERICHOST), and its port.
bool describe(const sockaddr_storage& address, socklen_t length, std::string& host, int& port) {
  char name[NI_MAXHOST], service[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, name, sizeof name, service, sizeof service,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = name;
  port = std::atoi(service);
  return true;
}

bool matches(int fd, const std::string& local_addr, int local_port, const std::string& remote_addr, int remote_port) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  std::string host;
  int port = 0;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0 || !describe(address, length, host, port) ||
      port != remote_port || host != remote_addr)
    return false;
  length = sizeof address;
  return getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0 &&
         describe(address, length, host, port) && port == local_port && host == local_addr;
}

}  // namespace

ClientSocket::ClientSocket(const std::string& local_addr, int local_port, const std::string& remote_addr,
                           int remote_port) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    int fd = std::stoi(name);
    if (matches(fd, local_addr, local_port, remote_addr, remote_port)) {
      fd_ = fd;
      return;
    }
  }
}

bool ClientSocket::closed() const {
  if (fd_ < 0) return false;
  pollfd watch{fd_, POLLRDHUP, 0};
  return poll(&watch, 1, 0) > 0 && (watch.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace sparrow::server
