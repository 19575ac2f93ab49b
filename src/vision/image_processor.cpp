#include "vision/image_processor.h"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace sparrow::vision {

ImageProcessor ImageProcessor::for_model(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  SPARROW_CHECK(in, path, ": cannot open");
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(config.is_object(), path, ": not a JSON object");
  const std::string type = config.value("model_type", std::string());
  SPARROW_CHECK(type == "minimax_m3_vl" || type == "kimi_k3", "images: model_type '", type,
                "' takes no images in sparrow (minimax_m3_vl and kimi_k3 do)");
  ImageProcessor processor;
  if (type == "kimi_k3") processor.kimi_ = KimiK3ProcessorConfig::from_folder(dir);
  else processor.minimax_ = MiniMaxM3VlProcessorConfig::from_folder(dir);
  return processor;
}

ImageInput ImageProcessor::process(std::string_view bytes, const DecodeLimits& limits) const {
  const Image decoded = decode_image(bytes, limits);
  ImageInput image;
  if (kimi_) {
    KimiK3ImagePatches patches = kimi_k3_patches(decoded, *kimi_);
    image.grid = {1, patches.grid_h, patches.grid_w};
    image.tokens = patches.num_tokens;
    image.pixel_values = std::move(patches.pixel_values);
  } else {
    MiniMaxM3VlImagePatches patches = minimax_m3_vl_patches(decoded, minimax_);
    image.grid = {patches.grid_t, patches.grid_h, patches.grid_w};
    image.tokens = patches.tokens(minimax_.merge_size);
    image.pixel_values = std::move(patches.pixel_values);
  }
  image.hash = image_content_hash(image.pixel_values, image.grid);
  image.width = decoded.width;
  image.height = decoded.height;
  return image;
}

ImageProcessor::PlaceholderText ImageProcessor::placeholder_text() const {
  if (kimi_) return {"<|kimi_image_placeholder|>", "<|media_pad|>"};
  return {"]<]image[>[", "]<]image[>["};
}

ImageProcessor::Replacement ImageProcessor::replacement(const ImageInput& image) const {
  if (kimi_)
    return {"<|media_begin|>image " + std::to_string(image.width) + "x" + std::to_string(image.height) +
                "<|media_content|>",
            "<|media_end|>"};
  return {"]<]start of image[>[", "]<]end of image[>["};
}

void place_images(const std::vector<int32_t>& prompt, std::vector<ImageInput>& images, int32_t placeholder) {
  size_t next = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    while (next < prompt.size() && prompt[next] != placeholder) ++next;
    SPARROW_CHECK(next < prompt.size(), "the prompt holds placeholders (id ", placeholder, ") for ", i, " of its ",
                  images.size(), " images");
    images[i].offset = int64_t(next);
    next += size_t(images[i].tokens);
  }
  check_image_placeholders(prompt, images, placeholder);
}

std::vector<int32_t> expand_placeholders(const std::vector<int32_t>& ids, std::vector<ImageInput>& images,
                                         int32_t placeholder, int32_t pad,
                                         const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>>& around) {
  const size_t found = size_t(std::count(ids.begin(), ids.end(), placeholder));
  SPARROW_CHECK(found == images.size(), "the rendered prompt holds ", found, " image placeholder(s) for ",
                images.size(), " image(s)");
  SPARROW_CHECK(around.size() == images.size(), "expand_placeholders: ", around.size(), " replacements for ",
                images.size(), " images");
  std::vector<int32_t> out;
  size_t next = 0;
  for (int32_t id : ids) {
    if (id != placeholder) {
      out.push_back(id);
      continue;
    }
    const auto& [before, after] = around[next];
    ImageInput& image = images[next++];
    out.insert(out.end(), before.begin(), before.end());
    image.offset = int64_t(out.size());
    out.insert(out.end(), size_t(image.tokens), pad);
    out.insert(out.end(), after.begin(), after.end());
  }
  return out;
}

}  // namespace sparrow::vision
