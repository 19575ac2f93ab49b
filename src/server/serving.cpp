#include "server/serving.h"

#include "server/api_error.h"
#include "server/openai_responses.h"

namespace sparrow::server {

ServingContext::ServingContext(Engine& engine, std::shared_ptr<const Tokenizer> tokenizer,
                               std::shared_ptr<const ChatTemplate> chat_template, ServingOptions options,
                               std::optional<uint64_t> seed)
    : engine(engine),
      tokenizer(std::move(tokenizer)),
      chat_template(std::move(chat_template)),
      options(std::move(options)),
      metrics(this->options.served_model_names.front(), engine.max_model_len(),
              CacheInfo{engine.config().cache.block_size, engine.config().cache.kv_cache_dtype,
                        engine.config().cache.indexer_kv_dtype, engine.config().cache.enable_prefix_caching}) {
  if (seed) seeds_.emplace(*seed);
  lora_adapters_ = this->options.lora_adapters;
}

std::shared_ptr<const LoraAdapter> ServingContext::check_model(const std::string& name) const {
  if (name.empty()) return nullptr;
  for (const std::string& served : options.served_model_names)
    if (served == name) return nullptr;
  std::lock_guard<std::mutex> lock(lora_mutex_);
  for (const auto& adapter : lora_adapters_)
    if (adapter->name == name) return adapter;
  throw ApiError(404, "The model `" + name + "` does not exist.", "model");
}

std::vector<std::shared_ptr<const LoraAdapter>> ServingContext::lora_adapters() const {
  std::lock_guard<std::mutex> lock(lora_mutex_);
  return lora_adapters_;
}

void ServingContext::load_lora_adapter(const std::string& name, const std::string& path) {
  if (name.empty() || path.empty()) bad_request("both 'lora_name' and 'lora_path' must be provided.", "lora_name");
  for (const std::string& served : options.served_model_names)
    if (served == name) bad_request("The lora adapter '" + name + "' is the served model's name.", "lora_name");
  // Checked before the load (no upload for a request that cannot succeed) and again when the adapter is added
  // (two loads may run at once); lora_mutex_ held.
  auto check_room = [&] {
    for (const auto& adapter : lora_adapters_)
      if (adapter->name == name) bad_request("The lora adapter '" + name + "' has already been loaded.", "lora_name");
    if (int64_t(lora_adapters_.size()) >= options.max_loras)
      bad_request("--max-loras " + std::to_string(options.max_loras) + " adapters are loaded already: unload one first",
                  "lora_name");
  };
  {
    std::lock_guard<std::mutex> lock(lora_mutex_);
    check_room();
  }
  std::shared_ptr<const LoraAdapter> adapter;
  try {
    engine.run_between_steps([&] {
      adapter = sparrow::load_lora_adapter(name, path, options.lora_base_model, engine.model().lora_target(),
                                           options.max_lora_rank);
    });
  } catch (const Error& e) {
    bad_request(e.what(), "lora_path");
  }
  std::lock_guard<std::mutex> lock(lora_mutex_);
  check_room();
  lora_adapters_.push_back(std::move(adapter));
}

void ServingContext::unload_lora_adapter(const std::string& name) {
  std::lock_guard<std::mutex> lock(lora_mutex_);
  for (auto it = lora_adapters_.begin(); it != lora_adapters_.end(); ++it)
    if ((*it)->name == name) {
      lora_adapters_.erase(it);
      return;
    }
  throw ApiError(404, "The lora adapter '" + name + "' cannot be found.", "lora_name");
}

const std::string& ServingContext::response_model(const std::shared_ptr<const LoraAdapter>& lora) const {
  return lora ? lora->name : model_name();
}

const Tokenizer& ServingContext::require_tokenizer() const {
  if (!tokenizer) bad_request("the served model has no tokenizer: only token-id prompts are accepted", "prompt");
  return *tokenizer;
}

void ServingContext::assign_seed(SamplingParams& params) {
  if (params.seed || !seeds_) return;
  std::lock_guard<std::mutex> lock(seeds_mutex_);
  params.seed = (*seeds_)();
}

void fit_to_context(int64_t prompt_tokens, std::optional<int64_t> requested_max_tokens, const char* prompt_param,
                    const ServingContext& context, SamplingParams& params) {
  const int64_t max_model_len = context.engine.max_model_len();
  if (prompt_tokens >= max_model_len)
    bad_request("This model's maximum context length is " + std::to_string(max_model_len) +
                    " tokens. However, your request has " + std::to_string(prompt_tokens) +
                    " input tokens. Please reduce the length of the input.",
                prompt_param);
  const int64_t room = max_model_len - prompt_tokens;
  if (requested_max_tokens) {
    if (*requested_max_tokens > room)
      bad_request("'max_tokens' or 'max_completion_tokens' is too large: " + std::to_string(*requested_max_tokens) +
                      ". This model's maximum context length is " + std::to_string(max_model_len) +
                      " tokens and your request has " + std::to_string(prompt_tokens) + " input tokens (" +
                      std::to_string(*requested_max_tokens) + " > " + std::to_string(max_model_len) + " - " +
                      std::to_string(prompt_tokens) + ").",
                  "max_tokens");
    params.max_tokens = *requested_max_tokens;
  } else {
    // Unset: up to the end of the context, capped by the model's own max_new_tokens (vLLM get_max_tokens).
    params.max_tokens = std::min(room, context.options.default_max_tokens.value_or(room));
  }
  if (params.min_tokens > params.max_tokens) bad_request("`min_tokens` must be <= max_tokens", "min_tokens");
}

std::string engine_request_id(const std::string& client_request_id, const std::string& response_id) {
  return client_request_id.empty() ? response_id : random_id(response_id + "-");
}

std::string engine_failure_event(bool stream) { return stream ? sse_event(error_body(500, kEngineFailed)) : ""; }

}  // namespace sparrow::server
