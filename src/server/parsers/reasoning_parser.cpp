// The reasoning parsers: one state machine, configured per format by its tags. It follows vLLM's
// parsers (serving-and-parsers.md §1.4, §2.2, §2.4): the end tag switches to content; a start tag
// while reasoning is swallowed; a tool section opened while still reasoning ends the reasoning
// implicitly (the section itself is content, for the tool parser); trailing whitespace of the
// reasoning is dropped (vLLM's strip_trailing_reasoning_whitespace); after the reasoning, content is
// passed on verbatim, except Kimi-K3's channel markup, which is removed up to its tools channel.
#include <utility>

#include "core/error.h"
#include "server/parsers/markers.h"
#include "server/parsers/parser.h"
#include "server/parsers/text_scan.h"

namespace sparrow::parsers {

namespace {

struct ReasoningFormat {
  std::string_view name, start_tag, end_tag;
  // With thinking on, output begins inside the reasoning block even when the prompt does not show it
  // (vLLM's Kimi parser starts in reasoning; MiniMax-M2's template always opens it).
  bool reasoning_first;
  // Markers that open a tool section: they end the reasoning without an end tag.
  std::vector<std::string_view> tool_openers;
  // Channel markup removed from content (Kimi-K3 wraps content in a response channel).
  std::vector<std::string_view> content_wrappers;
};

const std::vector<ReasoningFormat>& reasoning_formats() {
  static const std::vector<ReasoningFormat> formats = {
      {"kimi_k3", kimi_k3::kThinkBegin, kimi_k3::kThinkEnd, true,
       {kimi_k3::kResponseBegin, kimi_k3::kToolsBegin},
       {kimi_k3::kResponseBegin, kimi_k3::kResponseEnd, kimi_k3::kMessageEnd, kimi_k3::kEndOfMessage}},
      {"kimi_k2", kimi_k2::kThinkBegin, kimi_k2::kThinkEnd, true,
       {kimi_k2::kSectionBegin, kimi_k2::kSectionBeginSingular, kimi_k2::kCallBegin}, {}},
      {"minimax_m3", minimax_m3::kThinkBegin, minimax_m3::kThinkEnd, false, {minimax_m3::kSectionBegin}, {}},
      {"minimax_m2", minimax_m2::kThinkBegin, minimax_m2::kThinkEnd, true, {minimax_m2::kSectionBegin}, {}},
      {"deepseek_v32", deepseek_v32::kThinkBegin, deepseek_v32::kThinkEnd, true, {deepseek_v32::kSectionBegin}, {}},
  };
  return formats;
}

const ReasoningFormat& reasoning_format(std::string_view name) {
  for (const ReasoningFormat& format : reasoning_formats())
    if (format.name == name) return format;
  std::string valid;
  for (const std::string& known : parser_names()) valid += (valid.empty() ? "" : ", ") + known;
  fail("unknown reasoning parser '", name, "' (valid: ", valid, ")");
}

class TagReasoningParser final : public ReasoningParser {
 public:
  TagReasoningParser(const ReasoningFormat& format, bool starts_in_reasoning)
      : format_(format), state_(starts_in_reasoning ? State::Reasoning : State::Start) {
    content_markers_ = format.content_wrappers;
    content_markers_.insert(content_markers_.end(), format.tool_openers.begin(), format.tool_openers.end());
    reasoning_markers_ = {format.start_tag, format.end_tag};
    reasoning_markers_.insert(reasoning_markers_.end(), format.tool_openers.begin(), format.tool_openers.end());
  }

  ReasoningDelta feed(std::string_view text) override {
    buffer_ += text;
    scan(/*at_end=*/false);
    return std::exchange(out_, {});
  }

  ReasoningDelta finish() override {
    scan(/*at_end=*/true);
    held_space_.clear();  // trailing whitespace of reasoning that never ended
    return std::exchange(out_, {});
  }

 private:
  enum class State {
    Start,      // nothing decided yet: a leading start tag opens reasoning, a lone end tag is dropped
    Reasoning,
    Content,    // content markup (Kimi-K3) is still removed
    Verbatim,   // the rest is content as it is
  };

  void scan(bool at_end) {
    while (true) {
      switch (state_) {
        case State::Start: {
          size_t space = leading_space(buffer_);
          std::string_view rest = std::string_view(buffer_).substr(space);
          if (rest.starts_with(format_.start_tag)) {
            buffer_.erase(0, space + format_.start_tag.size());
            state_ = State::Reasoning;
          } else if (rest.starts_with(format_.end_tag)) {
            buffer_.erase(0, space + format_.end_tag.size());
            state_ = State::Content;
          } else if (!at_end && (rest.empty() || could_become(rest, format_.start_tag) ||
                                 could_become(rest, format_.end_tag))) {
            return;  // wait for enough text to tell
          } else {
            state_ = State::Content;
          }
          break;
        }
        case State::Reasoning: {
          MarkerHit hit = find_marker(buffer_, reasoning_markers_, at_end);
          emit_reasoning(std::string_view(buffer_).substr(0, hit.pos));
          buffer_.erase(0, hit.pos);
          if (!hit.found()) return;
          if (hit.marker == 0) {  // a start tag inside reasoning: swallowed
            buffer_.erase(0, format_.start_tag.size());
            break;
          }
          if (hit.marker == 1) buffer_.erase(0, format_.end_tag.size());  // a tool opener stays, as content
          held_space_.clear();
          state_ = State::Content;
          break;
        }
        case State::Content: {
          if (format_.content_wrappers.empty()) {
            state_ = State::Verbatim;
            break;
          }
          MarkerHit hit = find_marker(buffer_, content_markers_, at_end);
          out_.content += buffer_.substr(0, hit.pos);
          buffer_.erase(0, hit.pos);
          if (!hit.found()) return;
          if (static_cast<size_t>(hit.marker) < format_.content_wrappers.size())
            buffer_.erase(0, hit.length);
          else
            state_ = State::Verbatim;  // tools follow: their argument text must stay untouched
          break;
        }
        case State::Verbatim:
          out_.content += buffer_;
          buffer_.clear();
          return;
      }
    }
  }

  // Reasoning text, with its trailing whitespace held until more reasoning follows.
  void emit_reasoning(std::string_view text) {
    size_t trailing = trailing_space(text);
    if (trailing == text.size()) {
      held_space_ += text;
      return;
    }
    out_.reasoning += held_space_;
    out_.reasoning += text.substr(0, text.size() - trailing);
    held_space_ = std::string(text.substr(text.size() - trailing));
  }

  const ReasoningFormat& format_;
  std::vector<std::string_view> reasoning_markers_;  // start tag, end tag, then the tool openers
  std::vector<std::string_view> content_markers_;    // content wrappers, then the tool openers
  State state_;
  std::string buffer_, held_space_;
  ReasoningDelta out_;
};

}  // namespace

const std::vector<std::string>& parser_names() {
  static const std::vector<std::string> names = {"kimi_k3", "kimi_k2", "minimax_m3", "minimax_m2", "deepseek_v32"};
  return names;
}

ReasoningOptions reasoning_options(std::string_view parser_name, const nlohmann::json& chat_template_kwargs,
                                   std::string_view prompt) {
  const ReasoningFormat& format = reasoning_format(parser_name);
  ReasoningOptions options;
  if (chat_template_kwargs.is_object()) {
    // The switch each template reads: `thinking` (Kimi), `enable_thinking` (DeepSeek, and vLLM's
    // generic name), `thinking_mode` (MiniMax-M3: "enabled" | "disabled" | "adaptive").
    auto flag = [&](const char* key) -> const nlohmann::json* {
      auto it = chat_template_kwargs.find(key);
      return it != chat_template_kwargs.end() && it->is_boolean() ? &*it : nullptr;
    };
    if (const nlohmann::json* thinking = flag("thinking")) options.thinking = thinking->get<bool>();
    else if (const nlohmann::json* enable = flag("enable_thinking")) options.thinking = enable->get<bool>();
    auto mode = chat_template_kwargs.find("thinking_mode");
    if (mode != chat_template_kwargs.end() && *mode == "disabled") options.thinking = false;
  }
  prompt.remove_suffix(trailing_space(prompt));
  options.prompt_opens_reasoning = prompt.ends_with(format.start_tag);
  return options;
}

std::optional<std::string> reasoning_end_marker(std::string_view name, const ReasoningOptions& options) {
  const ReasoningFormat& format = reasoning_format(name);
  if (!(options.prompt_opens_reasoning || (options.thinking && format.reasoning_first))) return std::nullopt;
  return std::string(format.end_tag);
}

std::unique_ptr<ReasoningParser> make_reasoning_parser(std::string_view name, const ReasoningOptions& options) {
  const ReasoningFormat& format = reasoning_format(name);
  bool starts_in_reasoning = options.prompt_opens_reasoning || (options.thinking && format.reasoning_first);
  return std::make_unique<TagReasoningParser>(format, starts_in_reasoning);
}

}  // namespace sparrow::parsers
