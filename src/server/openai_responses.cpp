#include "server/openai_responses.h"

#include <chrono>
#include <cmath>
#include <random>

namespace sparrow::server {

std::string random_id(const std::string& prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 32; ++i) id += hex[rng() & 15];
  return id;
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Json usage_json(const Usage& usage) {
  Json out = {{"prompt_tokens", usage.prompt_tokens},
              {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
              {"completion_tokens", usage.completion_tokens}};
  if (usage.cached_tokens) out["prompt_tokens_details"] = {{"cached_tokens", *usage.cached_tokens}};
  if (usage.reasoning_tokens) out["completion_tokens_details"] = {{"reasoning_tokens", *usage.reasoning_tokens}};
  return out;
}

int64_t character_count(std::string_view text) {
  int64_t count = 0;
  for (unsigned char c : text) count += (c & 0xC0) != 0x80;  // every byte but UTF-8 continuation bytes
  return count;
}

std::string token_text(const Tokenizer& tokenizer, int32_t token) {
  int32_t ids[1] = {token};
  return tokenizer.decode(ids);
}

namespace {

// JSON cannot hold -inf (a token the model gives probability 0): clamp like vLLM's -9999.0.
double finite_logprob(float logprob) { return std::isfinite(logprob) ? double(logprob) : -9999.0; }

// The raw bytes of a token, as OpenAI's "bytes" (a token may hold part of a UTF-8 character).
Json token_bytes(const Tokenizer& tokenizer, int32_t token) {
  Json bytes = Json::array();
  if (const std::string* raw = tokenizer.token_bytes(token))
    for (unsigned char c : *raw) bytes.push_back(int(c));
  return bytes;
}

}  // namespace

Json chat_logprob_entries(const Tokenizer& tokenizer, const std::vector<TokenLogprob>& logprobs) {
  Json content = Json::array();
  for (const TokenLogprob& lp : logprobs) {
    Json top = Json::array();
    for (const auto& [token, logprob] : lp.top)
      top.push_back({{"token", token_text(tokenizer, token)},
                     {"logprob", finite_logprob(logprob)},
                     {"bytes", token_bytes(tokenizer, token)}});
    content.push_back({{"token", token_text(tokenizer, lp.token)},
                       {"logprob", finite_logprob(lp.logprob)},
                       {"bytes", token_bytes(tokenizer, lp.token)},
                       {"top_logprobs", std::move(top)}});
  }
  return content;
}

void CompletionLogprobs::append(const Tokenizer& tokenizer, const std::vector<TokenLogprob>& logprobs,
                                int64_t& text_offset) {
  for (const TokenLogprob& lp : logprobs) {
    std::string text = token_text(tokenizer, lp.token);
    tokens_.push_back(text);
    token_logprobs_.push_back(finite_logprob(lp.logprob));
    Json top = Json::object();
    for (const auto& [token, logprob] : lp.top) top[token_text(tokenizer, token)] = finite_logprob(logprob);
    top_logprobs_.push_back(std::move(top));
    text_offset_.push_back(text_offset);
    text_offset += character_count(text);
  }
}

Json CompletionLogprobs::json() const {
  return {{"text_offset", text_offset_},
          {"token_logprobs", token_logprobs_},
          {"tokens", tokens_},
          {"top_logprobs", top_logprobs_}};
}

Json prompt_logprobs_json(const Tokenizer& tokenizer, const std::vector<std::optional<TokenLogprob>>& logprobs) {
  Json out = Json::array();
  for (const auto& entry : logprobs) {
    if (!entry) {
      out.push_back(nullptr);
      continue;
    }
    Json position = Json::object();
    for (size_t rank = 0; rank < entry->top.size(); ++rank) {
      auto [token, logprob] = entry->top[rank];
      position[std::to_string(token)] = {{"logprob", finite_logprob(logprob)},
                                         {"rank", int64_t(rank) + 1},
                                         {"decoded_token", token_text(tokenizer, token)}};
    }
    std::string key = std::to_string(entry->token);
    if (!position.contains(key))  // the prompt token itself, outside the top k: its rank over the vocabulary
      position[key] = {{"logprob", finite_logprob(entry->logprob)},
                       {"rank", entry->rank},
                       {"decoded_token", token_text(tokenizer, entry->token)}};
    out.push_back(std::move(position));
  }
  return out;
}

std::string to_text(const Json& body) { return body.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string sse_event(const Json& data) { return "data: " + to_text(data) + "\n\n"; }

std::string stream_tail(bool include_usage, Json chunk, const Json& usage) {
  if (!include_usage) return kStreamEnd;
  chunk["usage"] = usage;
  return sse_event(chunk) + kStreamEnd;
}

}  // namespace sparrow::server
