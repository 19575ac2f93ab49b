// A model folder's image processor: an image file's bytes to what the engine takes (vision/image_input.h), with
// the family's processor (by config.json's model_type) under the folder's preprocessor_config.json. The one place
// that picks a processor for a model: the prompt files of `generate` / `score` and the server's image parts go
// through it.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "vision/image.h"
#include "vision/image_input.h"
#include "vision/minimax_m3_vl_processor.h"

namespace sparrow::vision {

class ImageProcessor {
 public:
  // The processor of the model in `dir`; a one-line error for a model that takes no images here.
  static ImageProcessor for_model(const std::string& dir);

  // Decodes (under `limits`) and processes one image: its patches, grid, placeholder count and content hash; the
  // offset is the caller's to set.
  ImageInput process(std::string_view bytes, const DecodeLimits& limits = {}) const;

 private:
  MiniMaxM3VlProcessorConfig minimax_;
};

// Sets each image's offset: image i takes the i-th run of its `tokens` placeholder ids, scanning the prompt from
// the previous image's end; then check_image_placeholders. One-line errors when the prompt holds too few or too
// many placeholders for the images.
void place_images(const std::vector<int32_t>& prompt, std::vector<ImageInput>& images, int32_t placeholder);

}  // namespace sparrow::vision
