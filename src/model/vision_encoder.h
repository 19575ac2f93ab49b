// A vision tower as the engine uses it: images' patches (vision/image_input.h) to the embeddings their
// placeholder tokens take in the prompt, which the decoder then reads in place of the placeholders' own
// (Batch::embedded_rows; vLLM's merge_multimodal_embeddings). One implementation per family:
// MiniMaxM3VisionEncoder (model/minimax_m3_vision.h), KimiK3VisionEncoder (model/kimi_k3_vision.h); the pieces
// both towers use are below.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "vision/image_input.h"

namespace sparrow {

struct Batch;

class VisionEncoder {
 public:
  virtual ~VisionEncoder() = default;
  // The embeddings of the images whose patches are stacked in `pixel_values` ([sum of t*h*w, patch_width()] fp32
  // on the host, image after image), `grids` saying how many rows each has: [sum of tokens(grid), text hidden] fp32
  // on the host, the images in order. An image's rows do not depend on the others in the call. The tower itself runs
  // on the device its weights were loaded to (the model's: ModelFamily::load_vision).
  virtual Tensor embed(const Tensor& pixel_values, const std::vector<vision::VisionGrid>& grids) const = 0;
  // The placeholder tokens an image of `grid` takes.
  virtual int64_t tokens(const vision::VisionGrid& grid) const = 0;
  virtual int64_t patch_width() const = 0;  // values a patch row holds
  virtual int32_t image_token_id() const = 0;  // the placeholder's id
};

// What every layer's attention in one embed() call shares: the rotary's cos and sin for each patch row ([rows, R]
// fp32 on the tower's device, computed once on the host: the towers' 2-D / 3-D angles are not one position times a
// frequency) and how many rows each image has.
struct ImageAttention {
  Tensor cos, sin;
  std::vector<int64_t> rows_per_image;
};

// Softmax attention of each image's patches to each other (no mask), head by head: q, k and v are [rows,
// heads * head_dim] on one device (fp32 on the host, bf16 on a GPU), the images' rows one after another
// (`rows_per_image`); scale head_dim^-0.5. The scores in fp32 (ops::batched_matmul_nt), their softmax
// (ops::softmax_rows), the product with the values (ops::batched_matmul_nn). Returns [rows, heads * head_dim].
Tensor attend_within_images(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads,
                            const std::vector<int64_t>& rows_per_image);

// Gathers a step's image rows (Batch::embedded_rows) sequence chunk by chunk, whatever part of an image a chunk of
// chunked prefill covers.
class ImageRows {
 public:
  // A sequence's chunk runs prompt positions [start, start + count) at batch rows [row, row + count); the image's
  // placeholders sit at positions [offset, offset + embeddings.dim(0)) (embeddings: fp32 on the host). Adds the
  // rows where the two overlap.
  void add(int64_t row, int64_t start, int64_t count, int64_t offset, const Tensor& embeddings);
  // Hands the rows gathered to `batch` (nothing when there are none).
  void attach_to(Batch& batch);
  bool empty() const { return rows_.empty(); }

 private:
  std::vector<int64_t> rows_;
  std::vector<float> values_;
  int64_t width_ = 0;
};

}  // namespace sparrow
