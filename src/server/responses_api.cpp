// POST /v1/responses: OpenAI's Responses API as vLLM 0.33 serves it
// (vllm/entrypoints/openai/responses/serving.py, its "simple" path: one generation, no built-in tools).
// The request becomes a chat request (responses_request.h) and goes the chat path's one way
// (chat_prompt.h): the chat template, tool_choice forcing, structured outputs, the reasoning and
// tool-call parsers. Their deltas become output items (responses_output.h).
//
//   not streaming: the response object, {"id": "resp_…", "object": "response", "created_at", "status",
//                  "output", "usage", ...} with the request's parameters echoed as vLLM echoes them.
//   stream:        server-sent events "event: <type>\ndata: <json>", each with its sequence_number:
//                  response.created, response.in_progress, the items' events, then
//                  response.completed (or response.incomplete when max_output_tokens cut the output,
//                  response.failed when the engine failed). No [DONE]: OpenAI sends none here.
//   status:        "completed"; "incomplete" with incomplete_details {"reason": "max_output_tokens"}
//                  when the output hit the token limit (vLLM); "cancelled" when the request was aborted
//                  (server shutdown).
// A client that goes away aborts the request (server.cpp), as for chat.
#include <cstdio>
#include <cstdlib>

#include "server/api_error.h"
#include "server/chat_prompt.h"
#include "server/openai_responses.h"
#include "server/responses_output.h"
#include "server/responses_request.h"
#include "server/serving.h"

namespace sparrow::server {
namespace {

class ResponsesCompletion : public CompletionJob {
 public:
  ResponsesCompletion(const Json& body, ServingContext& context, Clock::time_point arrival)
      : context_(context), id_(random_id("resp_")), created_(unix_time()) {
    request_ = parse_responses_request(body, context.options.default_sampling, context.options.max_logprobs);
    lora_ = context.check_model(request_.chat.model);
    if (!request_.chat.request_id.empty()) id_ = "resp_" + request_.chat.request_id;
    ChatPromptOptions options;
    options.messages_param = "input";
    options.clamp_max_tokens = true;  // vLLM: max_output_tokens is capped by what the context leaves
    prompt_.emplace(request_.chat, context, options);
    output_.emplace(prompt_->new_output());
    items_ = ResponseOutput(request_.output_logprobs);
    generation_.emplace(context.engine, context.metrics, engine_request_id(request_.chat.request_id, id_),
                        std::vector<std::vector<int32_t>>{prompt_->ids()}, prompt_->params(), arrival,
                        lora_, prompt_->images());
  }

  Generation& generation() override { return *generation_; }
  bool streaming() const override { return request_.chat.stream; }
  const std::string& id() const override { return id_; }

  std::string stream_start() override {
    Json initial = response_json("in_progress");
    std::string out = event("response.created", {{"response", initial}});
    return out + event("response.in_progress", {{"response", initial}});  // numbered after response.created
  }

  std::string on_event(const Generation::Event& event) override {
    const RequestOutput& out = event.output;
    output_tokens_ += int64_t(out.new_tokens.size());
    cached_tokens_ = std::max(cached_tokens_, out.cached_tokens);
    parsers::OutputDelta delta = output_->feed(out.new_text, int64_t(out.new_tokens.size()), out.finished);
    Json logprobs = request_.output_logprobs ? chat_logprob_entries(*context_.tokenizer, out.logprobs) : Json::array();
    std::vector<Json> events = items_.add(delta, logprobs);
    if (out.finished) {
      finish_reason_ = out.finish_reason;
      std::vector<Json> last = items_.finish(finish_reason_ == "length");
      events.insert(events.end(), last.begin(), last.end());
    }
    if (!request_.chat.stream) return "";
    std::string text;
    for (Json& e : events) text += numbered(std::move(e));
    return text;
  }

  std::string stream_end() override {
    if (finish_reason_ == "error") return event("response.failed", {{"response", response_json("failed")}});
    std::string status = status_for(finish_reason_);
    return event(status == "incomplete" ? "response.incomplete" : "response.completed",
                 {{"response", response_json(status)}});
  }

  Json response() override {
    if (finish_reason_ == "error") return error_body(500, kEngineFailed);
    return response_json(status_for(finish_reason_));
  }

 private:
  static std::string status_for(const std::string& finish_reason) {
    if (finish_reason == "length") return "incomplete";
    if (finish_reason == "abort") return "cancelled";
    return "completed";
  }

  // The response object in `status`: the output so far and, once finished, the usage.
  Json response_json(const std::string& status) const {
    const SamplingParams& params = prompt_->params();
    const bool done = status != "in_progress";
    Json usage = nullptr;
    if (done) {
      int64_t input_tokens = int64_t(prompt_->ids().size());
      usage = {{"input_tokens", input_tokens},
               {"input_tokens_details", {{"cached_tokens", cached_tokens_}}},
               {"output_tokens", output_tokens_},
               {"output_tokens_details", {{"reasoning_tokens", output_->reasoning_tokens()}}},
               {"total_tokens", input_tokens + output_tokens_}};
    }
    Json error = nullptr;
    if (status == "failed") error = {{"code", "server_error"}, {"message", kEngineFailed}};
    return {{"id", id_},
            {"object", "response"},
            {"created_at", created_},
            {"status", status},
            {"background", false},
            {"error", std::move(error)},
            {"incomplete_details", status == "incomplete" ? Json{{"reason", "max_output_tokens"}} : Json(nullptr)},
            {"instructions", request_.instructions},
            {"max_output_tokens", params.max_tokens},
            {"max_tool_calls", nullptr},
            {"metadata", request_.metadata},
            {"model", context_.response_model(lora_)},
            {"output", done ? items_.items() : Json::array()},
            {"parallel_tool_calls", request_.chat.parallel_tool_calls},
            {"previous_response_id", nullptr},
            {"prompt_cache_key", request_.prompt_cache_key},
            {"reasoning", request_.reasoning},
            {"safety_identifier", request_.safety_identifier},
            {"service_tier", request_.service_tier},
            {"temperature", echoed(params.temperature)},
            {"text", request_.text},
            {"tool_choice", request_.tool_choice},
            {"tools", request_.tools},
            {"top_logprobs", request_.top_logprobs},
            {"top_p", echoed(params.top_p)},
            {"truncation", request_.truncation},
            {"usage", std::move(usage)},
            {"user", request_.user}};
  }

  // A sampling parameter as the client wrote it: the float32 the sampler holds, printed with the 7
  // digits float32 carries (0.7, not 0.699999988079071).
  static double echoed(float value) {
    char text[32];
    std::snprintf(text, sizeof text, "%.7g", double(value));
    return std::strtod(text, nullptr);
  }

  // One server-sent event, named by its type as vLLM and OpenAI send them, with the next sequence number.
  std::string numbered(Json body) {
    body["sequence_number"] = sequence_number_++;
    return "event: " + body["type"].get<std::string>() + "\n" + sse_event(body);
  }
  std::string event(const char* type, Json fields) {
    Json body = {{"type", type}};
    for (auto& [key, value] : fields.items()) body[key] = value;
    return numbered(std::move(body));
  }

  ServingContext& context_;
  std::string id_;
  int64_t created_;
  ResponsesRequest request_;
  std::shared_ptr<const LoraAdapter> lora_;  // the adapter the request named (null: the base model)
  std::optional<ChatPrompt> prompt_;  // holds a reference to request_.chat
  std::optional<ChatChoiceOutput> output_;
  ResponseOutput items_;
  int64_t output_tokens_ = 0, cached_tokens_ = 0;
  int64_t sequence_number_ = 0;
  std::string finish_reason_;
  std::optional<Generation> generation_;  // last: destroyed first, aborting what still runs
};

}  // namespace

std::unique_ptr<CompletionJob> start_responses(const Json& body, ServingContext& context, Clock::time_point arrival) {
  return std::make_unique<ResponsesCompletion>(body, context, arrival);
}

}  // namespace sparrow::server
