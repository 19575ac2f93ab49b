// An image as a request hands it to the engine: the processor's patches, where the image's placeholder tokens sit
// in the prompt, and the content hash that keys the encoder cache and the prefix cache (vLLM's mm_hash). The
// processors (minimax_m3_vl_processor.h, kimi_k3_processor.h) make the patches; the model's vision tower
// (model/vision_encoder.h) turns them into the placeholders' embeddings.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace sparrow::vision {

struct VisionGrid {
  int64_t t = 1, h = 0, w = 0;  // patches along time, height and width
};

struct ImageInput {
  int64_t offset = 0;   // the first placeholder token's index in the prompt
  int64_t tokens = 0;   // how many placeholder tokens follow it, one embedding row each
  Tensor pixel_values;  // [t * h * w, patch width] fp32 on the host, in the processor's order
  VisionGrid grid;
  uint64_t hash = 0;    // image_content_hash(pixel_values, grid)
  int64_t width = 0, height = 0;  // the decoded image's size, which Kimi K3's prompt names (image_processor.h)
};

// A 64-bit hash of the patches and their grid (XXH3): two images hash alike only when the tower would see the same
// numbers, so equal screenshots share encoder outputs and prefix-cache blocks and different ones never do (barring a
// 64-bit collision).
uint64_t image_content_hash(const Tensor& pixel_values, const VisionGrid& grid);

// Checks a prompt's images against it: each image's placeholders are `tokens` consecutive `placeholder` ids
// inside the prompt, the images in prompt order without overlap, and no placeholder id outside an image. A one-line
// error naming the image otherwise.
void check_image_placeholders(const std::vector<int32_t>& prompt, const std::vector<ImageInput>& images,
                              int32_t placeholder);

}  // namespace sparrow::vision
