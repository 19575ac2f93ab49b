// sparrow tokenize   [--model DIR] --input FILE.json   {"texts": [...]}        -> {"ids": [[...], ...]}
// sparrow detokenize [--model DIR] --input FILE.json   {"ids": [[...], ...]}   -> {"texts": [...]}
// The model folder needs only its tokenizer files. Encoding adds no BOS/EOS and matches special tokens
// written in the text; decoding keeps special tokens (see tokenizer/tokenizer.h).
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::cli {
namespace {

using nlohmann::json;

// The list under `key` of the JSON object in `path`.
json read_list(const std::string& path, const char* key, const char* expected) {
  std::ifstream in(path);
  SPARROW_CHECK(in, path, ": cannot open");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded(), path, ": not valid JSON (or not UTF-8)");
  SPARROW_CHECK(j.is_object() && j.contains(key) && j[key].is_array(), path, ": expected ", expected);
  return j[key];
}

void print_json(const json& j) {
  std::string text = j.dump(-1, ' ', /*ensure_ascii=*/false);
  std::printf("%s\n", text.c_str());
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto* sub = app.add_subcommand("tokenize", "Token ids of texts, with the model's tokenizer");
  static std::string model_dir, input_path;
  sub->add_option("--model", model_dir, "model folder (its tokenizer files are enough; default: the bundled model)");
  sub->add_option("--input", input_path, "JSON file {\"texts\": [\"...\", ...]}")->required();
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    auto tokenizer = load_tokenizer(model_dir);
    json texts = read_list(input_path, "texts", "{\"texts\": [\"...\", ...]}");
    json ids = json::array();
    for (size_t i = 0; i < texts.size(); ++i) {
      SPARROW_CHECK(texts[i].is_string(), input_path, ": text ", i, " is not a string");
      ids.push_back(tokenizer->encode(texts[i].get_ref<const std::string&>()));
    }
    print_json({{"ids", ids}});
  });
}

void add_detokenize(CLI::App& app) {
  auto* sub = app.add_subcommand("detokenize", "Texts of token id lists, with the model's tokenizer");
  static std::string model_dir, input_path;
  sub->add_option("--model", model_dir, "model folder (its tokenizer files are enough; default: the bundled model)");
  sub->add_option("--input", input_path, "JSON file {\"ids\": [[id, ...], ...]}")->required();
  on_selected(sub, [] {
    if (model_dir.empty()) model_dir = default_model_dir();
    auto tokenizer = load_tokenizer(model_dir);
    json lists = read_list(input_path, "ids", "{\"ids\": [[id, ...], ...]}");
    json texts = json::array();
    for (size_t i = 0; i < lists.size(); ++i) {
      SPARROW_CHECK(lists[i].is_array(), input_path, ": entry ", i, " is not a list of ids");
      std::vector<TokenId> ids;
      for (const json& v : lists[i]) {
        SPARROW_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX, input_path,
                      ": entry ", i, " holds ", v.dump(), ", not a token id");
        ids.push_back(v.get<TokenId>());
      }
      texts.push_back(tokenizer->decode(ids));
    }
    print_json({{"texts", texts}});
  });
}

}  // namespace sparrow::cli
