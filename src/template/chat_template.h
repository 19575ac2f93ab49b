// A model's chat template, turning an OpenAI chat-completions request into the prompt text exactly
// as vLLM does through transformers' apply_chat_template (transformers 5.17,
// utils/chat_template_utils.py render_jinja_template):
//
//   variables = the tokenizer's special tokens (bos_token, eos_token, ... from tokenizer_config.json)
//             + messages, tools, documents, add_generation_prompt (default true, as in vLLM)
//             + chat_template_kwargs (which override everything above)
//
// Before rendering, tool-call arguments sent as JSON strings are parsed into objects (vLLM's
// _postprocess_messages). continue_final_message renders the last message open-ended: the prompt
// stops right after its content (transformers' CONTINUE_FINAL_MESSAGE_TAG method).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "template/jinja_template.h"
#include "template/jinja_value.h"

namespace sparrow {

class ChatTemplate {
 public:
  struct Named {
    std::string name;    // "default", "tool_use", ...
    std::string source;  // Jinja text
  };

  // The template of a Hugging Face model folder, found as transformers finds it:
  // chat_template.jinja (plus additional_chat_templates/<name>.jinja) if present, else
  // tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"}).
  // Special tokens are tokenizer_config.json's *_token entries (strings or {"content": ...}).
  // With `template_file` (vLLM's --chat-template), that file is the only template; the special tokens
  // still come from the model folder.
  static ChatTemplate load(const std::string& model_dir, const std::string& template_file = "");

  ChatTemplate(std::vector<Named> templates, jinja::Dict special_tokens);

  // Renders a request body ({"messages": [...], "tools": [...], ...}); bad requests and template
  // errors are one-line sparrow::Errors.
  std::string render(const nlohmann::ordered_json& request) const;

 private:
  struct Parsed {
    std::string name, source;
    jinja::Template parsed;
  };
  const Parsed& select(bool has_tools) const;

  std::vector<Parsed> templates_;
  jinja::Dict special_tokens_;
};

// JSON → template value: objects become dicts in their key order (as Python's json.loads builds
// them), integers ints, other numbers floats.
jinja::Value to_jinja_value(const nlohmann::ordered_json& json);

}  // namespace sparrow
