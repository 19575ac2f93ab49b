// What the engine is asked for and what it answers: a Request (prompt ids and sampling parameters)
// in, a stream of RequestOutput events out, one event per step per choice that produced something.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "engine/kv_handoff.h"
#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "vision/image_input.h"

namespace sparrow {

struct LoraAdapter;

struct Request {
  std::string id;  // unique among the requests the engine holds
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::shared_ptr<const LoraAdapter> lora;  // the LoRA adapter it runs with (model/lora.h); null: the base model
  // The prompt's images, in prompt order, each over its run of placeholder tokens (docs/vision.md); the model's
  // vision tower embeds them (EngineCore checks them against it).
  std::vector<vision::ImageInput> images;
  // Prefill/decode disaggregation (engine/kv_handoff.h): vLLM's kv_transfer_params as the engine takes them.
  KvTransferRequest kv_transfer;
};

// One event for one choice of one request. Deltas since the choice's previous event.
struct RequestOutput {
  std::string request_id;
  int64_t index = 0;  // the choice (0 .. n-1)
  std::vector<int32_t> new_tokens;
  // Text of new_tokens (with a tokenizer): never splits a UTF-8 character, never shows a stop string
  // (unless include_stop_str_in_output); text that may begin a stop string waits for the next event.
  std::string new_text;
  std::vector<TokenLogprob> logprobs;  // for new_tokens, when params.logprobs >= 0
  // Once, in choice 0's first event, when params.prompt_logprobs >= 0: one entry per prompt token,
  // none for the first (nothing predicts it).
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  bool finished = false;
  std::string finish_reason;  // when finished: "stop" | "length" | "abort" | "error" (the engine failed)
  // The stop string or stop token id that ended the choice; none for end-of-sequence and other reasons.
  std::optional<std::variant<std::string, int32_t>> stop_reason;
  int64_t prompt_tokens = 0, completion_tokens = 0;  // completion_tokens: generated so far
  int64_t cached_tokens = 0;                         // prompt tokens served by the prefix cache
  // When the engine first scheduled this choice (its wait in the queue ends there; a preemption does not
  // move it): the server's queue, prefill and decode time metrics.
  std::optional<std::chrono::steady_clock::time_point> first_scheduled;
  // A prefill instance's last event of a do_remote_decode request: what the decode instance needs (the
  // response's kv_transfer_params).
  std::optional<KvHandoff> kv_handoff;
};

}  // namespace sparrow
