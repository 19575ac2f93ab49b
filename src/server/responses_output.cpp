#include "server/responses_output.h"

#include "server/openai_responses.h"

namespace sparrow::server {

Json ResponseOutput::item_event(const char* type) const {
  return {{"type", type}, {"item_id", items_.back()["id"]}, {"output_index", items_.size() - 1}};
}

std::vector<Json> ResponseOutput::add(const parsers::OutputDelta& delta, const Json& logprobs) {
  std::vector<Json> events;
  if (with_logprobs_)
    for (const Json& entry : logprobs) unsent_logprobs_.push_back(entry);
  if (!delta.reasoning.empty()) {
    if (open_ != Kind::Reasoning) open(Kind::Reasoning, nullptr, events);
    text_ += delta.reasoning;
    Json event = item_event("response.reasoning_text.delta");
    event["content_index"] = 0;
    event["delta"] = delta.reasoning;
    events.push_back(std::move(event));
  }
  if (!delta.content.empty()) {
    if (open_ != Kind::Message) open(Kind::Message, nullptr, events);
    text_ += delta.content;
    for (const Json& entry : unsent_logprobs_) part_logprobs_.push_back(entry);
    Json event = item_event("response.output_text.delta");
    event["content_index"] = 0;
    event["delta"] = delta.content;
    event["logprobs"] = std::move(unsent_logprobs_);
    unsent_logprobs_ = Json::array();
    events.push_back(std::move(event));
  }
  for (const parsers::ToolCallDelta& piece : delta.tool_calls) {
    if (open_ != Kind::Call || open_call_ != piece.index) open(Kind::Call, &piece, events);
    if (piece.arguments.empty()) continue;
    text_ += piece.arguments;
    Json event = item_event("response.function_call_arguments.delta");
    event["delta"] = piece.arguments;
    events.push_back(std::move(event));
  }
  // Tokens whose text went to the reasoning or a call have no place among the text's logprobs.
  if (!delta.empty() && delta.content.empty()) unsent_logprobs_ = Json::array();
  return events;
}

std::vector<Json> ResponseOutput::finish(bool cut_short) {
  std::vector<Json> events;
  close(cut_short ? "incomplete" : "completed", events);
  return events;
}

void ResponseOutput::open(Kind kind, const parsers::ToolCallDelta* call, std::vector<Json>& events) {
  close("completed", events);
  Json item;
  Json part;
  if (kind == Kind::Reasoning) {
    item = {{"id", random_id("rs_")},
            {"type", "reasoning"},
            {"summary", Json::array()},
            {"content", Json::array()},
            {"status", "in_progress"}};
    part = {{"type", "reasoning_text"}, {"text", ""}};
  } else if (kind == Kind::Message) {
    item = {{"id", random_id("msg_")},
            {"type", "message"},
            {"role", "assistant"},
            {"content", Json::array()},
            {"status", "in_progress"}};
    part = {{"type", "output_text"}, {"text", ""}, {"annotations", Json::array()}, {"logprobs", Json::array()}};
  } else {
    item = {{"id", random_id("fc_")}, {"type", "function_call"}, {"call_id", call->id},
            {"name", call->name},     {"arguments", ""},         {"status", "in_progress"}};
    open_call_ = call->index;
  }
  items_.push_back(item);
  open_ = kind;
  text_.clear();
  part_logprobs_ = Json::array();
  events.push_back({{"type", "response.output_item.added"}, {"output_index", items_.size() - 1}, {"item", item}});
  if (!part.is_null()) {
    Json event = item_event("response.content_part.added");
    event["content_index"] = 0;
    event["part"] = std::move(part);
    events.push_back(std::move(event));
  }
}

void ResponseOutput::close(const char* status, std::vector<Json>& events) {
  if (open_ == Kind::None) return;
  if (open_ == Kind::Call) {
    item()["arguments"] = text_;
    Json done = item_event("response.function_call_arguments.done");
    done["name"] = item()["name"];
    done["arguments"] = text_;
    events.push_back(std::move(done));
  } else {
    const bool reasoning = open_ == Kind::Reasoning;
    Json part = reasoning ? Json{{"type", "reasoning_text"}, {"text", text_}}
                          : Json{{"type", "output_text"},
                                 {"text", text_},
                                 {"annotations", Json::array()},
                                 {"logprobs", part_logprobs_}};
    Json done = item_event(reasoning ? "response.reasoning_text.done" : "response.output_text.done");
    done["content_index"] = 0;
    done["text"] = text_;
    if (!reasoning) done["logprobs"] = part_logprobs_;
    events.push_back(std::move(done));
    Json part_done = item_event("response.content_part.done");
    part_done["content_index"] = 0;
    part_done["part"] = part;
    events.push_back(std::move(part_done));
    item()["content"] = Json::array({std::move(part)});
  }
  item()["status"] = status;
  events.push_back({{"type", "response.output_item.done"}, {"output_index", items_.size() - 1}, {"item", item()}});
  open_ = Kind::None;
  open_call_ = -1;
}

}  // namespace sparrow::server
