// The offline engine behind the Python API (python/sparrow_module.cpp, docs/python.md), shaped after vLLM's
// `LLM`: a model, its tokenizer and chat template, and one engine (EngineCore: the serving engine's
// scheduler, paged KV cache with prefix caching, sampler) that every generate() call runs to completion.
//
// Sampling parameters are given as vLLM's SamplingParams fields in a JSON object and read by the server's
// own parser of /v1/completions bodies (server/openai_requests.h), so every field means, defaults to and is
// checked as it is there; a bad value is a sparrow::Error naming the field.
//
// update_weights() replaces the model by the checkpoint of another folder of the same architecture (an RL
// trainer's new policy), or by the current folder's with tensors from memory in place of some of its own
// (the trainer's tensors, never written to disk): the engine is rebuilt on it (its prefix cache dropped), the
// next generate() uses it. The old and the new weights are both resident while the new ones load.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine_core.h"
#include "model/lora.h"
#include "model/model.h"
#include "server/chat_images.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::api {

struct LlmOptions {
  std::string model;             // a Hugging Face model folder
  std::string device = "cpu";    // cpu | cuda
  std::string load_format = "auto";
  int64_t max_model_len = 0;     // 0: the model's (config.json's context length)
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;
  int64_t kv_cache_memory = 0;   // bytes; 0: --gpu-memory-utilization's share on a GPU, 1 GiB on the CPU
  double gpu_memory_utilization = 0.9;
  std::string kv_cache_dtype = "auto";
  int64_t block_size = 64;
  bool enable_prefix_caching = true;
  bool enforce_eager = false;
  // Batch-invariant mode (core/batch_invariance.h; a process-wide setting: true turns it on for every engine of
  // the process; VLLM_BATCH_INVARIANT=1 does too).
  bool batch_invariant = false;
  std::optional<uint64_t> seed;  // requests without a seed of their own draw from seed + their index
  std::string speculative_config;  // vLLM's speculative_config as JSON text (docs/speculative.md); empty: none
  // LoRA adapters (docs/lora.md): vLLM's enable_lora, max_loras, max_lora_rank.
  bool enable_lora = false;
  int64_t max_loras = 1, max_lora_rank = 16;
  // Images (docs/vision.md): vLLM's limit_mm_per_prompt as JSON ('{"image": N}'; empty: 999) and
  // allowed_local_media_path (file:// image URLs in chats; empty: none).
  std::string limit_mm_per_prompt, allowed_local_media_path;
};

// vLLM's LoRARequest: the adapter a prompt runs with, by name and folder (loaded on first use).
struct LoraRequest {
  std::string name, path;
};

// One prompt: text (tokenized with the tokenizer's special tokens, as /v1/completions does) or token ids.
using Prompt = std::variant<std::string, std::vector<int32_t>>;

struct CompletionOutput {
  int64_t index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprob> logprobs;  // when the parameters asked for logprobs
  std::optional<double> cumulative_logprob;
  std::string finish_reason;  // stop | length | abort | error
  std::optional<std::variant<std::string, int32_t>> stop_reason;
};

struct RequestResult {
  std::string request_id;
  std::string prompt;  // the text given (empty for token ids)
  std::vector<int32_t> prompt_token_ids;
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  int64_t num_cached_tokens = 0;
  std::vector<CompletionOutput> outputs;
};

class Llm {
 public:
  explicit Llm(LlmOptions options);
  ~Llm();
  Llm(const Llm&) = delete;
  Llm& operator=(const Llm&) = delete;

  // Runs every prompt, each with its parameters (one set for all, or one per prompt) and its LoRA adapter
  // (none, one for all, or one per prompt; an empty name: the base model), to the end.
  // `images`: each prompt's images as their files' bytes (vLLM's multi_modal_data), or none for any; a prompt's ids
  // hold one image placeholder per image, which becomes the image's tokens (result.prompt_token_ids shows them).
  std::vector<RequestResult> generate(const std::vector<Prompt>& prompts, const std::vector<nlohmann::json>& params,
                                      const std::vector<LoraRequest>& loras = {},
                                      const std::vector<std::vector<std::string>>& images = {});
  // Chats: each conversation ({"messages": [...], optional "tools", "chat_template_kwargs"}) rendered by the
  // model's chat template with a generation prompt, then generated as a token-id prompt; image_url parts (data: URLs,
  // file:// under allowed_local_media_path) are its images, as the server takes them.
  std::vector<RequestResult> chat(const std::vector<nlohmann::ordered_json>& conversations,
                                  const std::vector<nlohmann::json>& params, const std::vector<LoraRequest>& loras = {});
  // LoRA adapters (enable_lora): loads one under `name` (at most max_loras at once; a name already loaded
  // must name the same folder), or forgets one. generate() loads the adapters its LoraRequests name.
  void load_lora(const LoraRequest& lora);
  void remove_lora(const std::string& name);
  std::vector<std::string> list_loras() const;
  // The model of `folder` (same architecture: model type, vocabulary and cache layout) replaces the current
  // one; the engine (and its prefix cache) is rebuilt on it.
  void update_weights(const std::string& folder);
  // The same from memory: the folder the weights last came from, with each of `tensors` (copied) in place of
  // its tensor of the same name (Checkpoint::replace_tensors says what may replace what).
  struct HostTensor {
    std::string name;
    std::string dtype;           // as safetensors spells it: "BF16", "F16", "F32", "F8_E4M3", ...
    std::vector<int64_t> shape;
    const void* data = nullptr;  // nbytes bytes, row-major
    size_t nbytes = 0;
  };
  void update_weights(const std::vector<HostTensor>& tensors);

  // Checks one set of parameters as generate() would (a sparrow::Error naming the field).
  static void check_params(const nlohmann::json& params);

  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  int64_t max_model_len() const { return config_.max_model_len; }
  const std::string& model_path() const { return model_path_; }

 private:
  void make_engine();
  LoadOptions load_options() const;  // the target's and its MTP drafter's
  std::unique_ptr<Model> load(const std::string& folder) const;
  // The checks update_weights makes of a new model (`folder` names it in errors), then the engine rebuilt on it.
  void replace_model(std::unique_ptr<Model> next, const std::string& folder);

  LlmOptions options_;
  std::string model_path_;
  std::string weights_folder_;  // where the model's weights last came from (update_weights from a folder)
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
  std::unique_ptr<Model> model_;
  std::shared_ptr<const server::ImageServing> images_;  // null: the model takes no images
  std::unique_ptr<Model> draft_model_;  // speculative decoding's draft model, MTP layer or DSpark drafter
  EngineConfig config_;
  std::unique_ptr<EngineCore> engine_;
  int64_t next_request_ = 0;
  std::vector<std::shared_ptr<const LoraAdapter>> loras_;  // loaded adapters (model/lora.h)
  std::shared_ptr<const LoraAdapter> lora_for(const LoraRequest& lora);
};

}  // namespace sparrow::api
