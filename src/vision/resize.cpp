#include "vision/resize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace sparrow::vision {
namespace {

// Keys' cubic convolution kernel with a = -0.5, as each library writes it: the same function, but the outer
// piece's operations differ, and so can its last bit, which can move a weight's rounding.
double keys_cubic(double x, ResizeKernel kernel) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0)
    return kernel == ResizeKernel::Torch ? ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
                                         : (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

// One dimension's taps: output i reads inputs [first[i], first[i] + count[i]) with weights
// weights[i * max_taps + j], integers of `precision` fraction bits.
struct Taps {
  std::vector<int64_t> first, count;
  std::vector<int32_t> weights;
  int64_t max_taps = 0;
  int precision = 0;
};

Taps bicubic_taps(int64_t in, int64_t out, ResizeKernel kernel) {
  const double scale = double(in) / double(out);
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;  // the cubic's half-width of 2, stretched
  const double inverse_scale = scale >= 1.0 ? 1.0 / scale : 1.0;
  Taps t;
  t.max_taps = int64_t(std::ceil(support)) * 2 + 1;
  t.first.resize(out);
  t.count.resize(out);
  std::vector<double> weights(size_t(out * t.max_taps), 0.0);
  double largest = 0.0;
  for (int64_t i = 0; i < out; ++i) {
    const double centre = scale * (double(i) + 0.5);
    const int64_t first = std::max(int64_t(centre - support + 0.5), int64_t(0));
    const int64_t count = std::clamp(std::min(int64_t(centre + support + 0.5), in) - first, int64_t(0), t.max_taps);
    double* w = weights.data() + i * t.max_taps;
    double total = 0.0;
    for (int64_t j = 0; j < count; ++j)
      total += (w[j] = keys_cubic((double(j + first) - centre + 0.5) * inverse_scale, kernel));
    if (total != 0.0)
      for (int64_t j = 0; j < count; ++j) largest = std::max(largest, w[j] /= total);
    t.first[i] = first;
    t.count[i] = count;
  }
  if (kernel == ResizeKernel::Torch) {  // int16 weights: the most fraction bits that keep them under 2^15
    for (t.precision = 0; t.precision < 22; ++t.precision)
      if (int(0.5 + largest * double(1 << (t.precision + 1))) >= (1 << 15)) break;
  } else {  // Pillow's PRECISION_BITS, 32 - 8 - 2
    t.precision = 22;
  }
  t.weights.resize(weights.size());
  for (size_t k = 0; k < weights.size(); ++k) {
    const double v = weights[k] * double(1 << t.precision);
    const int rounded = v < 0 ? int(-0.5 + v) : int(0.5 + v);
    t.weights[k] = kernel == ResizeKernel::Torch ? int16_t(rounded) : rounded;
  }
  return t;
}

// One pass along one axis (the width when `along_width`, else the height) to `size` pixels; the other axis
// is kept. Each output is clamp((2^(p-1) + sum pixel * weight) >> p, 0, 255).
Image resample(const Image& in, int64_t size, ResizeKernel kernel, bool along_width) {
  const Taps t = bicubic_taps(along_width ? in.width : in.height, size, kernel);
  Image out{along_width ? in.height : size, along_width ? size : in.width, {}};
  out.rgb.resize(size_t(out.height * out.width * 3));
  const int64_t tap_stride = along_width ? 3 : in.width * 3;  // bytes between neighbouring taps
  const int32_t half = t.precision > 0 ? 1 << (t.precision - 1) : 0;
  for (int64_t y = 0; y < out.height; ++y)
    for (int64_t x = 0; x < out.width; ++x) {
      const int64_t i = along_width ? x : y;
      const int32_t* w = t.weights.data() + i * t.max_taps;
      const uint8_t* first = along_width ? in.pixel(y, t.first[i]) : in.pixel(t.first[i], x);
      for (int c = 0; c < 3; ++c) {
        int32_t sum = half;
        for (int64_t j = 0; j < t.count[i]; ++j) sum += first[j * tap_stride + c] * w[j];
        out.rgb[size_t((y * out.width + x) * 3 + c)] = uint8_t(std::clamp(sum >> t.precision, 0, 255));
      }
    }
  return out;
}

}  // namespace

Image resize_bicubic(const Image& image, int64_t height, int64_t width, ResizeKernel kernel) {
  SPARROW_CHECK(image.height > 0 && image.width > 0 && height > 0 && width > 0, "resize: no pixels (",
                image.width, "x", image.height, " to ", width, "x", height, ")");
  // The horizontal pass first, then the vertical; an axis whose size does not change is not resampled.
  if (width == image.width) return height == image.height ? image : resample(image, height, kernel, false);
  Image wide = resample(image, width, kernel, true);
  return height == wide.height ? wide : resample(wide, height, kernel, false);
}

}  // namespace sparrow::vision
