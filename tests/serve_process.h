// A `sparrow serve` child process for end-to-end tests of HTTP clients (bench serve, bench sweep): started
// on a free port (--port 0) with its output in a log file, stopped with SIGTERM when the object goes.
#pragma once
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sparrow::test {

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class ServeProcess {
 public:
  // `args` follow `sparrow serve` (the model folder first); the port is read from the log's start-up line.
  // port() stays 0 when the server exits or prints nothing within two minutes (the log says why).
  ServeProcess(const std::vector<std::string>& args, const std::string& log) {
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<std::string> all = {SPARROW_BINARY, "serve"};
      all.insert(all.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (std::string& s : all) argv.push_back(s.data());
      argv.push_back(nullptr);
      if (!freopen(log.c_str(), "w", stdout) || !freopen(log.c_str(), "a", stderr)) _exit(126);
      execv(SPARROW_BINARY, argv.data());
      _exit(127);
    }
    const std::regex started(R"(on http://127\.0\.0\.1:(\d+))");
    for (int tries = 0; tries < 1200 && port_ == 0; ++tries) {
      std::smatch m;
      const std::string text = read_text_file(log);
      if (std::regex_search(text, m, started)) port_ = std::stoi(m[1]);
      int status = 0;
      if (port_ == 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  ~ServeProcess() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

}  // namespace sparrow::test
