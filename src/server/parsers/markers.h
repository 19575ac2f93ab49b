// The markup of each output format, as it appears in output decoded with special tokens kept. Sources:
// the chat templates in /work/shared/templates/ (the model writes what the template renders for
// assistant turns) and /work/shared/docs/serving-and-parsers.md §1-§2.
#pragma once
#include <string_view>

namespace sparrow::parsers {

// Kimi K2 / K2-Thinking / K2.5 (kimi-k2-thinking.jinja render_toolcalls):
//   <think>reasoning</think>content<|tool_calls_section_begin|>
//   <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...
//   <|tool_calls_section_end|>
namespace kimi_k2 {
constexpr std::string_view kThinkBegin = "<think>", kThinkEnd = "</think>";
constexpr std::string_view kSectionBegin = "<|tool_calls_section_begin|>", kSectionEnd = "<|tool_calls_section_end|>";
// vLLM's legacy parser also accepts the singular spellings.
constexpr std::string_view kSectionBeginSingular = "<|tool_call_section_begin|>";
constexpr std::string_view kSectionEndSingular = "<|tool_call_section_end|>";
constexpr std::string_view kCallBegin = "<|tool_call_begin|>", kArgumentBegin = "<|tool_call_argument_begin|>";
constexpr std::string_view kCallEnd = "<|tool_call_end|>";
}  // namespace kimi_k2

// Kimi K3 "XTML" (kimi-k3.jinja): elements <|open|>NAME ATTRS<|sep|> ... <|close|>NAME<|sep|> built from
// three special tokens. An assistant message is
//   <|open|>think<|sep|>reasoning<|close|>think<|sep|><|open|>response<|sep|>content<|close|>response<|sep|>
//   <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
//     <|open|>argument key="K" type="string"<|sep|>raw text<|close|>argument<|sep|>
//     <|open|>argument key="K2" type="number"<|sep|>JSON<|close|>argument<|sep|>   (or one <|open|>json type="object"<|sep|>{JSON}<|close|>json<|sep|>)
//   <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>
// The generation prompt already opens the think (or, without thinking, the response) channel.
namespace kimi_k3 {
constexpr std::string_view kOpen = "<|open|>", kClose = "<|close|>", kSep = "<|sep|>";
constexpr std::string_view kThinkBegin = "<|open|>think<|sep|>", kThinkEnd = "<|close|>think<|sep|>";
constexpr std::string_view kResponseBegin = "<|open|>response<|sep|>", kResponseEnd = "<|close|>response<|sep|>";
constexpr std::string_view kToolsBegin = "<|open|>tools<|sep|>", kToolsEnd = "<|close|>tools<|sep|>";
constexpr std::string_view kCallEnd = "<|close|>call<|sep|>";
constexpr std::string_view kMessageEnd = "<|close|>message<|sep|>", kEndOfMessage = "<|end_of_msg|>";
}  // namespace kimi_k3

// MiniMax-M2 (minimax-m2.jinja): the prompt ends with "<think>\n", so output starts inside reasoning:
//   reasoning</think>\n\ncontent\n<minimax:tool_call>\n<invoke name="NAME">\n
//   <parameter name="K">untyped text</parameter>\n...</invoke>\n</minimax:tool_call>
namespace minimax_m2 {
constexpr std::string_view kThinkBegin = "<think>", kThinkEnd = "</think>";
constexpr std::string_view kSectionBegin = "<minimax:tool_call>", kSectionEnd = "</minimax:tool_call>";
constexpr std::string_view kInvokeBegin = "<invoke", kInvokeEnd = "</invoke>";
constexpr std::string_view kParameterBegin = "<parameter", kParameterEnd = "</parameter>";
}  // namespace minimax_m2

// MiniMax-M3 (minimax-m3.jinja): every tool tag follows the namespace token NS = "]<]minimax[>[", and a
// parameter is a tag named after its key; objects nest tags, arrays repeat <item>:
//   <mm:think>reasoning</mm:think>content NS<tool_call>\nNS<invoke name="NAME">NS<city>Boston NS</city>
//   NS<opts>NS<a>1NS</a>NS</opts>NS</invoke>\nNS</tool_call>
// (no spaces around NS in reality). With thinking_mode "enabled" the prompt ends with "<mm:think>",
// with "disabled" with "</mm:think>", otherwise the model chooses.
namespace minimax_m3 {
constexpr std::string_view kThinkBegin = "<mm:think>", kThinkEnd = "</mm:think>";
constexpr std::string_view kNamespace = "]<]minimax[>[";
constexpr std::string_view kSectionBegin = "]<]minimax[>[<tool_call>", kSectionEnd = "]<]minimax[>[</tool_call>";
}  // namespace minimax_m3

// DeepSeek-V3.2 DSML (deepseek-v3.2.jinja; "｜" is U+FF5C): the prompt ends with "<think>" (thinking)
// or "</think>":
//   reasoning</think>content\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n
//   <｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>\n
//   <｜DSML｜parameter name="K2" string="false">JSON</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>
namespace deepseek_v32 {
// The tokenizer's special token inside every DSML tag (the tags themselves are not tokens).
constexpr std::string_view kDsml = "｜DSML｜";
constexpr std::string_view kThinkBegin = "<think>", kThinkEnd = "</think>";
constexpr std::string_view kSectionBegin = "<｜DSML｜function_calls>", kSectionEnd = "</｜DSML｜function_calls>";
constexpr std::string_view kInvokeBegin = "<｜DSML｜invoke", kInvokeEnd = "</｜DSML｜invoke>";
constexpr std::string_view kParameterBegin = "<｜DSML｜parameter", kParameterEnd = "</｜DSML｜parameter>";
}  // namespace deepseek_v32

}  // namespace sparrow::parsers
