#include "api/llm.h"

#include <algorithm>
#include <filesystem>
#include <cstring>
#include <fstream>

#include "cache/page_codec.h"
#include "core/batch_invariance.h"
#include "core/device/device.h"
#include "core/error.h"
#include "engine/generate.h"
#include "formats/checkpoint.h"
#include "formats/config.h"
#include "model/dspark.h"
#include "model/mtp.h"
#include "runner/memory_profile.h"
#include "server/api_error.h"
#include "server/openai_requests.h"

namespace sparrow::api {

namespace {

namespace fs = std::filesystem;

nlohmann::json read_config(const std::string& folder) {
  const fs::path path = fs::path(folder) / "config.json";
  std::ifstream in(path);
  SPARROW_CHECK(in, folder, ": not a model folder (no config.json; sparrow reads local folders only)");
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!config.is_discarded() && config.is_object(), path.string(), ": not a JSON object");
  return config;
}

// The server's parser of /v1/completions bodies reads the parameters (server/openai_requests.h); its 400s
// become sparrow::Errors naming the field.
server::CompletionRequest parse_params(const nlohmann::json& params, const Prompt& prompt) {
  SPARROW_CHECK(params.is_object(), "sampling parameters must be an object of SamplingParams fields");
  nlohmann::json body = params;
  std::visit([&](const auto& p) { body["prompt"] = p; }, prompt);
  try {
    return server::parse_completion_request(body, SamplingParams{}, kMaxLogprobs, /*max_prompts=*/1);
  } catch (const server::ApiError& e) {
    fail(e.what());
  }
}

}  // namespace

Llm::Llm(LlmOptions options) : options_(std::move(options)) {
  model_path_ = options_.model;
  const nlohmann::json config = read_config(model_path_);
  try {
    tokenizer_ = load_tokenizer(model_path_);
  } catch (const Error&) {
    // A folder without a tokenizer serves token-id prompts only (text prompts say so).
  }
  if (tokenizer_) {
    try {
      chat_template_ = std::make_unique<ChatTemplate>(ChatTemplate::load(model_path_));
    } catch (const Error&) {
      // chat() says there is none.
    }
  }
  config_.max_model_len = options_.max_model_len;
  if (config_.max_model_len <= 0) {
    const std::optional<ModelPositions> positions = model_positions(config);
    SPARROW_CHECK(positions, model_path_, "/config.json has no context length: give max_model_len");
    config_.max_model_len = positions->tokens;
  }
  SPARROW_CHECK(options_.max_num_seqs > 0 && options_.max_num_batched_tokens > 0,
                "max_num_seqs and max_num_batched_tokens must be positive");
  config_.max_num_seqs = options_.max_num_seqs;
  config_.max_num_batched_tokens = options_.max_num_batched_tokens;
  config_.cache.block_size = options_.block_size;
  config_.cache.kv_cache_dtype = options_.kv_cache_dtype;
  parse_cache_dtype(options_.kv_cache_dtype);
  config_.cache.max_num_seqs = options_.max_num_seqs;
  config_.cache.enable_prefix_caching = options_.enable_prefix_caching;
  config_.runner.enforce_eager = options_.enforce_eager;
  if (options_.batch_invariant) set_batch_invariant(true);
  for (int32_t id : eos_token_ids(model_path_)) config_.eos_token_ids.push_back(id);
  if (!options_.speculative_config.empty()) {
    config_.speculative = parse_speculative_config(options_.speculative_config);
    if (config_.speculative.method == "draft_model") draft_model_ = load(config_.speculative.model);
    if (config_.speculative.method == "mtp")
      draft_model_ = load_mtp_drafter(model_path_, parse_device(options_.device), load_options());
    config_.draft_model = draft_model_.get();
  }
  model_ = load(model_path_);
  weights_folder_ = model_path_;
  images_ = server::make_image_serving(model_path_, model_->vision(), tokenizer_.get(), options_.limit_mm_per_prompt,
                                       options_.allowed_local_media_path);
  if (config_.speculative.method == "dspark") {  // bound to the target: it shares its embedding and head
    draft_model_ = load_dspark_drafter(config_.speculative.model, *model_, load_options(), model_path_);
    config_.draft_model = draft_model_.get();
  }
  const bool on_gpu = model_->device() != Device::Cpu;
  if (options_.kv_cache_memory > 0) {
    config_.cache.memory_bytes = options_.kv_cache_memory;
  } else if (on_gpu) {
    ModelRunner profile(*model_, config_.runner);
    config_.cache.memory_bytes =
        gpu_kv_cache_bytes(profile, config_.cache, config_.step_limits(), options_.gpu_memory_utilization);
  } else {
    config_.cache.memory_bytes = int64_t(1) << 30;
  }
  config_.warm_up = on_gpu;
  make_engine();
}

Llm::~Llm() = default;

LoadOptions Llm::load_options() const {
  LoadOptions load;
  load.load_format = options_.load_format;
  return load;
}

std::unique_ptr<Model> Llm::load(const std::string& folder) const {
  return load_model(folder, parse_device(options_.device), load_options());
}

void Llm::make_engine() {
  engine_.reset();
  engine_ = std::make_unique<EngineCore>(*model_, tokenizer_.get(), config_);
}

void Llm::check_params(const nlohmann::json& params) { parse_params(params, std::vector<int32_t>{0}); }

void Llm::load_lora(const LoraRequest& lora) { lora_for(lora); }

std::shared_ptr<const LoraAdapter> Llm::lora_for(const LoraRequest& lora) {
  if (lora.name.empty()) return nullptr;
  SPARROW_CHECK(options_.enable_lora, "LoRA adapter '", lora.name, "': the LLM was made without enable_lora=True");
  for (const auto& loaded : loras_)
    if (loaded->name == lora.name) {
      SPARROW_CHECK(lora.path.empty() || loaded->path == lora.path, "LoRA adapter '", lora.name, "' is loaded from ",
                    loaded->path, ", not ", lora.path, " (remove_lora it first)");
      return loaded;
    }
  SPARROW_CHECK(!lora.path.empty(), "LoRA adapter '", lora.name, "' is not loaded and no path was given");
  SPARROW_CHECK(int64_t(loras_.size()) < options_.max_loras, "LoRA adapter '", lora.name, "': max_loras (",
                options_.max_loras, ") adapters are loaded already (remove_lora one)");
  loras_.push_back(load_lora_adapter(lora.name, lora.path, weights_folder_, model_->lora_target(), options_.max_lora_rank));
  return loras_.back();
}

void Llm::remove_lora(const std::string& name) {
  auto it = std::find_if(loras_.begin(), loras_.end(), [&](const auto& a) { return a->name == name; });
  SPARROW_CHECK(it != loras_.end(), "no LoRA adapter '", name, "' is loaded");
  loras_.erase(it);  // requests that hold it keep it alive until they end
}

std::vector<std::string> Llm::list_loras() const {
  std::vector<std::string> names;
  for (const auto& a : loras_) names.push_back(a->name);
  return names;
}

std::vector<RequestResult> Llm::generate(const std::vector<Prompt>& prompts, const std::vector<nlohmann::json>& params,
                                         const std::vector<LoraRequest>& loras,
                                         const std::vector<std::vector<std::string>>& images) {
  SPARROW_CHECK(images.empty() || images.size() == prompts.size(), "give each prompt its images (", prompts.size(),
                " prompts, ", images.size(), " image lists)");
  SPARROW_CHECK(params.size() == 1 || params.size() == prompts.size(), "give one set of sampling parameters, or one per "
                "prompt (", prompts.size(), " prompts, ", params.size(), " sets)");
  SPARROW_CHECK(loras.size() <= 1 || loras.size() == prompts.size(), "give one LoRA request, or one per prompt (",
                prompts.size(), " prompts, ", loras.size(), " LoRA requests)");
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
  for (const LoraRequest& lora : loras) adapters.push_back(lora_for(lora));
  std::vector<RequestResult> results(prompts.size());
  std::vector<Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const server::CompletionRequest parsed = parse_params(params[params.size() == 1 ? 0 : i], prompts[i]);
    RequestResult& result = results[i];
    result.request_id = std::to_string(next_request_++);
    if (const auto* text = std::get_if<std::string>(&prompts[i])) {
      SPARROW_CHECK(tokenizer_, model_path_, " has no tokenizer: give token ids instead of text");
      result.prompt = *text;
      result.prompt_token_ids =
          parsed.add_special_tokens ? tokenizer_->encode_with_special_tokens(*text) : tokenizer_->encode(*text);
    } else {
      result.prompt_token_ids = std::get<std::vector<int32_t>>(prompts[i]);
    }
    if (parsed.truncate_prompt_tokens && int64_t(result.prompt_token_ids.size()) > *parsed.truncate_prompt_tokens)
      result.prompt_token_ids.erase(result.prompt_token_ids.begin(),
                                    result.prompt_token_ids.end() - *parsed.truncate_prompt_tokens);
    std::vector<vision::ImageInput> prompt_images;
    if (!images.empty() && !images[i].empty()) {
      std::vector<std::string> names;
      for (size_t k = 0; k < images[i].size(); ++k)
        names.push_back("prompt " + std::to_string(i) + " image " + std::to_string(k));
      try {
        prompt_images = server::place_prompt_images(images[i], names, images_.get(), result.prompt_token_ids);
      } catch (const server::ApiError& e) {
        fail(e.what());
      }
    }
    Request request{result.request_id, result.prompt_token_ids, parsed.sampling,
                    adapters.empty() ? nullptr : adapters[adapters.size() == 1 ? 0 : i]};
    request.images = std::move(prompt_images);
    request.params.max_tokens = parsed.max_tokens.value_or(16);  // vLLM's SamplingParams default
    if (!request.params.seed && options_.seed) request.params.seed = *options_.seed + uint64_t(next_request_ - 1);
    result.outputs.resize(size_t(request.params.n));
    for (size_t c = 0; c < result.outputs.size(); ++c) result.outputs[c].index = int64_t(c);
    engine_->validate(request);  // every prompt is checked before any runs
    requests.push_back(std::move(request));
  }
  bool failed = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    const bool wants_logprobs = requests[i].params.logprobs >= 0;
    engine_->add(std::move(requests[i]), [&result = results[i], wants_logprobs, &failed](const RequestOutput& event) {
      CompletionOutput& out = result.outputs.at(size_t(event.index));
      out.token_ids.insert(out.token_ids.end(), event.new_tokens.begin(), event.new_tokens.end());
      out.text += event.new_text;
      for (const TokenLogprob& lp : event.logprobs) {
        out.logprobs.push_back(lp);
        out.cumulative_logprob = out.cumulative_logprob.value_or(0.0) + double(lp.logprob);
      }
      if (wants_logprobs && !out.cumulative_logprob) out.cumulative_logprob = 0.0;
      if (!event.prompt_logprobs.empty()) result.prompt_logprobs = event.prompt_logprobs;
      result.num_cached_tokens = std::max(result.num_cached_tokens, event.cached_tokens);
      if (event.finished) {
        out.finish_reason = event.finish_reason;
        out.stop_reason = event.stop_reason;
        failed |= event.finish_reason == "error";
      }
    });
  }
  while (engine_->step()) {
  }
  SPARROW_CHECK(!failed, "generation stopped: a step of the model failed (the cause is printed above)");
  return results;
}

std::vector<RequestResult> Llm::chat(const std::vector<nlohmann::ordered_json>& conversations,
                                     const std::vector<nlohmann::json>& params, const std::vector<LoraRequest>& loras) {
  SPARROW_CHECK(chat_template_, model_path_, " has no chat template (chat_template.jinja or tokenizer_config.json's)");
  std::vector<Prompt> prompts;
  std::vector<std::vector<std::string>> images;
  bool any_images = false;
  for (const nlohmann::ordered_json& conversation : conversations) {
    SPARROW_CHECK(conversation.is_object() && conversation.contains("messages") && conversation["messages"].is_array(),
                  "a conversation is a list of messages ({\"role\": ..., \"content\": ...})");
    // Image parts: the template sees {"type": "image"}; their bytes go with the prompt (as the server's chats).
    std::vector<server::ImageUrl> urls;
    nlohmann::ordered_json rendered = conversation;
    std::vector<std::string> bytes;
    try {
      rendered["messages"] = server::template_messages(conversation["messages"], urls);
      for (const server::ImageUrl& url : urls)
        bytes.push_back(server::image_url_bytes(url, images_ ? images_->allowed_local_media_path : std::string()));
    } catch (const server::ApiError& e) {
      fail(e.what());
    }
    any_images |= !bytes.empty();
    images.push_back(std::move(bytes));
    prompts.emplace_back(tokenizer_->encode(chat_template_->render(rendered)));
  }
  return generate(prompts, params, loras, any_images ? images : std::vector<std::vector<std::string>>{});
}

void Llm::update_weights(const std::string& folder) {
  read_config(folder);  // "not a model folder" before anything loads
  replace_model(load(folder), folder);
  weights_folder_ = folder;
}

void Llm::update_weights(const std::vector<HostTensor>& tensors) {
  // One copy of every tensor's bytes: views of them (bf16 weights on the CPU) outlive this call.
  size_t total = 0;
  for (const HostTensor& t : tensors) total += t.nbytes;
  auto memory = std::make_shared<std::vector<uint8_t>>(total);
  auto replaced = std::make_shared<TensorsInMemory>();
  size_t at = 0;
  for (const HostTensor& t : tensors) {
    TensorInfo info;
    info.name = t.name;
    SPARROW_CHECK(parse_dtype(t.dtype, &info.dtype), "update_weights: '", t.name, "' has an unknown dtype '", t.dtype,
                  "' (BF16, F16, F32, F8_E4M3, ... as safetensors spells them)");
    info.shape = Shape(t.shape.begin(), t.shape.end());
    SPARROW_CHECK(t.data || t.nbytes == 0, "update_weights: '", t.name, "' has no data");
    if (t.nbytes) std::memcpy(memory->data() + at, t.data, t.nbytes);
    info.data = memory->data() + at;
    info.nbytes = t.nbytes;
    at += t.nbytes;
    replaced->tensors.push_back(std::move(info));
  }
  replaced->memory = memory;
  LoadOptions options = load_options();
  options.replaced_tensors = replaced;
  replace_model(load_model(weights_folder_, parse_device(options_.device), options), weights_folder_ + " with new tensors");
}

void Llm::replace_model(std::unique_ptr<Model> next, const std::string& folder) {
  SPARROW_CHECK(next->model_type() == model_->model_type() && next->vocab_size() == model_->vocab_size() &&
                    next->cache_spec() == model_->cache_spec(),
                folder, ": not the architecture being served (", next->model_type(), ", vocabulary ", next->vocab_size(),
                " against ", model_->model_type(), ", vocabulary ", model_->vocab_size(),
                " and the same layers): update_weights takes new weights of the same model");
  engine_.reset();  // it holds the old model; its cache (and prefix cache) goes with it
  model_ = std::move(next);
  make_engine();
}

}  // namespace sparrow::api
