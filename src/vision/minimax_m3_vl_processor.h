// MiniMax-M3-VL's image processor (transformers 5.17, models/minimax_m3_vl/image_processing_minimax_m3_vl.py,
// the Qwen2-VL scheme): an RGB image becomes a grid of patches the vision tower embeds.
//   1. smart_resize: both sides to multiples of patch x merge (28), the pixel count within
//      [min_pixels, max_pixels], the aspect ratio kept as closely as possible; an aspect ratio over 200 is refused
//      (or vLLM 0.33.0's variant, which serves the released checkpoint: smart_resize_vllm below);
//   2. resize_bicubic (resize.h, ResizeKernel::Torch) to that size;
//   3. normalise: (x - mean') / std' in float32, where mean' = mean x 255 and std' = std x 255, each computed
//      in float32 (transformers fuses the 1/255 rescale into the mean and std this way);
//   4. patchify: rows in merge-window order (for each 2x2 window of patches, row-major; windows row-major),
//      each row the patch's channels x temporal copies x 14 x 14 pixels (a still image fills both temporal
//      slots with itself).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "core/tensor.h"
#include "vision/image.h"

namespace sparrow::vision {

// Which engine's smart_resize the processor follows: transformers 5.17's (the tests' reference) or vLLM
// 0.33.0's (transformers_utils/processors/minimax_m3.py), which serves the released checkpoint.
enum class MiniMaxResizeRule { Transformers, Vllm };

struct MiniMaxM3VlProcessorConfig {
  int64_t patch_size = 14, temporal_patch_size = 2, merge_size = 2;
  int64_t min_pixels = 4 * 28 * 28, max_pixels = 451584;  // the processor's size: shortest_edge, longest_edge
  std::array<float, 3> mean = {0.48145466f, 0.4578275f, 0.40821073f};  // OPENAI_CLIP_MEAN
  std::array<float, 3> std = {0.26862954f, 0.26130258f, 0.27577711f};  // OPENAI_CLIP_STD
  MiniMaxResizeRule rule = MiniMaxResizeRule::Vllm;
  int64_t max_long_side_pixel = 0;  // vLLM's long-side rule when positive (the Vllm rule only)

  // A checkpoint folder's preprocessor_config.json (transformers' keys: patch_size, temporal_patch_size,
  // merge_size, min_pixels / max_pixels or size.shortest_edge / longest_edge, image_mean, image_std; vLLM's
  // max_long_side_pixel), the defaults above where a key is absent or the file is; one-line errors for a
  // value of the wrong kind. The rule is vLLM's.
  static MiniMaxM3VlProcessorConfig from_folder(const std::string& dir);
};

// The processor's output for one image: its patches and its grid (grid_t = 1 for an image).
struct MiniMaxM3VlImagePatches {
  Tensor pixel_values;  // [grid_h * grid_w, 3 * temporal_patch_size * patch_size^2] fp32
  int64_t grid_t = 1, grid_h = 0, grid_w = 0;
  // The placeholder tokens the image takes in a prompt: one per merged window.
  int64_t tokens(int64_t merge_size) const { return grid_t * grid_h * grid_w / (merge_size * merge_size); }
};

// The (height, width) an image of height x width is resized to (Qwen2-VL's smart_resize; Python's round
// is half-to-even).
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels);

// vLLM 0.33.0's smart_resize for MiniMax-M3. Each side first rounded to a multiple of `factor` and at least
// `factor`; then, as transformers, the area brought within [4 * 28 * 28, max_pixels] (vLLM passes no
// min_pixels: its default). With max_long_side_pixel > 0, MiniMax-M3's long-side rule instead: a long side
// over it shrinks to it, else a short side under 112 grows to 112 (the scale kept), both sides rounded to
// multiples of `factor` (at least `factor`), and an area over 3584^2 is refused. An aspect ratio over 200 is
// refused either way.
std::pair<int64_t, int64_t> smart_resize_vllm(int64_t height, int64_t width, int64_t factor, int64_t max_pixels,
                                              int64_t max_long_side_pixel = 0);

MiniMaxM3VlImagePatches minimax_m3_vl_patches(const Image& image, const MiniMaxM3VlProcessorConfig& config = {});

}  // namespace sparrow::vision
