// MiniMax-M3-VL's image encoder: an image's patches (the processor's rows, src/vision/minimax_m3_vl_processor.h)
// to the embeddings its placeholder tokens take in the prompt, one row per 2x2 window of patches. It follows
// vLLM 0.33.0 (vllm/models/minimax_m3/common/vision_tower.py), the engine that serves the released checkpoint:
//   patch embedding  a Conv3d whose kernel is its stride: one product of each [C, T, P, P] patch row, no bias
//   pre_layrnorm     LayerNorm
//   each layer       CLIP's: x + attn(LN1 x), then x + fc2(gelu(fc1(LN2 x))); attention within one image, with
//                    biases, scale head_dim^-0.5, no mask
//   rotary           a partial 3-D RoPE: t, h and w take a = 2 * ((head_dim / 3) / 2) dimensions each (a / 2
//                    frequencies theta^(-2i / a)), the first 3a of q and k rotate in NeoX halves, the rest pass
//                    through; a patch's (t, h, w) follows the 2x2 merge-window order of the processor's rows
//                    (model_executor/layers/rotary_embedding/mrope_vit_setup.py)
//   no post layernorm (the release ships none)
//   projector        linear_1, gelu (erf), linear_2 on each patch; then each window's 4 rows concatenated and
//                    patch_merge_mlp's linear_1, gelu, linear_2
// transformers 5.17 rotates with two axial halves of head_dim / 4 frequencies over the whole head and, given
// [t, h, w] positions, uses t and h (docs/vision.md): a different model on the same weights, not followed here.
// tests/minimax_m3_vision_test.cpp checks this against tools/make_minimax_vision_fixture.py's float64
// reference; on a GPU (bf16 activations, fp32 scores) tests/cuda/vision_gpu_test.cpp checks it against the same.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/vision_encoder.h"

namespace sparrow {

class Checkpoint;
using vision::VisionGrid;

class MiniMaxM3VisionEncoder : public VisionEncoder {
 public:
  // The encoder's weights from a MiniMax-M3-VL checkpoint folder (its vision_config; the tower under
  // vision_tower.vision_model. or model.vision_tower.vision_model., the projector and merger at the top or
  // under model.); one-line errors for a missing tensor or a config it does not take.
  // The weights go to `device`, where embed() runs the tower.
  static std::unique_ptr<MiniMaxM3VisionEncoder> load(const std::string& dir, Device device = Device::Cpu);
  // The same from a checkpoint already open (load_minimax_m3_vision's, which checked for the tower).
  static std::unique_ptr<MiniMaxM3VisionEncoder> load(Checkpoint& ckpt, Device device = Device::Cpu);

  // The embeddings of the images whose patches are stacked in `pixel_values` ([sum of t*h*w, channels * T * P *
  // P] fp32, each image's rows in the processor's order), `grids` saying how many rows each has: [sum of
  // t*h*w / merge^2, text hidden] fp32, the images in order. Each image attends only to itself, so the rows of
  // an image do not depend on the others in the call.
  Tensor embed(const Tensor& pixel_values, const std::vector<VisionGrid>& grids) const override;
  int64_t tokens(const VisionGrid& grid) const override { return grid.t * grid.h * grid.w / (merge_ * merge_); }
  int64_t patch_width() const override { return patch_width_; }
  // config.json's image_token_index (transformers) or image_token_id; -1 when it has neither (vLLM takes the
  // tokenizer's "]<]image[>[").
  int32_t image_token_id() const override { return image_token_; }

  int64_t merge_size() const { return merge_; }
  int64_t text_hidden() const { return text_hidden_; }

 private:
  struct Affine {  // a LayerNorm's or a Linear's weight and bias
    Tensor w, b;
  };
  struct Layer {
    Affine ln1, q, k, v, out, ln2, fc1, fc2;
  };
  ImageAttention rotation(const std::vector<VisionGrid>& grids) const;  // once per embed(), for every layer
  Tensor attend(const Tensor& x, const Layer& layer, const ImageAttention& a) const;

  Device device_ = Device::Cpu;
  int64_t hidden_ = 0, heads_ = 0, head_dim_ = 0, merge_ = 2, patch_width_ = 0, text_hidden_ = 0;
  int32_t image_token_ = -1;
  float eps_ = 1e-5f;
  std::vector<float> inv_freq_;  // one axis's a / 2 frequencies (the same for t, h and w)
  Tensor patch_w_;
  Affine pre_;
  std::vector<Layer> layers_;
  Affine proj1_, proj2_, merge1_, merge2_;
};

}  // namespace sparrow
