// sparrow proxy --prefill URL [--prefill URL ...] --decode URL [--decode URL ...] [--host H] [--port P]
// The single-host prefill/decode proxy (server/pd_proxy.h, docs/disaggregation.md).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "server/pd_proxy.h"

namespace sparrow::cli {
namespace {

// SIGTERM / SIGINT only write to a pipe (async-signal-safe); a thread reads it and stops the proxy.
int stop_pipe[2] = {-1, -1};
void on_stop_signal(int signal) {
  const char byte = char(signal);
  (void)!write(stop_pipe[1], &byte, 1);
}

}  // namespace

void add_proxy(CLI::App& app) {
  auto* sub = app.add_subcommand("proxy", "Prefill/decode proxy: each completion's prompt on a prefill instance, the "
                                          "rest on a decode instance (docs/disaggregation.md)");
  static server::PdProxyConfig config;
  static std::string host = "127.0.0.1";
  static int port = 8000;
  sub->add_option("--prefill", config.prefill_urls, "a prefill instance's URL (http://host:port); repeat for more")->required();
  sub->add_option("--decode", config.decode_urls, "a decode instance's URL; repeat for more")->required();
  sub->add_option("--host", host, "address to listen on")->capture_default_str();
  sub->add_option("--port", port, "port to listen on (0: any free port)")->capture_default_str();
  on_selected(sub, [] {
    config.http.host = host;
    config.http.port = port;
    server::PdProxy proxy(config);
    const int bound = proxy.bind();
    if (pipe(stop_pipe) != 0) fail("proxy: cannot create a pipe");
    std::thread stopper([&] {
      char byte = 0;
      if (read(stop_pipe[0], &byte, 1) == 1 && byte != 0) proxy.stop();
    });
    struct sigaction action = {};
    action.sa_handler = on_stop_signal;
    sigaction(SIGTERM, &action, nullptr);
    sigaction(SIGINT, &action, nullptr);
    std::printf("sparrow proxy: on http://%s:%d, %zu prefill and %zu decode instances\n", host.c_str(), bound,
                config.prefill_urls.size(), config.decode_urls.size());
    std::fflush(stdout);
    proxy.run();
    const char none = 0;  // the proxy stopped by itself: let the stopper go
    (void)!write(stop_pipe[1], &none, 1);
    stopper.join();
  });
}

}  // namespace sparrow::cli
