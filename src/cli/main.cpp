// `sparrow <subcommand>`: the command-line front end. Each subcommand is a small function in its own
// file (<subcommand>_command.cpp); this file only wires them to CLI11 and turns errors into one line on
// stderr and exit code 1.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/vllm_flags.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"sparrow: an inference engine for sparse-attention language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", SPARROW_VERSION);
  sparrow::cli::add_score(app);
  sparrow::cli::add_generate(app);
  sparrow::cli::add_bench(app);
  sparrow::cli::add_serve(app);
  sparrow::cli::add_render(app);
  sparrow::cli::add_tokenize(app);
  sparrow::cli::add_detokenize(app);
  sparrow::cli::add_chat(app);
  sparrow::cli::add_perplexity(app);
  sparrow::cli::add_kv_plan(app);
  sparrow::cli::add_proxy(app);
  // vLLM's short spellings such as -tp, which CLI11 cannot name (one dash, two letters).
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::string& arg : args) arg = sparrow::cli::expand_vllm_short_flag(arg);
  std::reverse(args.begin(), args.end());  // CLI11's parse(vector) takes the arguments last first
  app.name(argv[0]);
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  sparrow::cli::set_program_arguments(argv);
  try {
    sparrow::cli::run_selected();
  } catch (const std::exception& e) {
    sparrow::cli::report_failure(e.what());
    return 1;
  }
  return 0;
}
