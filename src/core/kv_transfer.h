// Prefill/decode disaggregation's transport (docs/disaggregation.md): a prefill instance offers a finished
// prompt's cache — its block rows, one region each, and its recurrent state — under a transfer id; the decode
// instance that continues the request fetches the regions it lacks into block rows of its own cache, one
// message per block row. The engine holds the agent through this interface only (src/distributed has the
// backend: UCX, Debian's libucx), as it holds collectives through core/communicator.h.
//
// Threads: every call is made from the engine's thread; the agent moves bytes on its own thread, and the
// outcomes come back through poll(). A region's memory must stay valid, and unwritten by anyone else, until
// its offer's or fetch's completion has been returned by poll().
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace sparrow {

// Bytes of this process's host memory.
struct KvRegion {
  std::byte* data = nullptr;
  int64_t bytes = 0;
};

// Where a peer agent listens.
struct KvPeer {
  std::string host;
  int port = 0;
};

struct KvTransferCompletion {
  enum class Kind { Offer, Fetch };
  Kind kind = Kind::Offer;
  std::string id;       // the offer's transfer id (both kinds)
  uint64_t ticket = 0;  // a fetch's, as fetch() returned it
  bool ok = false;
  std::string error;    // when not ok: why (the peer died, the offer expired or was unknown, cancelled)
  int64_t regions = 0;  // regions moved (one message each)
  int64_t bytes = 0;    // bytes moved
  double seconds = 0;   // from the request to the last byte (a fetch: as the consumer saw it)
};

class KvTransferAgent {
 public:
  virtual ~KvTransferAgent() = default;

  // Where consumers reach this agent (what the prefill instance puts in a response's kv_transfer_params).
  virtual KvPeer address() const = 0;
  // The transport, for logs: "ucx".
  virtual std::string backend() const = 0;

  // Producer: serves `regions` (region i is index i of a fetch) under `id` to one consumer. The offer ends
  // once a fetch of it was answered (sent, or failed with the consumer), or after `expiry` unfetched; poll()
  // then returns its completion and the memory is the caller's again.
  virtual void offer(const std::string& id, std::vector<KvRegion> regions, std::chrono::milliseconds expiry) = 0;
  // Producer: ends an offer now (a completion with ok false follows; one being sent finishes sending first).
  virtual void withdraw(const std::string& id) = 0;

  // Consumer: fills each wanted pair's region with region `first` of `peer`'s offer `id`, one message each;
  // returns the fetch's ticket. A fetch not done within `timeout` fails.
  virtual uint64_t fetch(const KvPeer& peer, const std::string& id, std::vector<std::pair<int64_t, KvRegion>> wanted,
                         std::chrono::milliseconds timeout) = 0;
  // Consumer: gives up a fetch (its completion, ok false, still comes, and only then is its memory free).
  virtual void cancel(uint64_t ticket) = 0;

  // The offers and fetches that ended since the last call; never blocks.
  virtual std::vector<KvTransferCompletion> poll() = 0;
};

}  // namespace sparrow
