// A model folder's image processor: an image file's bytes to what the engine takes (vision/image_input.h), with
// the family's processor (by config.json's model_type: minimax_m3_vl or kimi_k3) under the folder's
// preprocessor_config.json. The one place that picks a processor for a model: the prompt files of `generate` /
// `score` and the server's image parts go through it.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vision/image.h"
#include "vision/image_input.h"
#include "vision/kimi_k3_processor.h"
#include "vision/minimax_m3_vl_processor.h"

namespace sparrow::vision {

class ImageProcessor {
 public:
  // The processor of the model in `dir`; a one-line error for a model that takes no images here.
  static ImageProcessor for_model(const std::string& dir);

  // Decodes (under `limits`) and processes one image: its patches, grid, placeholder count and content hash; the
  // offset is the caller's to set.
  ImageInput process(std::string_view bytes, const DecodeLimits& limits = {}) const;

  // The text the chat template writes for an image (one token) and what vLLM's prompt update turns it into:
  // `before`, the image's `tokens` pads, `after`. MiniMax-M3 (models/minimax_m3/common/mm_preprocess.py):
  // "]<]image[>[" becomes "]<]start of image[>[", the pads (the same "]<]image[>[") and "]<]end of image[>[". Kimi K3
  // (models/kimi_k3/common/mm_preprocess.py _get_prompt_updates): "<|kimi_image_placeholder|>" becomes
  // "<|media_begin|>image {width}x{height}<|media_content|>", "<|media_pad|>" pads and "<|media_end|>", the size
  // the decoded image's.
  struct PlaceholderText {
    std::string image, pad;
  };
  PlaceholderText placeholder_text() const;
  struct Replacement {
    std::string before, after;
  };
  Replacement replacement(const ImageInput& image) const;

 private:
  MiniMaxM3VlProcessorConfig minimax_;
  std::optional<KimiK3ProcessorConfig> kimi_;  // set: Kimi K3's processor, else MiniMax-M3-VL's
};

// Sets each image's offset: image i takes the i-th run of its `tokens` placeholder ids, scanning the prompt from
// the previous image's end; then check_image_placeholders. One-line errors when the prompt holds too few or too
// many placeholders for the images.
void place_images(const std::vector<int32_t>& prompt, std::vector<ImageInput>& images, int32_t placeholder);

// The ids of a rendered chat prompt, where the template wrote one `placeholder` per image, with image i's placeholder
// replaced by around[i].first, image.tokens `pad` ids and around[i].second (vLLM's prompt update), and each image's
// offset set (its first pad). A one-line error when the prompt holds another number of placeholders than there are
// images.
std::vector<int32_t> expand_placeholders(const std::vector<int32_t>& ids, std::vector<ImageInput>& images,
                                         int32_t placeholder, int32_t pad,
                                         const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>>& around);

}  // namespace sparrow::vision
