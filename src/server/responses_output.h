// The output of one /v1/responses generation as the Responses API's output items, built from the chat
// path's parser deltas (chat_output.h) in the order they arrive, and the stream events that build the
// same items on the client (vLLM's streaming_events.py "simple" processor; OpenAI's event reference):
//
//   reasoning  {"type": "reasoning", "id": "rs_…", "summary": [], "content": [{"type": "reasoning_text",
//              "text"}], "status"}: output_item.added, content_part.added, reasoning_text.delta…,
//              reasoning_text.done, content_part.done, output_item.done
//   message    {"type": "message", "id": "msg_…", "role": "assistant", "status", "content":
//              [{"type": "output_text", "text", "annotations": [], "logprobs"}]}: output_item.added,
//              content_part.added, output_text.delta…, output_text.done, content_part.done,
//              output_item.done
//   call       {"type": "function_call", "id": "fc_…", "call_id", "name", "arguments", "status"}:
//              output_item.added, function_call_arguments.delta…, function_call_arguments.done,
//              output_item.done
//
// One item is open at a time: a delta of another kind (or another call) closes it ("completed") and
// opens the next; finish() closes the last one, "incomplete" when the output was cut at
// max_output_tokens. The items a non-streamed response returns are the ones the events built, ids
// included, so the two agree by construction (the openai client checks the ids of a stream's items
// against response.completed's).
//
// Logprobs (include "message.output_text.logprobs") go with the text: the entries of the tokens since
// the last delta are attached to the next output_text delta, and dropped when that delta is reasoning
// or a call instead (a token whose text the parsers held back counts with the delta that showed it).
#pragma once
#include <string>
#include <vector>

#include "server/json_fields.h"
#include "server/parsers/parser.h"

namespace sparrow::server {

class ResponseOutput {
 public:
  explicit ResponseOutput(bool with_logprobs = false) : with_logprobs_(with_logprobs) {}

  // The events (without "sequence_number": the stream numbers them) for the next delta; `logprobs`
  // holds the entries of the tokens that made it (chat_logprob_entries' shape), or is empty.
  std::vector<Json> add(const parsers::OutputDelta& delta, const Json& logprobs = Json::array());
  // Closes the open item; its status is "incomplete" when `cut_short`, else "completed".
  std::vector<Json> finish(bool cut_short);

  // The items so far, closed ones in their final form: the response's `output`.
  const Json& items() const { return items_; }

 private:
  enum class Kind { None, Reasoning, Message, Call };
  void open(Kind kind, const parsers::ToolCallDelta* call, std::vector<Json>& events);
  void close(const char* status, std::vector<Json>& events);
  Json& item() { return items_.back(); }
  Json item_event(const char* type) const;  // {"type", "item_id", "output_index"}

  bool with_logprobs_;
  Json items_ = Json::array();
  Kind open_ = Kind::None;
  int open_call_ = -1;                  // the parser's index of the open call
  std::string text_;                    // the open item's text or arguments so far
  Json part_logprobs_ = Json::array();  // the open message's logprobs so far
  Json unsent_logprobs_ = Json::array();
};

}  // namespace sparrow::server
