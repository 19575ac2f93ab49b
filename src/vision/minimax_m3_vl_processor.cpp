#include "vision/minimax_m3_vl_processor.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "vision/resize.h"

namespace sparrow::vision {

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels) {
  SPARROW_CHECK(height > 0 && width > 0, "image of ", width, "x", height, " has no pixels");
  const double ratio = double(std::max(height, width)) / double(std::min(height, width));
  SPARROW_CHECK(ratio <= 200, "image of ", width, "x", height, ": aspect ratio ", ratio,
                " is over 200, which the processor refuses");
  const double h = double(height), w = double(width), f = double(factor);
  int64_t h_bar = int64_t(std::nearbyint(h / f)) * factor, w_bar = int64_t(std::nearbyint(w / f)) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(h * w / double(max_pixels));
    h_bar = std::max(factor, int64_t(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, int64_t(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(double(min_pixels) / (h * w));
    h_bar = int64_t(std::ceil(h * beta / f)) * factor;
    w_bar = int64_t(std::ceil(w * beta / f)) * factor;
  }
  return {h_bar, w_bar};
}

MiniMaxM3VlImagePatches minimax_m3_vl_patches(const Image& image, const MiniMaxM3VlProcessorConfig& config) {
  const int64_t P = config.patch_size, T = config.temporal_patch_size, M = config.merge_size;
  const auto [height, width] = smart_resize(image.height, image.width, P * M, config.min_pixels, config.max_pixels);
  const Image resized = resize_bicubic(image, height, width, ResizeKernel::Torch);

  std::array<float, 3> mean, std;
  for (int c = 0; c < 3; ++c) {
    mean[c] = config.mean[c] * 255.0f;
    std[c] = config.std[c] * 255.0f;
  }
  MiniMaxM3VlImagePatches out;
  out.grid_h = height / P;
  out.grid_w = width / P;
  const int64_t row_size = 3 * T * P * P;
  out.pixel_values = Tensor::empty({out.grid_h * out.grid_w, row_size});
  float* row = out.pixel_values.data();
  for (int64_t wy = 0; wy < out.grid_h / M; ++wy)
    for (int64_t wx = 0; wx < out.grid_w / M; ++wx)
      for (int64_t my = 0; my < M; ++my)
        for (int64_t mx = 0; mx < M; ++mx, row += row_size) {
          const int64_t y0 = (wy * M + my) * P, x0 = (wx * M + mx) * P;
          for (int c = 0; c < 3; ++c)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t py = 0; py < P; ++py)
                for (int64_t px = 0; px < P; ++px) {
                  const float x = float(resized.pixel(y0 + py, x0 + px)[c]);
                  row[((c * T + t) * P + py) * P + px] = (x - mean[c]) / std[c];
                }
        }
  return out;
}

}  // namespace sparrow::vision
