#include "vision/kimi_k3_processor.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "vision/preprocessor_config.h"
#include "vision/resize.h"

namespace sparrow::vision {

KimiK3ProcessorConfig KimiK3ProcessorConfig::from_folder(const std::string& dir) {
  KimiK3ProcessorConfig config;
  const std::optional<PreprocessorConfig> file = PreprocessorConfig::load(dir);
  if (!file) return config;
  const PreprocessorConfig media = file->section("media_proc_cfg");
  media.read_positive("patch_size", config.patch_size);
  media.read_positive_or_first("merge_kernel_size", config.merge_kernel_size);
  media.read_positive("in_patch_limit", config.in_patch_limit);
  media.read_positive("patch_limit_on_one_side", config.patch_limit_on_one_side);
  media.read_triple("image_mean", config.mean);
  media.read_triple("image_std", config.std);
  SPARROW_CHECK(!media.has("fixed_output_tokens"), media.where(),
                ": fixed_output_tokens is set, which sparrow's navit_resize does not take");
  return config;
}

NavitSize navit_resize(int64_t height, int64_t width, const KimiK3ProcessorConfig& config) {
  SPARROW_CHECK(height > 0 && width > 0, "image of ", width, "x", height, " has no pixels");
  const int64_t P = config.patch_size, side_limit = config.patch_limit_on_one_side * P;
  const double patches = std::max(1.0, double(width / P)) * std::max(1.0, double(height / P));
  const double scale = std::min({1.0, std::sqrt(double(config.in_patch_limit) / patches),
                                 double(side_limit) / double(width), double(side_limit) / double(height)});
  NavitSize s;
  s.new_width = std::min(std::max(int64_t(1), int64_t(double(width) * scale)), side_limit);
  s.new_height = std::min(std::max(int64_t(1), int64_t(double(height) * scale)), side_limit);
  const int64_t factor = config.merge_kernel_size * P;
  s.pad_height = (factor - s.new_height % factor) % factor;
  s.pad_width = (factor - s.new_width % factor) % factor;
  s.num_tokens = (s.new_height + s.pad_height) / factor * ((s.new_width + s.pad_width) / factor);
  return s;
}

KimiK3ImagePatches kimi_k3_patches(const Image& image, const KimiK3ProcessorConfig& config) {
  const NavitSize size = navit_resize(image.height, image.width, config);
  const Image resized = resize_bicubic(image, size.new_height, size.new_width, ResizeKernel::Pillow);

  // numpy's table: float32 throughout (values / 255.0 - mean) * (1.0 / std).
  float table[256][3];
  for (int v = 0; v < 256; ++v)
    for (int c = 0; c < 3; ++c) table[v][c] = (float(v) / 255.0f - config.mean[c]) * (1.0f / config.std[c]);

  const int64_t P = config.patch_size;
  KimiK3ImagePatches out;
  out.grid_h = (size.new_height + size.pad_height) / P;
  out.grid_w = (size.new_width + size.pad_width) / P;
  out.num_tokens = size.num_tokens;
  out.pixel_values = Tensor::empty({out.grid_h * out.grid_w, 3 * P * P});
  float* row = out.pixel_values.data();
  for (int64_t gy = 0; gy < out.grid_h; ++gy)
    for (int64_t gx = 0; gx < out.grid_w; ++gx, row += 3 * P * P)
      for (int c = 0; c < 3; ++c)
        for (int64_t py = 0; py < P; ++py)
          for (int64_t px = 0; px < P; ++px) {
            const int64_t y = gy * P + py, x = gx * P + px;
            const uint8_t v = y < resized.height && x < resized.width ? resized.pixel(y, x)[c] : 0;
            row[(c * P + py) * P + px] = table[v][c];
          }
  return out;
}

}  // namespace sparrow::vision
