// The request bodies of the OpenAI-compatible endpoints, parsed and validated the way vLLM does it
// (vllm/frontend/entrypoints/openai/{chat_completion,completion}/protocol.py): fields of the wrong
// type, out of range or contradicting each other are 400 ApiErrors naming the field. What needs the
// tokenizer or the model (prompt length, max_tokens against the context) is checked later, by the
// handlers.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "engine/kv_handoff.h"
#include "engine/sampler.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "structured/spec.h"

namespace sparrow::server {

struct StreamOptions {
  bool include_usage = false;           // one last chunk with "choices": [] and the usage
  bool continuous_usage_stats = false;  // cumulative usage on every chunk
};

// tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
struct ToolChoice {
  enum class Mode { None, Auto, Required, Named } mode = Mode::None;
  std::string function_name;  // Named only
};

// Fields both endpoints share.
struct GenerationFields {
  std::string model;  // empty: the served model
  SamplingParams sampling;
  std::optional<int64_t> max_tokens;  // not given: up to the end of the context (chat) / 16 (completions)
  bool stream = false;
  StreamOptions stream_options;
  std::optional<int64_t> truncate_prompt_tokens;  // keep only the last k prompt tokens
  bool return_token_ids = false;                  // vLLM extra: prompt and output token ids in the response
  std::string request_id;                         // vLLM extra: the client's own id, else generated
  KvTransferRequest kv_transfer;                  // vLLM's kv_transfer_params (server/kv_transfer_params.h)
};

// A chat message's image_url content part: its URL and where it is in the request
// ("messages[1].content[0].image_url.url"), for errors.
struct ImageUrl {
  std::string url, param;
};

struct ChatRequest : GenerationFields {
  Json template_input;  // messages, tools, chat_template_kwargs, ...: what the chat template renders
  Json tools;           // the list of tools; null when none
  ToolChoice tool_choice;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  bool parallel_tool_calls = true;  // false: only the first tool call is returned
  bool include_reasoning = true;    // false: the reasoning is parsed out and dropped
  // `echo` (vLLM): the last message's text when its role is the response's ("assistant"), put in front
  // of each choice's content; else empty.
  std::string echo_text;
  // The image_url parts in message order; the template sees each as {"type": "image"} (what the Hugging Face
  // chat templates render as the model's image placeholder). Loaded by ChatPrompt (chat_images.h).
  std::vector<ImageUrl> images;
};

// One prompt: text, or token ids.
using Prompt = std::variant<std::string, std::vector<int32_t>>;

struct CompletionRequest : GenerationFields {
  std::vector<Prompt> prompts;
  std::optional<int64_t> logprobs;  // the int form: top-k alternatives per token
  bool echo = false;                // the prompt is prepended to each choice's text
  bool add_special_tokens = true;   // a text prompt gets the tokenizer's BOS
};

// The sampling fields every generating endpoint reads into `s` (which holds the defaults), in vLLM's
// ranges (vllm SamplingParams._verify_args): temperature, top_p, top_k, min_p, the penalties, seed, stop,
// stop_token_ids, include_stop_str_in_output, ignore_eos, skip_special_tokens, logit_bias,
// allowed_token_ids, and the structured output (structured_outputs, guided_*, response_format).
void parse_sampling_fields(const Fields& f, SamplingParams& s);
// Compiles `spec` once, so that a bad schema, regex or grammar is a 400 naming `param`, and sets it.
void set_structured_output(SamplingParams& s, structured::StructuredOutputSpec spec, const std::string& param);

// The messages as a chat template sees them: each image_url part becomes {"type": "image"} (what the Hugging Face
// templates render as the model's image placeholder), its URL appended to `images` in message order (param:
// "messages[i].content[j].image_url.url"). A part without a string URL is a 400. Any nlohmann JSON type (the
// Python API keeps its conversations' key order).
template <class AnyJson>
AnyJson template_messages(const AnyJson& messages, std::vector<ImageUrl>& images) {
  AnyJson out = messages;
  for (size_t i = 0; i < out.size(); ++i) {
    auto content = out[i].find("content");
    if (content == out[i].end() || !content->is_array()) continue;
    for (size_t j = 0; j < content->size(); ++j) {
      AnyJson& part = (*content)[j];
      if (!part.is_object() || !part.contains("type") || part["type"] != "image_url") continue;
      const std::string param = "messages[" + std::to_string(i) + "].content[" + std::to_string(j) + "].image_url.url";
      const auto image_url = part.find("image_url");
      if (image_url == part.end() || !image_url->is_object() || !image_url->contains("url") ||
          !(*image_url)["url"].is_string())
        bad_request("`" + param + "` is required and must be a string", param);
      images.push_back({(*image_url)["url"].template get<std::string>(), param});
      part = AnyJson{{"type", "image"}};
    }
  }
  return out;
}

// `defaults` holds the sampling defaults of the served model (generation_config.json), which the
// request's fields override.
ChatRequest parse_chat_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs);
CompletionRequest parse_completion_request(const Json& body, const SamplingParams& defaults, int64_t max_logprobs,
                                           int64_t max_prompts);

}  // namespace sparrow::server
