// Resizing as the Hugging Face image processors do it on the CPU: torchvision's resize of a uint8 image with
// bicubic interpolation and antialiasing, which runs PyTorch's uint8 kernel (aten/src/ATen/native/cpu/
// UpSampleKernel.cpp, `_compute_index_ranges_int16_weights`, and UpSampleKernelAVXAntialias.h; its scalar
// and AVX2 paths give the same integers). Pillow's resampling scheme (libImaging/Resample.c):
//   - per output pixel i of a dimension, scale = in / out, centre = scale (i + 0.5), support = 2 max(scale, 1);
//     taps from trunc(centre - support + 0.5) (at least 0) to trunc(centre + support + 0.5) (at most in),
//     each weighted by Keys' cubic (a = -0.5) at (tap - centre + 0.5) / max(scale, 1), in double, then
//     normalised to sum 1;
//   - the weights of a dimension become int16 with the most fraction bits p that keep the largest one under
//     2^15 (p <= 22), rounded half away from zero;
//   - each output is clamp((2^(p-1) + sum pixel * weight) >> p, 0, 255): the horizontal pass first into
//     uint8 rows, then the vertical pass; a dimension whose size does not change is not resampled.
// Integer arithmetic throughout after the weights, so the result does not depend on the CPU's vector width.
#pragma once

#include <cstdint>

#include "vision/image.h"

namespace sparrow::vision {

Image resize_bicubic_antialiased(const Image& image, int64_t height, int64_t width);

}  // namespace sparrow::vision
