// --chat-template: a template file replaces the model's template while the model's special tokens stay.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "template/chat_template.h"

namespace fs = std::filesystem;

TEST(ChatTemplateOverride, FileReplacesTheModelsTemplate) {
  const std::string model = std::string(SPARROW_SOURCE_DIR) + "/models/minimax_m3";
  fs::path file = fs::temp_directory_path() / ("sparrow_override_" + std::to_string(::getpid()) + ".jinja");
  std::ofstream(file) << "[{{ eos_token }}]{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  auto request = nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": "hi"}]})");
  std::string eos = nlohmann::json::parse(std::ifstream(model + "/tokenizer_config.json"))["eos_token"].get<std::string>();
  EXPECT_EQ(sparrow::ChatTemplate::load(model, file.string()).render(request), "[" + eos + "]user: hi\n");
  EXPECT_NE(sparrow::ChatTemplate::load(model).render(request), "[" + eos + "]user: hi\n");
  fs::remove(file);
  EXPECT_THROW(sparrow::ChatTemplate::load(model, "/nonexistent/template.jinja"), sparrow::Error);
}
