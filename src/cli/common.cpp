#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"

namespace sparrow::cli {
namespace {
std::vector<std::pair<CLI::App*, std::function<void()>>>& actions() {
  static std::vector<std::pair<CLI::App*, std::function<void()>>> a;
  return a;
}
}  // namespace

namespace {
bool enforce_eager = false;  // one command runs per process
}  // namespace

void add_device_option(CLI::App* sub, std::string& device) {
  sub->add_option("--device", device, "where the model runs: cpu or cuda (an NVIDIA Hopper GPU)")
      ->capture_default_str();
  sub->add_flag("--enforce-eager", enforce_eager, "launch every kernel of a decode step directly (no CUDA graphs)");
}

std::unique_ptr<Model> load_cli_model(const std::string& dir, const std::string& device) {
  std::unique_ptr<Model> model = load_model(dir, parse_device(device));
  model->enforce_eager = enforce_eager;
  return model;
}

// The bundled model: models/minimax_m3 of the source tree. It is looked for beside the executable's
// folder (build/sparrow -> models/minimax_m3), then in the current directory.
std::string default_model_dir() {
  namespace fs = std::filesystem;
  const fs::path bundled = fs::path("models") / "minimax_m3";
  std::vector<fs::path> candidates;
  std::error_code error;
  fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back(exe.parent_path().parent_path() / bundled);
  candidates.push_back(fs::current_path(error) / bundled);
  for (const fs::path& dir : candidates)
    if (fs::exists(dir / "config.json")) return dir.lexically_normal().string();
  fail("no --model given and the bundled model (", bundled.string(),
       ") is neither next to the executable's folder nor in the current directory; pass --model DIR");
}

void on_selected(CLI::App* sub, std::function<void()> action) { actions().push_back({sub, std::move(action)}); }

void run_selected() {
  for (auto& [sub, action] : actions())
    if (sub->parsed()) action();
}

std::vector<std::vector<int32_t>> read_prompt_ids(const std::string& path) {
  std::ifstream in(path);
  SPARROW_CHECK(in, path, ": cannot open");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded(), path, ": not valid JSON");
  SPARROW_CHECK(j.is_object() && j.contains("prompts") && j["prompts"].is_array(), path,
                ": expected {\"prompts\": [[id, ...], ...]}");
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : j["prompts"]) {
    SPARROW_CHECK(p.is_array() && !p.empty(), path, ": prompt ", prompts.size(), " must be a non-empty list of ids");
    std::vector<int32_t> ids;
    for (const auto& v : p) {
      SPARROW_CHECK(v.is_number_integer(), path, ": prompt ", prompts.size(), " holds a non-integer id");
      int64_t id = v.get<int64_t>();
      SPARROW_CHECK(id >= 0 && id <= INT32_MAX, path, ": prompt ", prompts.size(), " holds the invalid id ", id);
      ids.push_back(int32_t(id));
    }
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

}  // namespace sparrow::cli
