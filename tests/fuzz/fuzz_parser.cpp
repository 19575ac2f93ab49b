// One reasoning + tool-call parser kind (SPARROW_FUZZ_PARSER, e.g. "kimi_k3"; tests/fuzz/CMakeLists.txt
// builds one target per kind) on fuzzed model output. Input: one byte of options, then the output text in
// which each 0xFF byte (never part of UTF-8) marks where one streamed delta ends and the next begins.
// Every delta is made valid UTF-8 as the engine's detokenizer makes it. Checked, as parser.h promises:
// joining the streamed deltas gives the result of parsing the whole text at once, and a call's id and name
// come once, in its first delta, with indexes counting up from 0.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "server/parsers/parser.h"
#include "tokenizer/utf8.h"

using namespace sparrow;
using namespace sparrow::parsers;

namespace {

// The tools of the format's test vectors (tests/data/parsers/<kind>.json), whose JSON schemas type the
// untyped argument values of some formats (MiniMax, DeepSeek); null where the file lists none.
const nlohmann::json& tools() {
  static const nlohmann::json list =
      nlohmann::json::parse(fuzz::read_file(fuzz::source_path("tests/data/parsers/" SPARROW_FUZZ_PARSER ".json")))
          .value("tools", nlohmann::json());
  return list;
}

struct Options {
  bool reasoning, tools, thinking, prompt_opens_reasoning, tools_listed;
};

OutputParser make_parser(const Options& o) {
  ReasoningOptions reasoning{o.thinking, o.prompt_opens_reasoning};
  return OutputParser(o.reasoning ? make_reasoning_parser(SPARROW_FUZZ_PARSER, reasoning) : nullptr,
                      o.tools ? make_tool_parser(SPARROW_FUZZ_PARSER, o.tools_listed ? tools() : nlohmann::json(),
                                                 /*id_seed=*/7)
                              : nullptr);
}

std::string describe(const ParsedOutput& out) {
  nlohmann::json calls = nlohmann::json::array();
  for (const ToolCall& call : out.tool_calls)
    calls.push_back({{"id", call.id}, {"name", call.name}, {"arguments", call.arguments}});
  return nlohmann::json{{"reasoning", out.reasoning}, {"content", out.content}, {"tool_calls", calls}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Options options{bool(data[0] & 1), bool(data[0] & 2), bool(data[0] & 4), bool(data[0] & 8),
                        !(data[0] & 16)};
  std::vector<std::string> deltas(1);
  for (size_t i = 1; i < size; ++i) {
    if (data[i] == 0xFF)
      deltas.emplace_back();
    else
      deltas.back() += char(data[i]);
  }
  std::string whole;
  for (std::string& delta : deltas) whole += delta = utf8::decode_lossy(delta);

  OutputParser whole_parser = make_parser(options);
  const ParsedOutput at_once = parse_output(whole_parser, whole);

  OutputParser streaming = make_parser(options);
  ParsedOutput joined;
  std::set<int> announced;
  auto take = [&](const OutputDelta& delta) {
    int previous = -1;
    for (const ToolCallDelta& piece : delta.tool_calls) {
      fuzz::require(piece.index > previous, "one entry per call index, in order");
      previous = piece.index;
      bool first = announced.insert(piece.index).second;
      fuzz::require(first == !piece.id.empty() && first == !piece.name.empty(),
                    "a call's id and name come once, in its first delta");
      fuzz::require(!first || piece.index == int(announced.size()) - 1, "call indexes count up from 0");
    }
    joined.append(delta);
  };
  for (const std::string& delta : deltas) take(streaming.feed(delta));
  take(streaming.finish());
  if (describe(joined) != describe(at_once)) {
    std::fprintf(stderr, "streamed: %s\nat once:  %s\n", describe(joined).c_str(), describe(at_once).c_str());
    fuzz::require(false, "the streamed deltas join to the whole text's result");
  }
  return 0;
}
