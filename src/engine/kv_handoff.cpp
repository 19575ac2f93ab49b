// EngineCore's side of prefill/decode disaggregation (engine/kv_handoff.h, docs/disaggregation.md).
#include <algorithm>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"
#include "engine/engine_core.h"

namespace sparrow {
namespace {

// A GPU cache's regions go through host memory (KvTransferSettings::stage_through_host): `host` becomes one buffer
// holding them back to back and each region is pointed at its slice; returned are the regions as they were, in
// order, for the copies between the pool and the buffer.
std::vector<KvRegion> stage_in_host(const std::vector<KvRegion*>& regions, std::vector<std::byte>& host) {
  int64_t total = 0;
  for (const KvRegion* r : regions) total += r->bytes;
  host.resize(size_t(total));
  std::vector<KvRegion> in_pool;
  std::byte* at = host.data();
  for (KvRegion* r : regions) {
    in_pool.push_back(*r);
    r->data = at;
    at += r->bytes;
  }
  return in_pool;
}

}  // namespace

void EngineCore::validate_kv_transfer(const Request& request) const {
  const KvTransferSettings& kv = config_.kv_transfer;
  const KvTransferRequest& transfer = request.kv_transfer;
  const SamplingParams& p = request.params;
  SPARROW_CHECK(!(transfer.remote_decode && transfer.remote_prefill),
                "kv_transfer_params: do_remote_decode and do_remote_prefill are the two ends of a pair, not both");
  SPARROW_CHECK(p.n == 1, "kv_transfer_params: a disaggregated request has one choice (n = 1), not ", p.n);
  if (transfer.remote_decode) {
    SPARROW_CHECK(kv.agent && kv.produces, "kv_transfer_params: do_remote_decode asks this instance to prefill for a "
                  "decode instance, but it runs without --kv-transfer-config kv_role kv_producer or kv_both");
    return;
  }
  const KvHandoff& h = *transfer.remote_prefill;
  SPARROW_CHECK(kv.agent && kv.consumes, "kv_transfer_params: do_remote_prefill asks this instance to decode from a "
                "prefill instance's cache, but it runs without --kv-transfer-config kv_role kv_consumer or kv_both");
  SPARROW_CHECK(!proposer_, "kv_transfer_params: speculative decoding on a decode instance is not supported yet (its "
                "drafter never saw the prompt)");
  SPARROW_CHECK(p.prompt_logprobs < 0, "kv_transfer_params: prompt_logprobs need the prompt's logits, which only the "
                "prefill instance computed; ask it, not the decode instance");
  SPARROW_CHECK(h.num_tokens == int64_t(request.prompt.size()), "kv_transfer_params: the prefill instance computed ",
                h.num_tokens, " prompt tokens, this request has ", request.prompt.size(),
                " (the proxy must send both instances the same prompt)");
  SPARROW_CHECK(h.first_token >= 0 && h.first_token < model_.vocab_size(), "kv_transfer_params: first token id ",
                h.first_token, " is outside the vocabulary [0, ", model_.vocab_size(), ")");
  SPARROW_CHECK(p.logprobs < 0 || (h.first_logprob && int64_t(h.first_logprob->top.size()) >= p.logprobs &&
                                   h.first_logprob->token == h.first_token),
                "kv_transfer_params: the request asks for logprobs, but the handoff has none for the first token (the "
                "prefill request must ask for the same logprobs)");
  if (h.transfer_id.empty()) return;  // the first token ended the request: nothing to fetch
  const std::string layout = cache_.plan().layout_key();
  SPARROW_CHECK(h.cache_layout == layout, "kv_transfer_params: the prefill instance's cache rows (", h.cache_layout,
                ") differ from this instance's (", layout, "): serve both with the same model, --block-size, "
                "--kv-cache-dtype and --attention-config");
  const int64_t block = cache_.plan().block_size;
  SPARROW_CHECK(int64_t(h.block_ids.size()) == (h.num_tokens + block - 1) / block, "kv_transfer_params: ",
                h.block_ids.size(), " remote blocks for ", h.num_tokens, " tokens of ", block);
  SPARROW_CHECK(!h.peer.host.empty() && h.peer.port > 0 && h.peer.port < 65536,
                "kv_transfer_params: remote_host and remote_port must name the prefill instance's transfer agent");
}

void EngineCore::hand_off_on_finish(Sequence& seq, RequestOutput& event) {
  KvTransferAgent* agent = config_.kv_transfer.agent;
  // Decode side: a choice that ends before its fetch did (an abort) lets the fetch go; its blocks are freed
  // when the agent says the fetch stopped writing them (settle_transfers).
  std::erase(handoffs_waiting_, &seq);
  for (PendingFetch& f : fetches_)
    if (f.seq == &seq) {
      agent->cancel(f.ticket);
      f.seq = nullptr;
      seq.cache_id = -1;  // the fetch's now; scheduler_.remove must not free it
    }
  // Prefill side: the first token came out and the request ends as asked ("length"); its cache goes to the
  // decode instance. A first token that stopped the request (or an abort, an error) hands nothing over.
  if (!seq.request.kv_transfer.remote_decode || seq.cache_id < 0) return;
  if (event.finish_reason != "length" && event.finish_reason != "stop") return;  // aborted, failed: nothing to hand
  KvHandoff handoff;
  handoff.engine_id = config_.kv_transfer.engine_id;
  handoff.peer = agent->address();
  handoff.num_tokens = seq.num_computed();
  handoff.cache_layout = cache_.plan().layout_key();
  handoff.first_token = seq.tokens.at(size_t(seq.prompt_length));
  if (!event.logprobs.empty()) handoff.first_logprob = event.logprobs.front();
  if (event.finish_reason == "length" && seq.num_computed() == seq.prompt_length) {
    // Its full blocks enter this instance's prefix cache too (a later prompt sharing them hits here).
    cache_.commit_tokens(seq.cache_id, seq.tokens, seq.num_computed());
    handoff.transfer_id = seq.request.id + "#" + std::to_string(next_transfer_++);
    handoff.block_ids = cache_.block_table(seq.cache_id);
    std::vector<KvRegion> regions = cache_.transfer_regions(seq.cache_id);
    Offer& offer = offered_[handoff.transfer_id];
    if (stages_kv_transfers()) {
      // The rows and state to host memory; the blocks are free again at once.
      std::vector<KvRegion*> staged;
      for (KvRegion& r : regions) staged.push_back(&r);
      const std::vector<KvRegion> in_pool = stage_in_host(staged, offer.staging);
      for (size_t i = 0; i < regions.size(); ++i) cache_.copy_out(in_pool[i], regions[i].data);
      cache_.free_sequence(seq.cache_id);
    } else {
      offer.cache_id = seq.cache_id;  // the offer's until it ends
    }
    seq.cache_id = -1;
    agent->offer(handoff.transfer_id, std::move(regions), config_.kv_transfer.offer_expiry);
    ++kv_stats_.offers;
  }
  event.kv_handoff = std::move(handoff);
}

bool EngineCore::stages_kv_transfers() const {
  return config_.kv_transfer.stage_through_host || cache_.device() != Device::Cpu;
}

void EngineCore::start_fetches() {
  KvTransferAgent* agent = config_.kv_transfer.agent;
  while (!handoffs_waiting_.empty()) {
    Sequence& seq = *handoffs_waiting_.front();
    const KvHandoff& h = *seq.request.kv_transfer.remote_prefill;
    if (h.transfer_id.empty()) {
      // Nothing was offered: the first token ended the request there, and ends it here the same way.
      handoffs_waiting_.pop_front();
      seq.first_scheduled = std::chrono::steady_clock::now();
      if (emit(seq, h.first_token, {}, h.first_logprob ? &*h.first_logprob : nullptr)) {
        RequestOutput event = new_event(seq);
        event.finish_reason = "error";
        std::fprintf(stderr, "sparrow: kv transfer: request %s: the prefill instance offered no cache, but its first "
                     "token does not end the request here\n", seq.request.id.c_str());
        finish(seq, event);
      }
      continue;
    }
    // Like an admission (Scheduler::admit_next): a sequence slot, a state slot, and blocks for the prompt.
    if (scheduler_.num_running() + int64_t(fetches_.size()) >= config_.max_num_seqs ||
        cache_.num_free_state_slots() == 0)
      return;
    seq.cache_id = scheduler_.open_cache_sequence(seq);
    const int64_t reused = cache_.match_prefix(seq.cache_id, seq.tokens);
    if (!cache_.allocate(seq.cache_id, h.num_tokens)) {
      cache_.free_sequence(seq.cache_id);
      seq.cache_id = -1;
      return;  // in arrival order: the next ones wait too
    }
    handoffs_waiting_.pop_front();
    const std::vector<KvRegion> regions = cache_.transfer_regions(seq.cache_id);
    const int64_t blocks = int64_t(h.block_ids.size());
    // The rows a prefix-cache hit holds already stay out of the fetch; the state always comes.
    std::vector<std::pair<int64_t, KvRegion>> wanted;
    for (int64_t i = reused / cache_.plan().block_size; i < blocks; ++i) wanted.push_back({i, regions[size_t(i)]});
    if (int64_t(regions.size()) > blocks) wanted.push_back({blocks, regions.back()});
    PendingFetch fetch{&seq, 0, seq.cache_id, {}, {}};
    if (stages_kv_transfers()) {
      // Into host memory first; settle_transfers copies each piece to its place in the pool.
      std::vector<KvRegion*> staged;
      for (auto& [index, region] : wanted) staged.push_back(&region);
      fetch.landing = stage_in_host(staged, fetch.staging);
    }
    seq.cached_tokens = reused;
    kv_stats_.tokens_from_prefix_cache += reused;
    seq.first_scheduled = std::chrono::steady_clock::now();
    fetch.ticket = agent->fetch(h.peer, h.transfer_id, std::move(wanted), config_.kv_transfer.fetch_timeout);
    fetches_.push_back(std::move(fetch));
    ++kv_stats_.fetches;
  }
}

void EngineCore::settle_transfers() {
  for (const KvTransferCompletion& done : config_.kv_transfer.agent->poll()) {
    if (done.kind == KvTransferCompletion::Kind::Offer) {
      auto it = offered_.find(done.id);
      if (it == offered_.end()) continue;
      if (it->second.cache_id >= 0) cache_.free_sequence(it->second.cache_id);
      offered_.erase(it);
      ++(done.ok ? kv_stats_.offers_fetched : kv_stats_.offers_failed);
      if (!done.ok) std::fprintf(stderr, "sparrow: kv transfer: offer %s: %s\n", done.id.c_str(), done.error.c_str());
      continue;
    }
    auto it = std::find_if(fetches_.begin(), fetches_.end(), [&](const PendingFetch& f) { return f.ticket == done.ticket; });
    if (it == fetches_.end()) continue;
    const PendingFetch fetch = std::move(*it);
    fetches_.erase(it);
    if (done.ok) {
      kv_stats_.regions += done.regions;
      kv_stats_.bytes += done.bytes;
      kv_stats_.fetch_seconds += done.seconds;
    } else {
      ++kv_stats_.fetches_failed;
    }
    if (config_.kv_transfer.log_transfers || !done.ok)
      std::fprintf(stderr, "sparrow: kv transfer: fetch %s: %s, %lld messages, %lld bytes in %.3f ms (%.3f GB/s)%s%s\n",
                   done.id.c_str(), done.ok ? "ok" : "failed", (long long)done.regions, (long long)done.bytes,
                   done.seconds * 1e3, done.seconds > 0 ? double(done.bytes) / done.seconds / 1e9 : 0.0,
                   done.ok ? "" : ": ", done.error.c_str());
    if (!fetch.seq) {  // aborted meanwhile: the blocks are free to go now
      cache_.free_sequence(fetch.cache_id);
      continue;
    }
    Sequence& seq = *fetch.seq;
    if (!done.ok && config_.kv_transfer.recompute_on_failure) {
      // kv_load_failure_policy recompute: the prompt is prefilled here, as if no prefill instance had been.
      cache_.free_sequence(fetch.cache_id);
      seq.cache_id = -1;
      seq.cached_tokens = 0;
      scheduler_.add(&seq);
      continue;
    }
    if (!done.ok) {
      // Only this request fails; the instance serves on.
      RequestOutput event = new_event(seq);
      event.finish_reason = "error";
      finish(seq, event);
      continue;
    }
    const std::byte* staged = fetch.staging.data();
    for (const KvRegion& region : fetch.landing) {
      cache_.copy_in(staged, region);
      staged += region.bytes;
    }
    const KvHandoff& h = *seq.request.kv_transfer.remote_prefill;
    cache_.commit_tokens(seq.cache_id, seq.tokens, h.num_tokens);
    seq.state.cache = cache_.view(seq.cache_id);
    seq.state.length = h.num_tokens;
    // start_fetches kept it a sequence slot, which the scheduler left free (set_reserved_seqs).
    SPARROW_CHECK(scheduler_.add_running(&seq), "kv transfer: no sequence slot for a fetched request");
    if (seq.matcher && !seq.matcher->accept_token(h.first_token)) {
      finish_unmatched(seq);
      continue;
    }
    emit(seq, h.first_token, {}, h.first_logprob ? &*h.first_logprob : nullptr);
  }
}

KvTransferConfig parse_kv_transfer_config(const std::string& text) {
  const JsonInput<nlohmann::json> input = parse_json_input<nlohmann::json>(text);
  SPARROW_CHECK(input.ok() && input.value.is_object(), "--kv-transfer-config: expected a JSON object, got '", text, "'");
  const nlohmann::json& json = input.value;
  KvTransferConfig out;
  auto string_field = [&](const char* name, const nlohmann::json& value) {
    SPARROW_CHECK(value.is_string(), "--kv-transfer-config: ", name, " must be a string");
    return value.get<std::string>();
  };
  auto seconds = [&](const char* name, const nlohmann::json& value) {
    SPARROW_CHECK(value.is_number() && value.get<double>() > 0, "--kv-transfer-config: kv_connector_extra_config.",
                  name, " must be a positive number of seconds");
    return std::chrono::milliseconds(int64_t(value.get<double>() * 1000));
  };
  for (const auto& [key, value] : json.items()) {
    if (value.is_null()) continue;
    if (key == "kv_connector") {
      out.connector = string_field("kv_connector", value);
      SPARROW_CHECK(out.connector == "NixlConnector" || out.connector == "UcxConnector",
                    "--kv-transfer-config: kv_connector '", out.connector, "' is not one sparrow has: NixlConnector or "
                    "UcxConnector (either is sparrow's block-row transfer on UCX; it pairs sparrow instances)");
    } else if (key == "kv_role") {
      out.role = string_field("kv_role", value);
      SPARROW_CHECK(out.role == "kv_producer" || out.role == "kv_consumer" || out.role == "kv_both",
                    "--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, got '", out.role, "'");
    } else if (key == "kv_ip") {
      out.ip = string_field("kv_ip", value);
    } else if (key == "kv_port") {
      SPARROW_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 && value.get<int64_t>() < 65536,
                    "--kv-transfer-config: kv_port must be a port number (0: any free one)");
      out.port = value.get<int>();
    } else if (key == "engine_id") {
      out.settings.engine_id = string_field("engine_id", value);
    } else if (key == "kv_load_failure_policy") {
      const std::string policy = string_field("kv_load_failure_policy", value);
      SPARROW_CHECK(policy == "fail" || policy == "recompute",
                    "--kv-transfer-config: kv_load_failure_policy must be fail or recompute, got '", policy, "'");
      out.settings.recompute_on_failure = policy == "recompute";
    } else if (key == "kv_connector_extra_config") {
      SPARROW_CHECK(value.is_object(), "--kv-transfer-config: kv_connector_extra_config must be an object");
      for (const auto& [extra, v] : value.items()) {
        if (extra == "abort_timeout_s") out.settings.offer_expiry = seconds("abort_timeout_s", v);
        else if (extra == "fetch_timeout_s") out.settings.fetch_timeout = seconds("fetch_timeout_s", v);
        else if (extra == "advertise_host") out.advertise_host = string_field("advertise_host", v);
        else if (extra == "log_transfers") {
          SPARROW_CHECK(v.is_boolean(), "--kv-transfer-config: kv_connector_extra_config.log_transfers must be true or false");
          out.settings.log_transfers = v.get<bool>();
        } else {
          fail("--kv-transfer-config: kv_connector_extra_config.", extra, " is not one sparrow takes (abort_timeout_s, "
               "fetch_timeout_s, advertise_host, log_transfers)");
        }
      }
    } else if (key == "kv_buffer_device" || key == "kv_buffer_size" || key == "kv_rank" || key == "kv_parallel_size" ||
               key == "kv_connector_module_path" || key == "enable_permute_local_kv") {
      // vLLM's, with no meaning for sparrow's connector: accepted so that a vLLM command line runs.
    } else {
      fail("--kv-transfer-config: unknown field '", key, "' (vLLM's KVTransferConfig has kv_connector, kv_role, kv_ip, "
           "kv_port, engine_id, kv_load_failure_policy, kv_connector_extra_config, ...)");
    }
  }
  SPARROW_CHECK(!out.connector.empty(), "--kv-transfer-config: kv_connector is required (NixlConnector or UcxConnector)");
  SPARROW_CHECK(!out.role.empty(), "--kv-transfer-config: kv_role is required (kv_producer, kv_consumer or kv_both)");
  out.settings.produces = out.role != "kv_consumer";
  out.settings.consumes = out.role != "kv_producer";
  if (out.advertise_host.empty()) out.advertise_host = out.ip == "0.0.0.0" ? "127.0.0.1" : out.ip;
  if (out.settings.engine_id.empty()) {
    std::random_device random;
    char id[17];
    std::snprintf(id, sizeof(id), "%08x%08x", random(), random());
    out.settings.engine_id = id;
  }
  return out;
}

}  // namespace sparrow
