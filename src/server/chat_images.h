// A chat request's images (issue 30; docs/vision.md): the OpenAI `image_url` content parts, their bytes (a
// `data:` URL in base64, or a `file://` URL under --allowed-local-media-path; sparrow fetches nothing from the
// network), the model's processor, and the placeholders the chat template rendered expanded as vLLM does. Every
// problem a client can cause is a 400 naming the part.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/vision_encoder.h"
#include "server/openai_requests.h"
#include "tokenizer/tokenizer.h"
#include "vision/image_input.h"
#include "vision/image_processor.h"

namespace sparrow::server {

// What serving images takes, set up at start when the model has a vision tower.
struct ImageServing {
  vision::ImageProcessor processor;
  const Tokenizer* tokenizer = nullptr;            // the server's, which outlives this: each image's replacement text
  int32_t placeholder = -1, pad = -1;              // the tokenizer's ids of the processor's placeholder texts
  int64_t limit_per_prompt = 999;                  // --limit-mm-per-prompt's "image" (vLLM's default: 999)
  std::string allowed_local_media_path;            // --allowed-local-media-path; empty: no local files
  int64_t max_pixels = int64_t(1) << 26;           // an image's pixels, read from its header before decoding
};

// The bytes a URL names: a data: URL's (base64, an image/* media type) or, under `allowed_local_media_path`,
// a file:// URL's; a 400 naming `param` otherwise.
std::string image_url_bytes(const ImageUrl& image, const std::string& allowed_local_media_path);

// The request's images, loaded and processed, placed on `ids` (the rendered prompt, one placeholder per image),
// which become the expanded ids. `serving` null: the model takes no images (a 400).
std::vector<vision::ImageInput> load_chat_images(const std::vector<ImageUrl>& urls, const ImageServing* serving,
                                                 std::vector<int32_t>& ids);

// Images given as their files' bytes (the Python API's multi_modal_data), each named by params[i] in errors: processed
// and placed on `ids` as above (limits included).
std::vector<vision::ImageInput> place_prompt_images(const std::vector<std::string>& bytes,
                                                    const std::vector<std::string>& params, const ImageServing* serving,
                                                    std::vector<int32_t>& ids);

// What serving images takes for the model in `model_dir` (its processor, the tokenizer's ids of its placeholder text,
// the limits: --limit-mm-per-prompt's JSON, empty for vLLM's default, and the local folder, empty for none); null
// when the model has no tower or the tokenizer lacks the placeholders (a notice on stderr then). One-line errors for
// bad limits or folder.
std::shared_ptr<const ImageServing> make_image_serving(const std::string& model_dir, const VisionEncoder* tower,
                                                       const Tokenizer* tokenizer, const std::string& limit_json,
                                                       const std::string& local_path);

}  // namespace sparrow::server
