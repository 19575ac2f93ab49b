// The KV transfer agent (core/kv_transfer.h) on UCX (Debian's libucx; docs/disaggregation.md): UCX picks the
// transport between two agents — shared memory or CMA on one host, TCP, or RDMA where the NICs have it.
//
// Wire protocol, all on one UCX endpoint per pair of agents (the consumer connects to the producer's listener):
//   consumer -> producer  active message "fetch": ticket, transfer id, the wanted region indices as runs;
//   producer -> consumer  one tagged message per region (tag = ticket << 24 | index), straight from the
//                         offered memory into the consumer's (UCX's rendezvous: one RDMA read where it can);
//   producer -> consumer  active message "reply": ticket, ok or the reason, once every region was sent.
// A peer that dies fails its fetches and offers through the endpoint's error handler (UCX's peer error mode).
#pragma once
#include <memory>
#include <string>

#include "core/kv_transfer.h"

namespace sparrow {

// Listens on `listen_host`:`port` ("0.0.0.0" for every interface; port 0 for any free one) and tells
// consumers to connect to `advertised_host` (the prefill instance's name as the decode instance reaches
// it) and the port it got. Throws sparrow::Error when UCX cannot start or the port is taken.
std::unique_ptr<KvTransferAgent> make_ucx_kv_transfer(const std::string& listen_host, int port,
                                                      const std::string& advertised_host);

}  // namespace sparrow
