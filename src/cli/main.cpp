// `sparrow <subcommand>`: the command-line front end. Each subcommand is a small function in its own
// file (<subcommand>_command.cpp); this file only wires them to CLI11 and turns errors into one line on
// stderr and exit code 1.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"sparrow: an inference engine for sparse-attention language models"};
  app.require_subcommand(1);
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    sparrow::cli::run_selected();
  } catch (const sparrow::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
