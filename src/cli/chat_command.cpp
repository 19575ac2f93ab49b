// sparrow chat [--model DIR] [--system TEXT] [--tools FILE.json] [--reasoning-parser NAME]
//              [--tool-call-parser NAME] [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
// A multi-turn chat on stdin / stdout. Each line read is a user message; the whole conversation is
// rendered with the model's chat template (add_generation_prompt) and the reply is streamed as it is
// decoded: reasoning on lines starting "thinking: " (dimmed on a terminal), then the answer, then
// each parsed tool call as "tool call: NAME ARGUMENTS". Tools are not run: "/tool RESULT" sends a
// tool result for the last call. "/exit" or end of input ends the chat. Works with piped input too.
// The parsers default from the model type, as `sparrow serve` would be configured for the model.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/text_generation.h"
#include "core/error.h"
#include "engine/generate.h"
#include "server/parsers/parser.h"
#include "template/chat_template.h"
#include "tokenizer/detokenizer.h"

namespace sparrow::cli {
namespace {

using nlohmann::ordered_json;

struct ChatFlags {
  std::string model_dir, system, tools_path, reasoning_parser, tool_call_parser, device = "cpu", speculative_config;
  int64_t max_tokens = 512;
  int64_t seed = -1;
  SamplingParams sampling;
};

// The reasoning / tool-call parser names of a model type (vLLM's --reasoning-parser and
// --tool-call-parser for these families); empty when unknown.
std::string parser_for(const std::string& model_type) {
  if (model_type == "minimax_m3_vl_text" || model_type == "minimax_m3_vl") return "minimax_m3";
  if (model_type == "kimi_k3") return "kimi_k3";
  if (model_type == "kimi_linear") return "kimi_k2";
  if (model_type == "deepseek_v32") return "deepseek_v32";
  return "";
}

ordered_json read_tools(const std::string& path) {
  std::ifstream in(path);
  SPARROW_CHECK(in, path, ": cannot open");
  ordered_json tools = ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!tools.is_discarded(), path, ": not valid JSON");
  if (tools.is_object() && tools.contains("tools")) tools = tools["tools"];  // a request body is fine too
  SPARROW_CHECK(tools.is_array(), path, ": expected an OpenAI tools list [{\"type\": \"function\", ...}, ...]");
  return tools;
}

// Prints the reply's parts as they stream: reasoning on "thinking: " lines, then the answer.
class ReplyPrinter {
 public:
  explicit ReplyPrinter(bool terminal) : terminal_(terminal) {}

  void reasoning(const std::string& text) {
    if (text.empty()) return;
    if (section_ != Section::kReasoning) {
      start_line();
      write_now(style("thinking: "));
      section_ = Section::kReasoning;
    }
    write_now(style(text));
    at_line_start_ = text.back() == '\n';
  }

  void content(const std::string& text) {
    if (text.empty()) return;
    if (section_ != Section::kContent) {
      start_line();
      section_ = Section::kContent;
    }
    write_now(text);
    at_line_start_ = text.back() == '\n';
  }

  void tool_call(const parsers::ToolCall& call) {
    start_line();
    write_now("tool call: " + call.name + " " + call.arguments + "\n");
    section_ = Section::kToolCall;
  }

  void end() { start_line(); }

 private:
  enum class Section { kNone, kReasoning, kContent, kToolCall };
  void start_line() {
    if (!at_line_start_) write_now("\n");
    at_line_start_ = true;
  }
  std::string style(const std::string& text) const { return terminal_ ? "\033[2m" + text + "\033[0m" : text; }

  bool terminal_;
  Section section_ = Section::kNone;
  bool at_line_start_ = true;
};

void run_chat(ChatFlags& flags) {
  if (flags.model_dir.empty()) flags.model_dir = default_model_dir();
  if (flags.seed >= 0) flags.sampling.seed = uint64_t(flags.seed);
  validate(flags.sampling);
  SPARROW_CHECK(flags.max_tokens >= 1, "--max-tokens must be >= 1");
  const ordered_json tools = flags.tools_path.empty() ? ordered_json() : read_tools(flags.tools_path);
  const SpeculativeConfig speculative = read_speculative_config(flags.speculative_config);

  auto tokenizer = load_tokenizer(flags.model_dir);
  auto model = load_cli_model(flags.model_dir, flags.device);
  const ChatTemplate chat_template = ChatTemplate::load(flags.model_dir);
  const std::string default_parser = parser_for(model->model_type());
  if (flags.reasoning_parser.empty()) flags.reasoning_parser = default_parser;
  if (flags.tool_call_parser.empty()) flags.tool_call_parser = default_parser;
  GenerateOptions options;
  options.sampling = flags.sampling;
  options.max_tokens = flags.max_tokens;
  options.runner = cli_runner_options();
  options.speculative = speculative;
  auto draft = load_draft_model(speculative, flags.model_dir, flags.device, *model);
  options.draft_model = draft.get();
  options.stop_token_ids = eos_token_ids(flags.model_dir);
  if (tokenizer->eos_id()) options.stop_token_ids.insert(*tokenizer->eos_id());
  const std::set<int32_t>& end_tokens = options.stop_token_ids;
  const int64_t context = model_context_length(flags.model_dir);

  const bool terminal = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
  if (terminal)
    std::fprintf(stderr, "chatting with %s (/tool RESULT answers the last tool call, /exit or Ctrl-D ends)\n",
                 flags.model_dir.c_str());
  ordered_json messages = ordered_json::array();
  if (!flags.system.empty()) messages.push_back({{"role", "system"}, {"content", flags.system}});
  std::string last_call_id;

  std::string line;
  while (true) {
    if (terminal) write_now("> ");
    if (!std::getline(std::cin, line) || line == "/exit") break;
    if (line.empty()) continue;
    if (line.rfind("/tool ", 0) == 0) {
      if (last_call_id.empty()) {
        std::fprintf(stderr, "/tool: the model has made no tool call to answer\n");
        continue;
      }
      messages.push_back({{"role", "tool"}, {"tool_call_id", last_call_id}, {"content", line.substr(6)}});
    } else {
      messages.push_back({{"role", "user"}, {"content", line}});
    }

    ordered_json request = {{"messages", messages}, {"add_generation_prompt", true}};
    if (!tools.is_null()) request["tools"] = tools;
    const std::string prompt = chat_template.render(request);
    // The reasoning and tool parsers read the markers, so special tokens stay in the decoded text.
    std::unique_ptr<parsers::ReasoningParser> reasoning_parser;
    if (!flags.reasoning_parser.empty())
      reasoning_parser = parsers::make_reasoning_parser(
          flags.reasoning_parser, parsers::reasoning_options(flags.reasoning_parser, nullptr, prompt));
    std::unique_ptr<parsers::ToolParser> tool_parser;
    if (!flags.tool_call_parser.empty())
      tool_parser = parsers::make_tool_parser(flags.tool_call_parser, nlohmann::json::parse(tools.dump()));
    parsers::OutputParser parser(std::move(reasoning_parser), std::move(tool_parser));
    parsers::ParsedOutput reply;
    ReplyPrinter printer(terminal);
    auto show = [&](const parsers::OutputDelta& delta) {
      reply.append(delta);
      printer.reasoning(delta.reasoning);
      printer.content(delta.content);
    };

    IncrementalDetokenizer detokenizer(*tokenizer);
    generate_streaming(*model, tokenizer->encode(prompt), options, context, [&](int32_t token) {
      if (!end_tokens.count(token)) show(parser.feed(detokenizer.push(token).text));
    });
    show(parser.feed(detokenizer.finish().text));
    show(parser.finish());
    for (const auto& call : reply.tool_calls) printer.tool_call(call);
    printer.end();

    ordered_json message = {{"role", "assistant"}, {"content", reply.content}};
    if (!reply.reasoning.empty()) message["reasoning_content"] = reply.reasoning;
    if (!reply.tool_calls.empty()) {
      message["tool_calls"] = ordered_json::array();
      for (const auto& call : reply.tool_calls)
        message["tool_calls"].push_back({{"id", call.id},
                                         {"type", "function"},
                                         {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
      last_call_id = reply.tool_calls.back().id;
    }
    messages.push_back(std::move(message));
  }
}

}  // namespace

void add_chat(CLI::App& app) {
  auto* sub = app.add_subcommand("chat", "Chat with the model on stdin / stdout (streamed, multi-turn)");
  static ChatFlags flags;
  flags.sampling.temperature = 0.0f;  // greedy by default: small models answer most reliably so
  sub->add_option("--model", flags.model_dir, "Hugging Face model folder (default: the bundled model)");
  add_device_option(sub, flags.device);
  add_speculative_option(sub, flags.speculative_config);
  sub->add_option("--system", flags.system, "system message that opens the conversation");
  sub->add_option("--tools", flags.tools_path, "JSON file with an OpenAI tools list the model may call");
  sub->add_option("--reasoning-parser", flags.reasoning_parser, "default: from the model type");
  sub->add_option("--tool-call-parser", flags.tool_call_parser, "default: from the model type");
  sub->add_option("--max-tokens", flags.max_tokens, "most tokens per reply")->capture_default_str();
  sub->add_option("--temperature", flags.sampling.temperature, "0 = greedy")->capture_default_str();
  sub->add_option("--top-p", flags.sampling.top_p, "nucleus sampling mass");
  sub->add_option("--top-k", flags.sampling.top_k, "keep the k most likely tokens (0 = all)");
  sub->add_option("--seed", flags.seed, "random seed");
  on_selected(sub, [] { run_chat(flags); });
}

}  // namespace sparrow::cli
