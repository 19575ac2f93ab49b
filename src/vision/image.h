// Images as the vision processors take them: 8-bit RGB, decoded from the bytes a request or a prompt file
// carries (issue 30). Decoding follows what the Python side does before a processor sees an image
// (transformers' `load_image` and vLLM's image loader: PIL's open, then convert("RGB")), so that the pixels
// the processors start from are the same:
//   - PNG (libpng): palette expanded; grey replicated to R = G = B; alpha and tRNS transparency dropped, not
//     composited; 16-bit RGB and grey+alpha keep their high byte, 16-bit grey is clipped to 255, as PIL's
//     "RGB;16B" / "LA;16B" raw modes and its I;16 -> RGB conversion do;
//   - JPEG (libjpeg-turbo): the library's defaults, which are PIL's (accurate integer IDCT, fancy upsampling);
//     grey replicated; CMYK / YCCK refused (PIL's CMYK -> RGB rule is not implemented here);
//   - WebP (libwebp), lossy or lossless: the library's defaults, which are PIL's; alpha dropped; an animation
//     refused;
//   - anything else is refused.
// No EXIF orientation is applied (PIL's open does not apply it either).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sparrow::vision {

struct Image {
  int64_t height = 0, width = 0;
  std::vector<uint8_t> rgb;  // height x width x 3, row-major
  const uint8_t* pixel(int64_t y, int64_t x) const { return rgb.data() + (y * width + x) * 3; }
};

// The limits an untrusted image is decoded under: its header is read first, and one larger than
// `max_pixels` is refused before any pixel is decoded.
struct DecodeLimits {
  int64_t max_pixels = int64_t(1) << 26;  // 64 Mpx: 192 MiB of RGB
};

// The image in `bytes` (PNG, JPEG or WebP, told by its signature). Throws sparrow::Error with a one-line reason for
// an unknown format, a truncated or corrupt file, or one over the limits.
Image decode_image(std::string_view bytes, const DecodeLimits& limits = {});

// "png", "jpeg", "webp", or "" for another signature.
std::string image_format(std::string_view bytes);

// The image as a baseline JPEG file at `quality` (libjpeg's defaults otherwise, 4:2:0 chroma, as PIL's
// save(format="JPEG") writes at its default quality 75): what `bench serve --dataset-name random-mm` sends, as
// vLLM's benchmark does.
std::string encode_jpeg(const Image& image, int quality = 75);

}  // namespace sparrow::vision
