// `sparrow proxy`: the small prefill/decode proxy for one host (docs/disaggregation.md), the part vLLM's
// examples/online_serving/disaggregated_serving proxy plays. For each completion (/v1/completions,
// /v1/chat/completions) it asks a prefill instance for the first token with kv_transfer_params
// {"do_remote_decode": true} (max_tokens 1, not streamed), then sends the client's own request to a decode
// instance with the kv_transfer_params the prefill instance answered, and passes that answer (streamed or
// not) back. Instances are taken in turn. It holds no state and manages no processes: a cluster's router
// (vLLM's, SGLang's) does the same job at scale.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "server/http/http_server.h"

namespace sparrow::server {

struct PdProxyConfig {
  std::vector<std::string> prefill_urls, decode_urls;  // "http://host:port"
  http::HttpConfig http;
};

class PdProxy {
 public:
  explicit PdProxy(PdProxyConfig config);
  ~PdProxy();
  int bind();   // the listening port
  void run();   // until stop()
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::server
