#include "vision/image_input.h"

#include <xxhash.h>

#include "core/error.h"

namespace sparrow::vision {

uint64_t image_content_hash(const Tensor& pixel_values, const VisionGrid& grid) {
  SPARROW_CHECK(pixel_values.device() == Device::Cpu && pixel_values.type() == ScalarType::F32,
                "image_content_hash: the patches must be fp32 on the host");
  const int64_t shape[5] = {grid.t, grid.h, grid.w, pixel_values.dim(0), pixel_values.numel()};
  const uint64_t seed = XXH3_64bits(shape, sizeof(shape));
  return XXH3_64bits_withSeed(pixel_values.data(), size_t(pixel_values.numel()) * sizeof(float), seed);
}

void check_image_placeholders(const std::vector<int32_t>& prompt, const std::vector<ImageInput>& images,
                              int32_t placeholder) {
  const int64_t length = int64_t(prompt.size());
  int64_t next = 0;  // where the next image may start; every placeholder before it belongs to an image
  for (size_t i = 0; i < images.size(); ++i) {
    const ImageInput& image = images[i];
    SPARROW_CHECK(image.tokens > 0 && image.offset >= next && image.offset + image.tokens <= length, "image ", i,
                  ": ", image.tokens, " placeholder tokens at ", image.offset, " do not fit a prompt of ", length,
                  " tokens after the previous image");
    for (int64_t p = next; p < image.offset; ++p)
      SPARROW_CHECK(prompt[size_t(p)] != placeholder, "prompt token ", p, " is the image placeholder ", placeholder,
                    " but no image is there (image ", i, " starts at ", image.offset, ")");
    for (int64_t p = image.offset; p < image.offset + image.tokens; ++p)
      SPARROW_CHECK(prompt[size_t(p)] == placeholder, "image ", i, " takes prompt tokens ", image.offset, "..",
                    image.offset + image.tokens - 1, " but token ", p, " is ", prompt[size_t(p)], ", not the image "
                    "placeholder ", placeholder);
    next = image.offset + image.tokens;
  }
  for (int64_t p = next; p < length; ++p)
    SPARROW_CHECK(prompt[size_t(p)] != placeholder, "prompt token ", p, " is the image placeholder ", placeholder,
                  " but no image is there (", images.size(), " image(s) given)");
}

}  // namespace sparrow::vision
