// Bicubic resizing with antialiasing, as the Python side's two resizers do it to a uint8 RGB image; both are
// Pillow's scheme (libImaging/Resample.c):
//   - per output pixel i of a dimension, scale = in / out, centre = scale (i + 0.5), support = 2 max(scale, 1);
//     taps from trunc(centre - support + 0.5) (at least 0) to trunc(centre + support + 0.5) (at most in),
//     each weighted by Keys' cubic (a = -0.5) at (tap - centre + 0.5) / max(scale, 1), in double, then
//     normalised to sum 1;
//   - the weights become integers of p fraction bits, rounded half away from zero;
//   - each output is clamp((2^(p-1) + sum pixel * weight) >> p, 0, 255): the horizontal pass first into
//     uint8 rows, then the vertical pass; a dimension whose size does not change is not resampled.
// ResizeKernel::Torch is PyTorch's uint8 kernel, which torchvision's resize runs for the Hugging Face
// processors (aten/src/ATen/native/cpu/UpSampleKernel.cpp, `_compute_index_ranges_int16_weights`; its scalar
// and AVX2 paths agree): int16 weights with the most fraction bits that keep the largest under 2^15.
// ResizeKernel::Pillow is PIL's Image.resize(size, BICUBIC), which vLLM's Kimi processor runs: p = 22, and
// the cubic's outer piece written as Pillow writes it.
// Integer arithmetic throughout after the weights, so the result does not depend on the CPU's vector width.
#pragma once

#include <cstdint>

#include "vision/image.h"

namespace sparrow::vision {

enum class ResizeKernel { Torch, Pillow };

Image resize_bicubic(const Image& image, int64_t height, int64_t width, ResizeKernel kernel);

}  // namespace sparrow::vision
