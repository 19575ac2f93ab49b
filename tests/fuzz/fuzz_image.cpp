// An image as a request carries it, PNG, JPEG or WebP (src/vision/image.h): decode_image under a small pixel
// limit, then the two families' processors on what decodes (their resizes and patches), so that a size the
// decoder let through reaches the code that indexes by it. A broken image must be refused with a sparrow::Error.
#include <cstdint>

#include "fuzz_util.h"
#include "vision/image.h"
#include "vision/kimi_k3_processor.h"
#include "vision/minimax_m3_vl_processor.h"

using namespace sparrow;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::refusing_only_with_errors([&] {
    const vision::Image image = vision::decode_image(fuzz::as_text(data, size), vision::DecodeLimits{1 << 18});
    fuzz::require(image.height > 0 && image.width > 0 && image.rgb.size() == size_t(image.height * image.width * 3),
                  "a decoded image has its pixels");
    vision::MiniMaxM3VlProcessorConfig config;
    config.max_pixels = 28 * 28 * 16;  // a small grid: the resize and the patches stay fast
    const vision::MiniMaxM3VlImagePatches patches = vision::minimax_m3_vl_patches(image, config);
    fuzz::require(patches.pixel_values.dim(0) == patches.grid_h * patches.grid_w, "one row per patch");
    vision::KimiK3ProcessorConfig kimi;
    kimi.in_patch_limit = 64;
    const vision::KimiK3ImagePatches kimi_patches = vision::kimi_k3_patches(image, kimi);
    fuzz::require(kimi_patches.pixel_values.dim(0) == kimi_patches.grid_h * kimi_patches.grid_w, "one row per patch");
  });
  return 0;
}
