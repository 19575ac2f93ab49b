// Serving with data parallelism (docs/parallel.md, "Data parallelism"): every data-parallel group's leader
// runs an Engine of its own (its scheduler, KV cache and sampler, driving its tensor-parallel workers), and
// rank 0's server hands each request to one of them, as vLLM's API server balances requests over its DP
// engine cores. Rank 0 is group 0's leader, so its own Engine serves group 0 and reaches the others through
// RemoteGroups; each other leader answers through serve_remote_group. The link between rank 0 and a leader
// is a host group of two (rank 0 there: the server; rank 1: the leader) carrying framed messages:
//   to the leader:   Submit (a Request), Abort (an id), Wave (runner/data_parallel.h), Stop
//   to rank 0:       Output (a RequestOutput), Stats (the leader's EngineStats after each step), Done
// A leader that is gone (its link fails) ends the run: rank 0 says which group and exits, as a dead
// tensor-parallel worker does.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "engine/engine_core.h"
#include "runner/step_plan.h"

namespace sparrow {

class Engine;

// The messages' encodings (public for the tests): every field round-trips exactly; a damaged message is a
// one-line sparrow::Error. A request's LoRA adapter travels as its source (name, folder, base model, rank
// limit), from which a leader loads its own copy: decode_request gives it in `lora` (an empty name: none).
std::vector<uint8_t> encode_request(const Request& request);
Request decode_request(const std::vector<uint8_t>& bytes, StepPlan::LoraSource* lora = nullptr);
// The event's first_scheduled travels as its age, so that it means the same on another machine's clock.
std::vector<uint8_t> encode_output(const RequestOutput& event);
RequestOutput decode_output(const std::vector<uint8_t>& bytes);
std::vector<uint8_t> encode_stats(const EngineStats& stats);
EngineStats decode_stats(const std::vector<uint8_t>& bytes);

// Rank 0's end: the links to groups 1 .. D-1.
class RemoteGroups {
 public:
  using OutputCallback = EngineCore::OutputCallback;
  // links[i] reaches group i + 1's leader (its rank 1). Each must outlive this.
  explicit RemoteGroups(std::vector<Communicator*> links);
  // Stops every group (their engines end what they hold with "abort" events, which still arrive) and waits
  // for their last events.
  ~RemoteGroups();
  RemoteGroups(const RemoteGroups&) = delete;
  RemoteGroups& operator=(const RemoteGroups&) = delete;

  int size() const { return int(links_.size()); }
  // Hands `request` to group `group` (1 .. size()); its events come to `on_output` on that link's thread.
  void submit(int group, const Request& request, OutputCallback on_output);
  void abort(int group, const std::string& request_id);
  void start_wave(int64_t wave);
  // The groups' last reported statistics, summed.
  EngineStats stats() const;

 private:
  struct Link;
  void read(Link& link);
  std::vector<std::unique_ptr<Link>> links_;
};

// A leader's end: serves rank 0's messages with `engine` until Stop (or until rank 0 is gone: then throws).
// `adapters`: the LoRA adapters this leader loaded from the flags, which requests naming the same name and
// folder reuse; any other adapter a request comes with is loaded here on first use (this group's split of
// it), and one that no request holds any more is dropped when another is loaded (rank 0 may have unloaded it).
void serve_remote_group(Engine& engine, Communicator& link,
                        std::vector<std::shared_ptr<const LoraAdapter>> adapters = {});

// Sums `b` into `a` (each group's statistics into the server's).
void add_stats(EngineStats& a, const EngineStats& b);

}  // namespace sparrow
