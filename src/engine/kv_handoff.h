// Prefill/decode disaggregation in the engine (docs/disaggregation.md; vLLM's kv_transfer_params protocol):
//
//   prefill instance (kv_producer)                      decode instance (kv_consumer)
//   request with do_remote_decode                        the same request with the handoff below
//   prefills the prompt, draws the first token    ──▶    allocates blocks (prefix-cache hits first), fetches
//   offers the prompt's block rows and its               the rows it lacks and the state, one message per
//   recurrent state under a transfer id; answers         block row; then the sequence runs on from the first
//   with the handoff (kv_transfer_params)                token as if this instance had prefilled it
//
// The first token travels in the handoff, so the decode instance's tokens are the ones one instance would
// draw: the rows it decodes against are the prefill's own bytes, and each draw's key depends only on the
// seed and the output position (engine/sampler.h).
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/kv_transfer.h"
#include "engine/logprobs.h"

namespace sparrow {

// What the prefill instance hands the decode instance, in the prefill response's kv_transfer_params.
struct KvHandoff {
  std::string transfer_id;   // the offer's id at the producer; empty: nothing offered (the first token ended it)
  std::string engine_id;     // the producer's --kv-transfer-config engine_id (vLLM's remote_engine_id)
  KvPeer peer;               // where the producer's agent listens (remote_host, remote_port)
  std::vector<int32_t> block_ids;  // the producer's block rows, in order (vLLM's remote_block_ids); the state is
                                   // region block_ids.size() of the offer when the model has one
  int64_t num_tokens = 0;          // prompt tokens whose rows are offered (the whole prompt)
  std::string cache_layout;        // CachePlan::layout_key(): the decode instance's must be the same
  int32_t first_token = -1;
  std::optional<TokenLogprob> first_logprob;  // when the request asked for logprobs
};

// A request's part in a disaggregated pair (Request::kv_transfer).
struct KvTransferRequest {
  bool remote_decode = false;              // a prefill instance's request: offer the cache after the first token
  std::optional<KvHandoff> remote_prefill; // a decode instance's request: fetch the cache, go on from the handoff
  bool active() const { return remote_decode || remote_prefill.has_value(); }
};

// --kv-transfer-config as the engine uses it.
struct KvTransferSettings {
  KvTransferAgent* agent = nullptr;  // null: no disaggregation (it must outlive the engine)
  bool produces = false, consumes = false;  // kv_role: kv_producer, kv_consumer, or kv_both
  std::string engine_id;
  std::chrono::milliseconds offer_expiry{480'000};  // vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
  std::chrono::milliseconds fetch_timeout{120'000};
  bool log_transfers = false;  // one line per fetch on stderr: messages, bytes, time (failures always)
  // A fetch that fails: "fail" ends the request with an error; "recompute" prefills it here instead.
  bool recompute_on_failure = false;
  // Move the rows through host memory: always for a GPU cache, whose rows the agent cannot address (the prefill
  // side copies them out and frees its blocks at once; the decode side copies them in when they arrive); on the
  // CPU only for the tests of that path.
  bool stage_through_host = false;
};

// vLLM's --kv-transfer-config (KVTransferConfig) as sparrow takes it; what the engine and the agent need.
struct KvTransferConfig {
  std::string connector;    // kv_connector: NixlConnector or UcxConnector (both: sparrow's protocol on UCX)
  std::string role;         // kv_role: kv_producer | kv_consumer | kv_both
  std::string ip = "127.0.0.1";  // kv_ip: where the agent listens
  int port = 14579;              // kv_port (vLLM's default); 0: any free port
  std::string advertise_host;    // kv_connector_extra_config.advertise_host: the host peers dial (default kv_ip)
  KvTransferSettings settings;   // agent left null: the caller makes it
};
// Parses the JSON; anything malformed, an unknown connector or role, or a field vLLM does not have is a
// one-line sparrow::Error naming it. Fields of vLLM's with no meaning here (kv_buffer_size, kv_rank, ...)
// are accepted.
KvTransferConfig parse_kv_transfer_config(const std::string& json);

// Disaggregation's counters (/metrics: sparrow:kv_transfer_*).
struct KvTransferStats {
  int64_t offers = 0, offers_fetched = 0, offers_failed = 0;  // prefill side
  int64_t fetches = 0, fetches_failed = 0;                    // decode side
  int64_t regions = 0, bytes = 0;                             // fetched
  double fetch_seconds = 0;
  int64_t tokens_from_prefix_cache = 0;  // decode side: prompt tokens a local hit spared the transfer
};

}  // namespace sparrow
