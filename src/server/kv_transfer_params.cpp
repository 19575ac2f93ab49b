#include "server/kv_transfer_params.h"

namespace sparrow::server {

KvTransferRequest parse_kv_transfer_params(const Fields& request) {
  KvTransferRequest out;
  const Json* params = request.object("kv_transfer_params");
  if (!params) return out;
  const Fields f(*params, "kv_transfer_params");
  out.remote_decode = f.boolean("do_remote_decode").value_or(false);
  if (!f.boolean("do_remote_prefill").value_or(false)) return out;
  KvHandoff h;
  auto required = [&](const char* name) {
    if (!f.has(name)) f.invalid(name, "is required with do_remote_prefill (the prefill instance's response has it)");
  };
  for (const char* name : {"remote_request_id", "remote_host", "remote_port", "remote_block_ids", "num_tokens",
                           "cache_layout", "first_token"})
    required(name);
  h.transfer_id = *f.string("remote_request_id");
  h.engine_id = f.string("remote_engine_id").value_or("");
  h.peer.host = *f.string("remote_host");
  h.peer.port = int(*f.integer("remote_port"));
  const std::vector<int64_t> block_ids = *f.integers("remote_block_ids");  // (not a temporary's inside)
  for (const int64_t id : block_ids) {
    if (id < 0 || id > INT32_MAX) f.invalid("remote_block_ids", "holds a block id out of range");
    h.block_ids.push_back(int32_t(id));
  }
  h.num_tokens = *f.integer("num_tokens");
  h.cache_layout = *f.string("cache_layout");
  const int64_t first = *f.integer("first_token");
  if (first < 0 || first > INT32_MAX) f.invalid("first_token", "is out of range");
  h.first_token = int32_t(first);
  if (auto tp = f.integer("tp_size"); tp && *tp != 1)
    f.invalid("tp_size", "a prefill instance of tensor-parallel size " + std::to_string(*tp) +
                             ": disaggregation pairs single-rank instances so far");
  if (const Json* logprob = f.object("first_logprob")) {
    const Fields l(*logprob, "kv_transfer_params.first_logprob");
    TokenLogprob lp;
    lp.token = int32_t(l.integer("token").value_or(-1));
    lp.logprob = float(l.number("logprob").value_or(0));
    lp.rank = l.integer("rank").value_or(1);
    if (const Json* top = l.get("top")) {
      if (!top->is_array()) l.invalid("top", "must be a list of [token, logprob] pairs");
      for (const Json& pair : *top) {
        if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() || !pair[1].is_number())
          l.invalid("top", "must be a list of [token, logprob] pairs");
        lp.top.push_back({pair[0].get<int32_t>(), pair[1].get<float>()});
      }
    }
    h.first_logprob = std::move(lp);
  }
  out.remote_prefill = std::move(h);  // (with do_remote_decode too: EngineCore::validate refuses the pair)
  return out;
}

Json kv_transfer_params_json(const KvHandoff& h) {
  Json out = {{"do_remote_prefill", true},
              {"do_remote_decode", false},
              {"remote_engine_id", h.engine_id},
              {"remote_request_id", h.transfer_id},
              {"remote_host", h.peer.host},
              {"remote_port", h.peer.port},
              {"remote_block_ids", h.block_ids},
              {"tp_size", 1},
              {"num_tokens", h.num_tokens},
              {"cache_layout", h.cache_layout},
              {"first_token", h.first_token}};
  if (h.first_logprob) {
    Json top = Json::array();
    for (const auto& [token, logprob] : h.first_logprob->top) top.push_back({token, logprob});
    out["first_logprob"] = {{"token", h.first_logprob->token},
                            {"logprob", h.first_logprob->logprob},
                            {"rank", h.first_logprob->rank},
                            {"top", std::move(top)}};
  }
  return out;
}

}  // namespace sparrow::server
