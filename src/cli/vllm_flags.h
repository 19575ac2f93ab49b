// The `vllm serve` flags sparrow has no setting of its own for, so that a vLLM command line starts sparrow
// (issue 27): each is accepted and then either ignored with a one-line notice saying why it has no meaning
// here, or refused with the reason. The flags sparrow does implement (--tensor-parallel-size,
// --max-model-len, --kv-cache-dtype, ...) are ordinary options of serve_command.cpp and are not listed
// here. docs/server.md prints this table; a test checks that it lists every entry.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace sparrow::cli {

enum class VllmFlagAction {
  Ignore,  // accepted; a notice on stderr says why it changes nothing
  Refuse,  // start-up stops with the reason
};

struct VllmFlag {
  std::string names;     // "--dtype", "--pipeline-parallel-size,-pp", or a switch with its negations marked
                         // "!" as CLI11 writes them: "--enable-chunked-prefill,!--disable-chunked-prefill"
  bool takes_value;      // false: a switch
  VllmFlagAction action;
  std::string why;       // the notice or the refusal
  // Values (or, for a switch pair, the name) meaning what sparrow does anyway: accepted without a notice
  // ("auto,bfloat16" for --dtype; "--enable-chunked-prefill" for a switch pair).
  std::vector<std::string> same_as_sparrow = {};
};

const std::vector<VllmFlag>& vllm_only_flags();

// Registers the table's flags on `sub` (hidden from --help) and returns the check to run after parsing:
// it prints a notice for each ignored flag given and fails on the first refused one.
std::function<void()> add_vllm_only_flags(CLI::App* sub);

// vLLM's short spellings of one dash and several letters (-tp, -pp, -dp, -dcp, ...), which CLI11 cannot
// name: `arg` with such a spelling replaced by the long name ("-tp=2" -> "--tensor-parallel-size=2"),
// anything else unchanged. main() applies it to every argument before parsing.
std::string expand_vllm_short_flag(const std::string& arg);

}  // namespace sparrow::cli
