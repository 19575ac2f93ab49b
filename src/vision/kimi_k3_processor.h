// Kimi K3's image preprocessing for MoonViT as vLLM 0.33.0 runs it (models/kimi_k3/common/mm_preprocess.py with
// transformers_utils/processors/kimi_k25_vision_fused.py; the checkpoint's preprocessor_config.json
// `media_proc_cfg` gives the settings):
//   1. navit_resize: scale = min(1, sqrt(in_patch_limit / (max(1, w // 14) max(1, h // 14))),
//      side_limit 14 / w, side_limit 14 / h); each side max(1, int(side x scale)), at most side_limit x 14;
//      then zero-padded up to multiples of patch x merge (28);
//   2. PIL's Image.resize(BICUBIC) to the unpadded size (resize.h, ResizeKernel::Pillow);
//   3. normalise by a table: (v / 255 - mean) x (1 / std), in float32 as numpy computes it; padding is the
//      table's value of 0;
//   4. patches [grid_h x grid_w, 3, 14, 14], row-major over the padded grid (no merge-window order here: the
//      tower's 2x2 merge reads them by grid position).
// The prompt then carries `<|media_begin|>image {W}x{H}<|media_content|>` and num_tokens `<|media_pad|>`
// (the original size, not the resized one).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "vision/image.h"

namespace sparrow::vision {

struct KimiK3ProcessorConfig {
  int64_t patch_size = 14, merge_kernel_size = 2;
  int64_t in_patch_limit = 16384, patch_limit_on_one_side = 512;
  std::array<float, 3> mean = {0.5f, 0.5f, 0.5f}, std = {0.5f, 0.5f, 0.5f};

  // A checkpoint folder's preprocessor_config.json `media_proc_cfg` (the keys above; merge_kernel_size may be
  // a list, whose first is taken, as vLLM does), the defaults where a key or the file is absent; a set
  // fixed_output_tokens is refused (navit_resize below assumes it unset).
  static KimiK3ProcessorConfig from_folder(const std::string& dir);
};

struct NavitSize {
  int64_t new_height = 0, new_width = 0, pad_height = 0, pad_width = 0, num_tokens = 0;
};

// vLLM's navit_resize_image (fixed_output_tokens unset).
NavitSize navit_resize(int64_t height, int64_t width, const KimiK3ProcessorConfig& config);

struct KimiK3ImagePatches {
  Tensor pixel_values;  // [grid_h * grid_w, 3 * patch^2] fp32 (vLLM's [N, 3, 14, 14], rows flattened)
  int64_t grid_h = 0, grid_w = 0, num_tokens = 0;
};

KimiK3ImagePatches kimi_k3_patches(const Image& image, const KimiK3ProcessorConfig& config = {});

}  // namespace sparrow::vision
