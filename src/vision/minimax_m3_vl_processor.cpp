#include "vision/minimax_m3_vl_processor.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "vision/preprocessor_config.h"
#include "vision/resize.h"

namespace sparrow::vision {

namespace {

void check_aspect(int64_t height, int64_t width) {
  SPARROW_CHECK(height > 0 && width > 0, "image of ", width, "x", height, " has no pixels");
  const double ratio = double(std::max(height, width)) / double(std::min(height, width));
  SPARROW_CHECK(ratio <= 200, "image of ", width, "x", height, ": aspect ratio ", ratio,
                " is over 200, which the processor refuses");
}

// Python's round(x / f) * f: half to even (the default rounding mode).
int64_t round_by(double x, int64_t factor) { return int64_t(std::nearbyint(x / double(factor))) * factor; }

}  // namespace

std::pair<int64_t, int64_t> smart_resize_vllm(int64_t height, int64_t width, int64_t factor, int64_t max_pixels,
                                              int64_t max_long_side_pixel) {
  check_aspect(height, width);
  const double h = double(height), w = double(width), f = double(factor);
  if (max_long_side_pixel > 0) {
    constexpr int64_t kMinShortSide = 112, kMaxArea = int64_t(3584) * 3584;  // MiniMax-M3's fixed bounds
    double beta = 1.0;
    if (std::max(height, width) > max_long_side_pixel) beta = double(max_long_side_pixel) / double(std::max(height, width));
    else if (std::min(height, width) < kMinShortSide) beta = double(kMinShortSide) / double(std::min(height, width));
    const int64_t h_bar = std::max(factor, round_by(h * beta, factor)), w_bar = std::max(factor, round_by(w * beta, factor));
    SPARROW_CHECK(h_bar * w_bar <= kMaxArea, "image of ", width, "x", height, ": ", w_bar, "x", h_bar,
                  " after resizing is over the processor's 3584^2 pixels");
    return {h_bar, w_bar};
  }
  constexpr int64_t kMinPixels = 4 * 28 * 28;
  int64_t h_bar = std::max(factor, round_by(h, factor)), w_bar = std::max(factor, round_by(w, factor));
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(h * w / double(max_pixels));
    h_bar = int64_t(std::floor(h / beta / f)) * factor;
    w_bar = int64_t(std::floor(w / beta / f)) * factor;
  } else if (h_bar * w_bar < kMinPixels) {
    const double beta = std::sqrt(double(kMinPixels) / (h * w));
    h_bar = int64_t(std::ceil(h * beta / f)) * factor;
    w_bar = int64_t(std::ceil(w * beta / f)) * factor;
  }
  // vLLM would hand a zero side on to the resize; refuse it here instead.
  SPARROW_CHECK(h_bar > 0 && w_bar > 0, "image of ", width, "x", height, " resizes to nothing under max_pixels ",
                max_pixels);
  return {h_bar, w_bar};
}

MiniMaxM3VlProcessorConfig MiniMaxM3VlProcessorConfig::from_folder(const std::string& dir) {
  MiniMaxM3VlProcessorConfig config;
  const std::optional<PreprocessorConfig> file = PreprocessorConfig::load(dir);
  if (!file) return config;  // no file: the defaults
  file->read_positive("patch_size", config.patch_size);
  file->read_positive("temporal_patch_size", config.temporal_patch_size);
  file->read_positive("merge_size", config.merge_size);
  const PreprocessorConfig size = file->section("size");
  size.read_positive("shortest_edge", config.min_pixels);
  size.read_positive("longest_edge", config.max_pixels);
  file->read_positive("min_pixels", config.min_pixels);
  file->read_positive("max_pixels", config.max_pixels);
  file->read_positive("max_long_side_pixel", config.max_long_side_pixel);
  file->read_triple("image_mean", config.mean);
  file->read_triple("image_std", config.std);
  SPARROW_CHECK(config.min_pixels <= config.max_pixels, file->where(), ": min_pixels ", config.min_pixels,
                " is over max_pixels ", config.max_pixels);
  return config;
}

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels) {
  check_aspect(height, width);
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
  const auto [height, width] =
      config.rule == MiniMaxResizeRule::Vllm
          ? smart_resize_vllm(image.height, image.width, P * M, config.max_pixels, config.max_long_side_pixel)
          : smart_resize(image.height, image.width, P * M, config.min_pixels, config.max_pixels);
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
