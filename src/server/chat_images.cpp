#include "server/chat_images.h"

#include <filesystem>
#include <fstream>
#include <iterator>

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

}  // namespace

std::string image_url_bytes(const ImageUrl& image, const std::string& allowed_local_media_path) {
  if (starts_with(image.url, "data:")) return data_url_bytes(image);
  if (starts_with(image.url, "file://")) return file_url_bytes(image, allowed_local_media_path);
  bad_request("`" + image.param + "`: sparrow fetches no URLs; send the image as a data: URL (base64)", image.param);
}

std::vector<vision::ImageInput> load_chat_images(const std::vector<ImageUrl>& urls, const ImageServing* serving,
                                                 std::vector<int32_t>& ids) {
  if (urls.empty()) return {};
  if (!serving) bad_request("the served model takes no images", urls.front().param);
  if (int64_t(urls.size()) > serving->limit_per_prompt)
    bad_request("at most " + std::to_string(serving->limit_per_prompt) + " image(s) may be provided in one prompt (" +
                    std::to_string(urls.size()) + " given; --limit-mm-per-prompt)",
                urls[size_t(serving->limit_per_prompt)].param);
  std::vector<vision::ImageInput> images;
  for (const ImageUrl& url : urls) {
    const std::string bytes = image_url_bytes(url, serving->allowed_local_media_path);
    try {
      images.push_back(serving->processor.process(bytes, {serving->max_pixels}));
    } catch (const Error& e) {
      bad_request("`" + url.param + "`: " + e.what(), url.param);
    }
  }
  try {
    ids = vision::expand_placeholders(ids, images, serving->placeholder, serving->begin, serving->end);
  } catch (const Error& e) {
    bad_request(std::string(e.what()) + " (the chat template renders one per image part)", urls.front().param);
  }
  return images;
}

}  // namespace sparrow::server
