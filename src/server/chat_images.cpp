#include "server/chat_images.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "core/base64.h"
#include "core/error.h"
#include "server/api_error.h"

namespace sparrow::server {
namespace {

bool starts_with(const std::string& text, std::string_view prefix) { return text.rfind(prefix, 0) == 0; }

// data:[<media type>][;base64],<data> (RFC 2397); images come base64-encoded.
std::string data_url_bytes(const ImageUrl& image) {
  const size_t comma = image.url.find(',');
  if (comma == std::string::npos) bad_request("`" + image.param + "`: a data: URL needs a ',' before its data", image.param);
  const std::string header = image.url.substr(5, comma - 5);
  if (!starts_with(header, "image/"))
    bad_request("`" + image.param + "`: the data: URL's media type must be image/*, got '" + header + "'", image.param);
  if (header.size() < 7 || header.substr(header.size() - 7) != ";base64")
    bad_request("`" + image.param + "`: the data: URL must be base64-encoded (" + header + ";base64)", image.param);
  try {
    return base64_decode(std::string_view(image.url).substr(comma + 1));
  } catch (const Error& e) {
    bad_request("`" + image.param + "`: " + e.what(), image.param);
  }
}

std::string file_url_bytes(const ImageUrl& image, const std::string& allowed) {
  namespace fs = std::filesystem;
  if (allowed.empty())
    bad_request("`" + image.param + "`: local files are served only under --allowed-local-media-path", image.param);
  std::error_code error;
  const fs::path path = fs::weakly_canonical(fs::path(image.url.substr(7)), error);
  const fs::path root = fs::weakly_canonical(fs::path(allowed), error);
  const auto [end, _] = std::mismatch(root.begin(), root.end(), path.begin(), path.end());
  if (error || end != root.end())
    bad_request("`" + image.param + "`: the file is not under --allowed-local-media-path", image.param);
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_request("`" + image.param + "`: cannot open " + path.string(), image.param);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A prompt's images (named by `params`) may be served: the model takes images and they are within the limit.
void check_image_count(const std::vector<std::string>& params, const ImageServing* serving) {
  if (!serving) bad_request("the served model takes no images", params.front());
  if (int64_t(params.size()) > serving->limit_per_prompt)
    bad_request("at most " + std::to_string(serving->limit_per_prompt) + " image(s) may be provided in one prompt (" +
                    std::to_string(params.size()) + " given; --limit-mm-per-prompt)",
                params[size_t(serving->limit_per_prompt)]);
}

}  // namespace

std::string image_url_bytes(const ImageUrl& image, const std::string& allowed_local_media_path) {
  if (starts_with(image.url, "data:")) return data_url_bytes(image);
  if (starts_with(image.url, "file://")) return file_url_bytes(image, allowed_local_media_path);
  bad_request("`" + image.param + "`: sparrow fetches no URLs; send the image as a data: URL (base64)", image.param);
}

std::vector<vision::ImageInput> place_prompt_images(const std::vector<std::string>& bytes,
                                                    const std::vector<std::string>& params, const ImageServing* serving,
                                                    std::vector<int32_t>& ids) {
  if (bytes.empty()) return {};
  check_image_count(params, serving);
  std::vector<vision::ImageInput> images;
  for (size_t i = 0; i < bytes.size(); ++i) {
    try {
      images.push_back(serving->processor.process(bytes[i], {serving->max_pixels}));
    } catch (const Error& e) {
      bad_request("`" + params[i] + "`: " + e.what(), params[i]);
    }
  }
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> around;
  for (const vision::ImageInput& image : images) {
    const vision::ImageProcessor::Replacement text = serving->processor.replacement(image);
    around.push_back({serving->tokenizer->encode(text.before), serving->tokenizer->encode(text.after)});
  }
  try {
    ids = vision::expand_placeholders(ids, images, serving->placeholder, serving->pad, around);
  } catch (const Error& e) {
    bad_request(std::string(e.what()) + " (the chat template renders one per image part)", params.front());
  }
  return images;
}

std::vector<vision::ImageInput> load_chat_images(const std::vector<ImageUrl>& urls, const ImageServing* serving,
                                                 std::vector<int32_t>& ids) {
  if (urls.empty()) return {};
  std::vector<std::string> bytes, params;
  for (const ImageUrl& url : urls) params.push_back(url.param);
  check_image_count(params, serving);  // before any image is read
  for (const ImageUrl& url : urls) bytes.push_back(image_url_bytes(url, serving->allowed_local_media_path));
  return place_prompt_images(bytes, params, serving, ids);
}

// --limit-mm-per-prompt: vLLM's JSON, '{"image": N}'; sparrow takes images only.
int64_t image_limit(const std::string& flag) {
  if (flag.empty()) return 999;  // vLLM's default per modality
  const nlohmann::json j = nlohmann::json::parse(flag, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(j.is_object(), "--limit-mm-per-prompt must be JSON such as '{\"image\": 4}', not '", flag, "'");
  int64_t limit = 999;
  for (const auto& [modality, value] : j.items()) {
    SPARROW_CHECK(modality == "image", "--limit-mm-per-prompt: sparrow reads images only, not ", modality);
    SPARROW_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0,
                  "--limit-mm-per-prompt: the image limit must be a count >= 0");
    limit = value.get<int64_t>();
  }
  return limit;
}

std::shared_ptr<const ImageServing> make_image_serving(const std::string& model_dir, const VisionEncoder* tower,
                                                       const Tokenizer* tokenizer, const std::string& limit_json,
                                                       const std::string& local_path) {
  auto serving = std::make_shared<ImageServing>();
  serving->limit_per_prompt = image_limit(limit_json);
  if (!local_path.empty()) {
    SPARROW_CHECK(std::filesystem::is_directory(local_path), "--allowed-local-media-path ", local_path,
                  " is not a folder");
    serving->allowed_local_media_path = local_path;
  }
  if (!tower || !tokenizer) return nullptr;
  serving->processor = vision::ImageProcessor::for_model(model_dir);
  const auto text = serving->processor.placeholder_text();
  const auto image = tokenizer->token_to_id(text.image), pad = tokenizer->token_to_id(text.pad);
  if (!image || !pad) {
    std::fprintf(stderr, "sparrow: images are off: the tokenizer has no '%s' token\n",
                 (!image ? text.image : text.pad).c_str());
    return nullptr;
  }
  SPARROW_CHECK(*pad == tower->image_token_id(), model_dir, ": the tokenizer's ", text.pad, " is id ", *pad,
                ", config.json's image placeholder id ", tower->image_token_id());
  serving->tokenizer = tokenizer;
  serving->placeholder = *image;
  serving->pad = *pad;
  return serving;
}

}  // namespace sparrow::server
