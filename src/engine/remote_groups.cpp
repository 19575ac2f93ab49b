#include "engine/remote_groups.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/error.h"
#include "core/wire.h"
#include "engine/engine.h"
#include "model/lora.h"
#include "model/model.h"

namespace sparrow {

namespace {

using wire::Reader;
using wire::Writer;

enum class Kind : uint8_t { Submit = 1, Abort = 2, Wave = 3, Stop = 4, Output = 5, Stats = 6, Done = 7 };

void put_strings(Writer& w, const std::vector<std::string>& texts) {
  w.put<uint64_t>(texts.size());
  for (const std::string& t : texts) w.put(t);
}
std::vector<std::string> get_strings(Reader& r) {
  std::vector<std::string> texts(r.get_count(8));
  for (std::string& t : texts) t = r.get_string();
  return texts;
}
void put_pairs(Writer& w, const std::vector<std::pair<int32_t, float>>& pairs) {
  w.put<uint64_t>(pairs.size());
  for (const auto& [token, value] : pairs) {
    w.put<int32_t>(token);
    w.put<float>(value);
  }
}
std::vector<std::pair<int32_t, float>> get_pairs(Reader& r) {
  std::vector<std::pair<int32_t, float>> pairs(r.get_count(8));
  for (auto& [token, value] : pairs) {
    token = r.get<int32_t>();
    value = r.get<float>();
  }
  return pairs;
}
void put_logprob(Writer& w, const TokenLogprob& lp) {
  w.put<int32_t>(lp.token);
  w.put<float>(lp.logprob);
  w.put<int64_t>(lp.rank);
  put_pairs(w, lp.top);
}
TokenLogprob get_logprob(Reader& r) {
  TokenLogprob lp;
  lp.token = r.get<int32_t>();
  lp.logprob = r.get<float>();
  lp.rank = r.get<int64_t>();
  lp.top = get_pairs(r);
  return lp;
}
void put_counters(Writer& w, const StepCounters& c) {
  w.put<int64_t>(c.steps);
  w.put<double>(c.seconds);
  w.put<double>(c.forward_seconds);
}
StepCounters get_counters(Reader& r) {
  StepCounters c;
  c.steps = r.get<int64_t>();
  c.seconds = r.get<double>();
  c.forward_seconds = r.get<double>();
  return c;
}

// A message on a link: u64 length, then its kind and body.
void send_message(Communicator& link, int peer, Kind kind, const std::vector<uint8_t>& body) {
  std::vector<uint8_t> bytes(1 + body.size());
  bytes[0] = uint8_t(kind);
  std::copy(body.begin(), body.end(), bytes.begin() + 1);
  const int64_t size = int64_t(bytes.size());
  link.send(&size, sizeof(size), peer);
  link.send(bytes.data(), size, peer);
}
std::pair<Kind, std::vector<uint8_t>> receive_message(Communicator& link, int peer) {
  int64_t size = 0;
  link.recv(&size, sizeof(size), peer);
  SPARROW_CHECK(size >= 1 && size < (int64_t(1) << 34), "data-parallel link: a message of ", size, " bytes");
  std::vector<uint8_t> bytes(size_t(size), 0);
  link.recv(bytes.data(), size, peer);
  const uint8_t kind = bytes[0];
  SPARROW_CHECK(kind >= uint8_t(Kind::Submit) && kind <= uint8_t(Kind::Done), "data-parallel link: unknown message ",
                int(kind));
  return {Kind(kind), std::vector<uint8_t>(bytes.begin() + 1, bytes.end())};
}

std::vector<uint8_t> encode_id(const std::string& id) {
  Writer w;
  w.put(id);
  return std::move(w.bytes);
}
std::vector<uint8_t> encode_wave(int64_t wave) {
  Writer w;
  w.put<int64_t>(wave);
  return std::move(w.bytes);
}

}  // namespace

std::vector<uint8_t> encode_request(const Request& request) {
  Writer w;
  w.put(request.id);
  w.put(request.prompt);
  const SamplingParams& p = request.params;
  w.put<float>(p.temperature);
  w.put<float>(p.top_p);
  w.put<float>(p.min_p);
  w.put<int64_t>(p.top_k);
  w.put<float>(p.repetition_penalty);
  w.put<float>(p.presence_penalty);
  w.put<float>(p.frequency_penalty);
  w.put<uint8_t>(p.seed.has_value());
  w.put<uint64_t>(p.seed.value_or(0));
  w.put<int64_t>(p.max_tokens);
  w.put<int64_t>(p.min_tokens);
  w.put<uint8_t>(p.ignore_eos);
  put_strings(w, p.stop);
  w.put(p.stop_token_ids);
  w.put<uint8_t>(p.include_stop_str_in_output);
  w.put<int64_t>(p.logprobs);
  w.put<int64_t>(p.prompt_logprobs);
  w.put<int64_t>(p.n);
  w.put<uint8_t>(p.skip_special_tokens);
  w.put<uint8_t>(uint8_t(p.structured.kind));
  w.put(p.structured.text);
  put_strings(w, p.structured.choices);
  w.put<uint8_t>(p.structured.any_whitespace);
  put_strings(w, p.structured.special_tokens);
  w.put(p.structured.start_after);
  put_pairs(w, p.logit_bias);
  w.put<uint8_t>(p.allowed_token_ids.has_value());
  w.put(p.allowed_token_ids.value_or(std::vector<int32_t>{}));
  w.put<uint8_t>(request.lora != nullptr);
  if (request.lora) {
    w.put(request.lora->name);
    w.put(request.lora->path);
    w.put(request.lora->base_model);
    w.put<int64_t>(request.lora->max_rank);
  }
  w.put<uint64_t>(request.images.size());
  for (const vision::ImageInput& image : request.images) {
    w.put<int64_t>(image.offset);
    w.put<int64_t>(image.tokens);
    w.put<int64_t>(image.grid.t);
    w.put<int64_t>(image.grid.h);
    w.put<int64_t>(image.grid.w);
    w.put<uint64_t>(image.hash);
    w.put<int64_t>(image.pixel_values.dim(1));
    w.put(std::vector<float>(image.pixel_values.data(), image.pixel_values.data() + image.pixel_values.numel()));
  }
  return std::move(w.bytes);
}

Request decode_request(const std::vector<uint8_t>& bytes, StepPlan::LoraSource* lora) {
  Reader r(bytes, "request");
  Request request;
  request.id = r.get_string();
  request.prompt = r.get_vector<int32_t>();
  SamplingParams& p = request.params;
  p.temperature = r.get<float>();
  p.top_p = r.get<float>();
  p.min_p = r.get<float>();
  p.top_k = r.get<int64_t>();
  p.repetition_penalty = r.get<float>();
  p.presence_penalty = r.get<float>();
  p.frequency_penalty = r.get<float>();
  const bool seeded = r.get<uint8_t>() != 0;
  const uint64_t seed = r.get<uint64_t>();
  if (seeded) p.seed = seed;
  p.max_tokens = r.get<int64_t>();
  p.min_tokens = r.get<int64_t>();
  p.ignore_eos = r.get<uint8_t>() != 0;
  p.stop = get_strings(r);
  p.stop_token_ids = r.get_vector<int32_t>();
  p.include_stop_str_in_output = r.get<uint8_t>() != 0;
  p.logprobs = r.get<int64_t>();
  p.prompt_logprobs = r.get<int64_t>();
  p.n = r.get<int64_t>();
  p.skip_special_tokens = r.get<uint8_t>() != 0;
  const uint8_t kind = r.get<uint8_t>();
  SPARROW_CHECK(kind <= uint8_t(structured::StructuredOutputSpec::Kind::Grammar), "request: unknown structured kind ",
                int(kind));
  p.structured.kind = structured::StructuredOutputSpec::Kind(kind);
  p.structured.text = r.get_string();
  p.structured.choices = get_strings(r);
  p.structured.any_whitespace = r.get<uint8_t>() != 0;
  p.structured.special_tokens = get_strings(r);
  p.structured.start_after = r.get_vector<int32_t>();
  p.logit_bias = get_pairs(r);
  const bool allowed = r.get<uint8_t>() != 0;
  std::vector<int32_t> allowed_ids = r.get_vector<int32_t>();
  if (allowed) p.allowed_token_ids = std::move(allowed_ids);
  StepPlan::LoraSource source;
  if (r.get<uint8_t>() != 0) {
    source.name = r.get_string();
    source.path = r.get_string();
    source.base_model = r.get_string();
    source.max_rank = r.get<int64_t>();
    SPARROW_CHECK(!source.name.empty(), "request: a LoRA adapter without a name");
  }
  for (uint64_t n = r.get<uint64_t>(); n > 0; --n) {
    vision::ImageInput image;
    image.offset = r.get<int64_t>();
    image.tokens = r.get<int64_t>();
    image.grid.t = r.get<int64_t>();
    image.grid.h = r.get<int64_t>();
    image.grid.w = r.get<int64_t>();
    image.hash = r.get<uint64_t>();
    const int64_t width = r.get<int64_t>();
    const std::vector<float> values = r.get_vector<float>();
    SPARROW_CHECK(width > 0 && !values.empty() && int64_t(values.size()) % width == 0, "request: an image of ",
                  values.size(), " values in rows of ", width);
    image.pixel_values = Tensor::empty({int64_t(values.size()) / width, width});
    std::copy(values.begin(), values.end(), image.pixel_values.data());
    request.images.push_back(std::move(image));
  }
  r.finish();
  if (lora) *lora = std::move(source);
  return request;
}

std::vector<uint8_t> encode_output(const RequestOutput& e) {
  Writer w;
  w.put(e.request_id);
  w.put<int64_t>(e.index);
  w.put(e.new_tokens);
  w.put(e.new_text);
  w.put<uint64_t>(e.logprobs.size());
  for (const TokenLogprob& lp : e.logprobs) put_logprob(w, lp);
  w.put<uint64_t>(e.prompt_logprobs.size());
  for (const std::optional<TokenLogprob>& lp : e.prompt_logprobs) {
    w.put<uint8_t>(lp.has_value());
    if (lp) put_logprob(w, *lp);
  }
  w.put<uint8_t>(e.finished);
  w.put(e.finish_reason);
  if (!e.stop_reason) {
    w.put<uint8_t>(0);
  } else if (const auto* text = std::get_if<std::string>(&*e.stop_reason)) {
    w.put<uint8_t>(1);
    w.put(*text);
  } else {
    w.put<uint8_t>(2);
    w.put<int32_t>(std::get<int32_t>(*e.stop_reason));
  }
  w.put<int64_t>(e.prompt_tokens);
  w.put<int64_t>(e.completion_tokens);
  w.put<int64_t>(e.cached_tokens);
  w.put<uint8_t>(e.first_scheduled.has_value());
  const auto age = e.first_scheduled ? std::chrono::steady_clock::now() - *e.first_scheduled
                                     : std::chrono::steady_clock::duration::zero();
  w.put<int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(age).count());
  return std::move(w.bytes);
}

RequestOutput decode_output(const std::vector<uint8_t>& bytes) {
  Reader r(bytes, "request output");
  RequestOutput e;
  e.request_id = r.get_string();
  e.index = r.get<int64_t>();
  e.new_tokens = r.get_vector<int32_t>();
  e.new_text = r.get_string();
  e.logprobs.resize(r.get_count(24));
  for (TokenLogprob& lp : e.logprobs) lp = get_logprob(r);
  e.prompt_logprobs.resize(r.get_count(1));
  for (std::optional<TokenLogprob>& lp : e.prompt_logprobs)
    if (r.get<uint8_t>() != 0) lp = get_logprob(r);
  e.finished = r.get<uint8_t>() != 0;
  e.finish_reason = r.get_string();
  const uint8_t stop = r.get<uint8_t>();
  SPARROW_CHECK(stop <= 2, "request output: unknown stop reason kind ", int(stop));
  if (stop == 1) e.stop_reason = r.get_string();
  if (stop == 2) e.stop_reason = r.get<int32_t>();
  e.prompt_tokens = r.get<int64_t>();
  e.completion_tokens = r.get<int64_t>();
  e.cached_tokens = r.get<int64_t>();
  const bool scheduled = r.get<uint8_t>() != 0;
  const int64_t age_us = r.get<int64_t>();
  if (scheduled) e.first_scheduled = std::chrono::steady_clock::now() - std::chrono::microseconds(age_us);
  r.finish();
  return e;
}

std::vector<uint8_t> encode_stats(const EngineStats& s) {
  Writer w;
  for (int64_t v : {s.running, s.waiting, s.kv_blocks_used, s.kv_blocks_total, s.prefix_queries, s.prefix_hits,
                    s.preemptions, s.prompt_tokens_total, s.generation_tokens_total})
    w.put<int64_t>(v);
  put_counters(w, s.decode_steps);
  put_counters(w, s.prefill_steps);
  for (int64_t n : s.iteration_tokens.steps_by_log2) w.put<int64_t>(n);
  w.put<int64_t>(s.iteration_tokens.tokens);
  for (int64_t v : {s.spec_decode.drafts, s.spec_decode.draft_tokens, s.spec_decode.accepted_tokens}) w.put<int64_t>(v);
  w.put(s.spec_decode.accepted_by_position);
  w.put<int64_t>(s.mm_cache_queries);
  w.put<int64_t>(s.mm_cache_hits);
  w.put<double>(s.encoder_seconds);
  return std::move(w.bytes);
}

EngineStats decode_stats(const std::vector<uint8_t>& bytes) {
  Reader r(bytes, "engine statistics");
  EngineStats s;
  for (int64_t* v : {&s.running, &s.waiting, &s.kv_blocks_used, &s.kv_blocks_total, &s.prefix_queries, &s.prefix_hits,
                     &s.preemptions, &s.prompt_tokens_total, &s.generation_tokens_total})
    *v = r.get<int64_t>();
  s.decode_steps = get_counters(r);
  s.prefill_steps = get_counters(r);
  for (int64_t& n : s.iteration_tokens.steps_by_log2) n = r.get<int64_t>();
  s.iteration_tokens.tokens = r.get<int64_t>();
  for (int64_t* v : {&s.spec_decode.drafts, &s.spec_decode.draft_tokens, &s.spec_decode.accepted_tokens})
    *v = r.get<int64_t>();
  s.spec_decode.accepted_by_position = r.get_vector<int64_t>();
  s.mm_cache_queries = r.get<int64_t>();
  s.mm_cache_hits = r.get<int64_t>();
  s.encoder_seconds = r.get<double>();
  r.finish();
  return s;
}

void add_stats(EngineStats& a, const EngineStats& b) {
  a.running += b.running;
  a.waiting += b.waiting;
  a.kv_blocks_used += b.kv_blocks_used;
  a.kv_blocks_total += b.kv_blocks_total;
  a.prefix_queries += b.prefix_queries;
  a.prefix_hits += b.prefix_hits;
  a.preemptions += b.preemptions;
  a.prompt_tokens_total += b.prompt_tokens_total;
  a.generation_tokens_total += b.generation_tokens_total;
  for (auto [into, from] : {std::pair{&a.decode_steps, &b.decode_steps}, std::pair{&a.prefill_steps, &b.prefill_steps}}) {
    into->steps += from->steps;
    into->seconds += from->seconds;
    into->forward_seconds += from->forward_seconds;
  }
  for (size_t k = 0; k < a.iteration_tokens.steps_by_log2.size(); ++k)
    a.iteration_tokens.steps_by_log2[k] += b.iteration_tokens.steps_by_log2[k];
  a.iteration_tokens.tokens += b.iteration_tokens.tokens;
  a.spec_decode.drafts += b.spec_decode.drafts;
  a.spec_decode.draft_tokens += b.spec_decode.draft_tokens;
  a.spec_decode.accepted_tokens += b.spec_decode.accepted_tokens;
  std::vector<int64_t>& by_position = a.spec_decode.accepted_by_position;
  if (by_position.size() < b.spec_decode.accepted_by_position.size())
    by_position.resize(b.spec_decode.accepted_by_position.size());
  for (size_t i = 0; i < b.spec_decode.accepted_by_position.size(); ++i) by_position[i] += b.spec_decode.accepted_by_position[i];
  a.mm_cache_queries += b.mm_cache_queries;
  a.mm_cache_hits += b.mm_cache_hits;
  a.encoder_seconds += b.encoder_seconds;
}

// ---------------------------------------------------------------------------------------------
// Rank 0.

struct RemoteGroups::Link {
  Communicator* comm = nullptr;
  int group = 0;
  std::mutex send_mutex;  // one message at a time (requests come from the server's threads)
  mutable std::mutex mutex;  // guards what follows
  struct Pending {
    OutputCallback on_output;
    int64_t unfinished = 0;
  };
  std::map<std::string, Pending> requests;
  EngineStats stats;
  bool stopping = false;
  std::thread reader;

  void send(Kind kind, const std::vector<uint8_t>& body) {
    std::lock_guard lock(send_mutex);
    send_message(*comm, 1, kind, body);
  }
};

RemoteGroups::RemoteGroups(std::vector<Communicator*> links) {
  for (size_t i = 0; i < links.size(); ++i) {
    SPARROW_CHECK(links[i] && links[i]->size() == 2 && links[i]->rank() == 0,
                  "a data-parallel link is a group of two, rank 0 the server's end");
    auto link = std::make_unique<Link>();
    link->comm = links[i];
    link->group = int(i) + 1;
    links_.push_back(std::move(link));
  }
  for (auto& link : links_) link->reader = std::thread([this, l = link.get()] { read(*l); });
}

RemoteGroups::~RemoteGroups() {
  for (auto& link : links_) {
    {
      std::lock_guard lock(link->mutex);
      link->stopping = true;
    }
    try {
      link->send(Kind::Stop, {});
    } catch (const Error&) {
      // Gone already: its reader has ended.
    }
  }
  for (auto& link : links_) link->reader.join();
}

void RemoteGroups::submit(int group, const Request& request, OutputCallback on_output) {
  SPARROW_CHECK(group >= 1 && group <= size(), "no data-parallel group ", group);
  Link& link = *links_[size_t(group - 1)];
  {
    std::lock_guard lock(link.mutex);
    link.requests[request.id] = {std::move(on_output), request.params.n};
  }
  link.send(Kind::Submit, encode_request(request));
}

void RemoteGroups::abort(int group, const std::string& request_id) {
  SPARROW_CHECK(group >= 1 && group <= size(), "no data-parallel group ", group);
  links_[size_t(group - 1)]->send(Kind::Abort, encode_id(request_id));
}

void RemoteGroups::start_wave(int64_t wave) {
  for (auto& link : links_) link->send(Kind::Wave, encode_wave(wave));
}

EngineStats RemoteGroups::stats() const {
  EngineStats sum;
  for (const auto& link : links_) {
    std::lock_guard lock(link->mutex);
    add_stats(sum, link->stats);
  }
  return sum;
}

void RemoteGroups::read(Link& link) {
  try {
    for (;;) {
      auto [kind, body] = receive_message(*link.comm, 1);
      if (kind == Kind::Done) return;
      if (kind == Kind::Stats) {
        EngineStats stats = decode_stats(body);
        std::lock_guard lock(link.mutex);
        link.stats = stats;
        continue;
      }
      SPARROW_CHECK(kind == Kind::Output, "data-parallel link: message ", int(kind), " is not for rank 0");
      const RequestOutput event = decode_output(body);
      OutputCallback on_output;
      {
        std::lock_guard lock(link.mutex);
        auto it = link.requests.find(event.request_id);
        SPARROW_CHECK(it != link.requests.end(), "data-parallel link: an event of unknown request '", event.request_id, "'");
        on_output = it->second.on_output;
        if (event.finished && --it->second.unfinished == 0) link.requests.erase(it);
      }
      on_output(event);
    }
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(link.mutex);
      if (link.stopping) return;
    }
    // The group cannot go on without its leader, nor the run without the group (its experts): as a dead
    // tensor-parallel worker does, this ends the run.
    std::fprintf(stderr, "error: data-parallel group %d's leader is gone (%s); stopping the run\n", link.group, e.what());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

// ---------------------------------------------------------------------------------------------
// A group's leader.

void serve_remote_group(Engine& engine, Communicator& link, std::vector<std::shared_ptr<const LoraAdapter>> adapters) {
  SPARROW_CHECK(link.size() == 2 && link.rank() == 1, "a data-parallel link is a group of two, rank 1 the leader's end");
  auto adapter_for = [&](const StepPlan::LoraSource& source) {
    for (const auto& held : adapters)
      if (held->name == source.name && held->path == source.path) return held;
    std::erase_if(adapters, [](const auto& held) { return held.use_count() == 1; });  // no request holds it
    const Model& model = engine.model();
    adapters.push_back(load_lora_adapter(source.name, source.path, source.base_model, model.lora_target(), source.max_rank));
    return adapters.back();
  };
  std::mutex send_mutex;
  auto send = [&](Kind kind, const std::vector<uint8_t>& body) {
    std::lock_guard lock(send_mutex);
    send_message(link, 0, kind, body);
  };
  engine.on_stats([&](const EngineStats& stats) { send(Kind::Stats, encode_stats(stats)); });
  for (;;) {
    auto [kind, body] = receive_message(link, 0);
    if (kind == Kind::Stop) break;
    switch (kind) {
      case Kind::Submit: {
        StepPlan::LoraSource lora;
        Request request = decode_request(body, &lora);
        const std::string id = request.id;
        const int64_t n = request.params.n, prompt = int64_t(request.prompt.size());
        try {
          if (!lora.name.empty()) request.lora = adapter_for(lora);
          engine.submit(std::move(request), [&](const RequestOutput& event) { send(Kind::Output, encode_output(event)); });
        } catch (const Error& e) {
          // Rank 0 validated it already; whatever this group refuses still ends the request cleanly.
          std::fprintf(stderr, "sparrow: request %s could not start here: %s\n", id.c_str(), e.what());
          RequestOutput event;
          event.request_id = id;
          event.prompt_tokens = prompt;
          event.finished = true;
          event.finish_reason = "error";
          for (event.index = 0; event.index < n; ++event.index) send(Kind::Output, encode_output(event));
        }
        break;
      }
      case Kind::Abort: {
        Reader r(body, "abort");
        engine.abort(r.get_string());
        break;
      }
      case Kind::Wave: {
        Reader r(body, "wave");
        engine.start_wave(r.get<int64_t>());
        break;
      }
      default:
        fail("data-parallel link: message ", int(kind), " is not for a group's leader");
    }
  }
  // Everything still held ends with "abort" events (sent before Done), then rank 0 lets go of the link.
  engine.shut_down();
  engine.on_stats(nullptr);
  send(Kind::Done, {});
}

}  // namespace sparrow
