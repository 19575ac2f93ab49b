// What the endpoint handlers share: the engine, the tokenizer, the chat template, the metrics and the
// serving options; and the shape of a completion in progress (CompletionJob), which the HTTP layer
// drives (server.cpp) without knowing which endpoint made it.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/lora.h"
#include "server/chat_images.h"
#include "server/generation.h"
#include "server/json_fields.h"
#include "server/metrics.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::server {

struct ServingOptions {
  std::vector<std::string> served_model_names;     // requests may name any; responses carry the first
  std::string model_path;                          // /v1/models "root"
  int64_t max_logprobs = kMaxLogprobs;             // --max-logprobs
  int64_t max_prompts_per_request = 1024;          // list prompts of /v1/completions
  std::string tool_call_parser, reasoning_parser;  // empty: none
  bool enable_auto_tool_choice = false;
  bool enable_prompt_tokens_details = false;  // usage.prompt_tokens_details.cached_tokens
  SamplingParams default_sampling;            // request defaults (generation_config.json with --generation-config auto)
  std::optional<int64_t> default_max_tokens;  // generation_config.json's max_new_tokens: caps an unset max_tokens
  // --lora-modules: requests that name one of these run with it (model/lora.h); /v1/models lists them.
  std::vector<std::shared_ptr<const LoraAdapter>> lora_adapters;
  // Runtime adapter loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter): on with --enable-lora and
  // VLLM_ALLOW_RUNTIME_LORA_UPDATING set, as in vLLM. What a load needs: the base model's folder, the
  // largest rank, and how many adapters may be loaded at once.
  bool runtime_lora_updating = false;
  std::string lora_base_model;
  int64_t max_lora_rank = 16, max_loras = 1;
  // Images in chats (chat_images.h): set when the model has a vision tower and the tokenizer its placeholders.
  std::shared_ptr<const ImageServing> images;
};

class ServingContext {
 public:
  ServingContext(Engine& engine, std::shared_ptr<const Tokenizer> tokenizer,
                 std::shared_ptr<const ChatTemplate> chat_template, ServingOptions options,
                 std::optional<uint64_t> seed);

  Engine& engine;
  const std::shared_ptr<const Tokenizer> tokenizer;         // null: token ids only
  const std::shared_ptr<const ChatTemplate> chat_template;  // null: no chat endpoint
  const ServingOptions options;
  ServerMetrics metrics;

  const std::string& model_name() const { return options.served_model_names.front(); }
  // 404 unless `name` is empty, one of the served names or a LoRA adapter's; the adapter (null: the base model).
  std::shared_ptr<const LoraAdapter> check_model(const std::string& name) const;
  // The name responses carry: the adapter's, or the first served name.
  const std::string& response_model(const std::shared_ptr<const LoraAdapter>& lora) const;
  // The adapters served now (--lora-modules, then runtime loads and unloads).
  std::vector<std::shared_ptr<const LoraAdapter>> lora_adapters() const;
  // POST /v1/load_lora_adapter: loads `path` under `name` on the engine thread (between two steps); a 400
  // for a name taken, more than max_loras, or a folder that cannot be served (the loader's one line).
  void load_lora_adapter(const std::string& name, const std::string& path);
  // POST /v1/unload_lora_adapter: new requests can no longer name it (requests holding it finish with it);
  // a 404 for an unknown name.
  void unload_lora_adapter(const std::string& name);
  // The tokenizer, or a 400 saying the model has none.
  const Tokenizer& require_tokenizer() const;
  // --seed: a request without a seed gets the next one of a sequence started from the server's seed, so
  // a server started with the same seed answers the same requests in the same order the same way.
  void assign_seed(SamplingParams& params);

 private:
  std::optional<std::mt19937_64> seeds_;
  std::mutex seeds_mutex_;
  mutable std::mutex lora_mutex_;  // guards lora_adapters_
  std::vector<std::shared_ptr<const LoraAdapter>> lora_adapters_;
};

// A completion in progress. The server takes the engine's events from generation() as they arrive and
// writes what the job makes of them: stream chunks, or one body at the end.
class CompletionJob {
 public:
  virtual ~CompletionJob() = default;
  virtual Generation& generation() = 0;
  virtual bool streaming() const = 0;
  // The response's id ("chatcmpl-…", "cmpl-…", "resp_…"): the access log names the request by it.
  virtual const std::string& id() const = 0;
  // Streaming: what goes out before any output (chat: each choice's role chunk; responses:
  // response.created and response.in_progress).
  virtual std::string stream_start() = 0;
  // Streaming: the chunks for one event; empty when nothing can be said yet. Non-streaming: only
  // accumulates, returns "".
  virtual std::string on_event(const Generation::Event& event) = 0;
  // Streaming, once every choice has finished: the stream's last events (chat: the usage chunk if asked
  // for, then [DONE]; responses: response.completed).
  virtual std::string stream_end() = 0;
  // Non-streaming, once every choice has finished: the response body; an error object (its `code` the
  // HTTP status) when the engine failed.
  virtual Json response() = 0;
};

// The body's message when the engine fails on a request.
inline constexpr const char* kEngineFailed = "the engine failed while generating this request";

// The engine's id for a request: the response id, unless the client chose the request id (clients may
// reuse their ids; the engine's must be unique).
std::string engine_request_id(const std::string& client_request_id, const std::string& response_id);
// The engine failed on a request ("error" finish): vLLM answers 500, or an error event mid-stream (the
// event to send; "" when not streaming, the caller answering 500 with the body).
std::string engine_failure_event(bool stream);

// Parse, validate, render / tokenize, check lengths and submit; 4xx problems are ApiErrors.
std::unique_ptr<CompletionJob> start_chat_completion(const Json& body, ServingContext& context,
                                                     Clock::time_point arrival);
std::unique_ptr<CompletionJob> start_text_completion(const Json& body, ServingContext& context,
                                                     Clock::time_point arrival);
std::unique_ptr<CompletionJob> start_responses(const Json& body, ServingContext& context, Clock::time_point arrival);

// Prompt length against the context (vLLM's messages): 400 when the prompt leaves no room, or when
// max_tokens does not fit; fills in max_tokens when the request left it unset.
void fit_to_context(int64_t prompt_tokens, std::optional<int64_t> requested_max_tokens, const char* prompt_param,
                    const ServingContext& context, SamplingParams& params);

}  // namespace sparrow::server
