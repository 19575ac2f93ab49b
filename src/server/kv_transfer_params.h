// vLLM's kv_transfer_params (docs/disaggregation.md): the field a P/D proxy sets on the request it sends a
// prefill instance ({"do_remote_decode": true}), the one the prefill instance answers with (the handoff: where
// and what to fetch, vLLM's NixlConnector names plus the first token), and the decode instance's request
// carrying that answer back ({"do_remote_prefill": true, ...}).
#pragma once
#include "engine/kv_handoff.h"
#include "server/json_fields.h"

namespace sparrow::server {

// The request body's "kv_transfer_params" (absent or null: none). A malformed one is a 400 naming the field.
KvTransferRequest parse_kv_transfer_params(const Fields& request);
// The prefill instance's response field.
Json kv_transfer_params_json(const KvHandoff& handoff);

}  // namespace sparrow::server
