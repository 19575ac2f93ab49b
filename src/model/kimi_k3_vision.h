// Kimi K3's image encoder: MoonViT3d and its projector, an image's patches (src/vision/kimi_k3_processor.h, row-major
// over the padded grid) to the embeddings its placeholder tokens take in the prompt, one row per 2x2 window of
// patches. It follows vLLM 0.33.0, which serves the release (model_executor/models/kimi_k25_vit.py,
// MoonViT3dPretrainedModel and KimiK25MultiModalProjector, wired in models/kimi_k3/nvidia/model.py); the vision
// config's switches are KimiK3VisionConfig's (transformers_utils/configs/kimi_k3.py), docs/vision.md step by step:
//   patch embedding  proj, a Conv2d whose kernel is its stride: one product of each [3, 14, 14] patch row
//                    (+ bias with patch_embed_proj_bias)
//   position table   a learnt [H0, W0, hidden] table resized to the image's h x w patches by F.interpolate
//                    (pos_emb_interpolation_mode: bilinear, K3's, or bicubic; align_corners false), row-major;
//                    frames beyond the first add a fixed sin-cos time table
//   each layer       x + wo(attn(rope(wqkv(norm0 x)))), then x + fc1(act(fc0(norm1 x))); attention within one
//                    image, scale head_dim^-0.5, head_dim = qkv_hidden_size / heads (K3: 1536 / 12 = 128, wider
//                    than the 1024 hidden); biases per attn_bias / linear_bias
//   2-D RoPE         head_dim / 4 frequencies 10000^(-4i / head_dim); angle 2i is the patch's column times
//                    frequency i and angle 2i + 1 its row times it; adjacent pairs rotate (not NeoX halves)
//   norms            norm_type: LayerNorm (eps 1e-5), or RMSNorm built without an eps (K3's), which torch
//                    resolves to its accumulator's epsilon: float32's 2^-23 for vLLM's bf16 tower
//   final norm       encoder.final_layernorm, the same kind
//   merge            "sd2_tpool": the mean over frames, then each 2x2 window's four rows side by side
//   projector        "patchmergerv2" (K3): linear_1, gelu (erf), linear_2, RMSNorm(projector_ln_eps);
//                    "patchmerger" (K2.5): LayerNorm on each of the four rows, linear_1, gelu, linear_2, with biases
// tests/kimi_k3_vision_test.cpp checks it against tools/make_kimi_k3_vision_fixture.py's float64 reference, written
// from the same vLLM code; on a GPU (bf16 activations, fp32 scores) tests/cuda/vision_gpu_test.cpp against the same.
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

class KimiK3VisionEncoder : public VisionEncoder {
 public:
  // The encoder's weights from a Kimi K3 checkpoint folder (config.json's vision_config; vision_tower.* and
  // mm_projector.*, the release's names); one-line errors for a missing tensor or a setting it does not take.
  // The weights go to `device`, where embed() runs the tower.
  static std::unique_ptr<KimiK3VisionEncoder> load(const std::string& dir, Device device = Device::Cpu);
  static std::unique_ptr<KimiK3VisionEncoder> load(Checkpoint& ckpt, Device device = Device::Cpu);

  // The embeddings of the images whose patches are stacked in `pixel_values` ([sum of t*h*w, 3 * 14 * 14] fp32,
  // each image's frames one after another, a frame row-major), `grids` saying how many rows each has:
  // [sum of (h / 2) * (w / 2), text hidden] fp32, the images in order. An image's rows do not depend on the others.
  Tensor embed(const Tensor& pixel_values, const std::vector<VisionGrid>& grids) const override;
  int64_t tokens(const VisionGrid& grid) const override { return (grid.h / merge_) * (grid.w / merge_); }
  int64_t patch_width() const override { return 3 * patch_ * patch_; }
  // config.json's media_placeholder_token_id (KimiK3Config's default 163605).
  int32_t image_token_id() const override { return image_token_; }

  int64_t text_hidden() const { return text_hidden_; }

 private:
  struct Affine {  // a norm's or a linear map's weight, and its bias (undefined when it has none)
    Tensor w, b;
  };
  struct Layer {
    Affine norm0, q, k, v, wo, norm1, fc0, fc1;
  };
  enum class Norm { Layer, Rms };
  enum class Interpolation { Bilinear, Bicubic };
  enum class Projector { PatchMerger, PatchMergerV2 };

  Tensor norm(const Tensor& x, const Affine& a) const;
  Tensor positions(const VisionGrid& grid) const;  // the position table's rows for one image, [t*h*w, hidden]
  ImageAttention rotation(const std::vector<VisionGrid>& grids) const;  // once per embed(), for every layer
  Tensor attend(const Tensor& x, const Layer& layer, const ImageAttention& a) const;
  Tensor project(const Tensor& merged) const;  // [windows, 4 * hidden] -> [windows, text hidden]

  Device device_ = Device::Cpu;
  int64_t hidden_ = 0, heads_ = 0, head_dim_ = 0, qkv_ = 0, patch_ = 14, merge_ = 2, text_hidden_ = 0;
  int64_t table_h_ = 0, table_w_ = 0, table_t_ = 0;
  int32_t image_token_ = -1;
  Norm norm_ = Norm::Rms;
  Interpolation interpolation_ = Interpolation::Bilinear;
  Projector projector_ = Projector::PatchMergerV2;
  bool tanh_gelu_ = true;  // the layers' activation: gelu_pytorch_tanh, or gelu (erf)
  float projector_eps_ = 1e-5f;
  Affine patch_embed_;
  Tensor table_;  // [H0 * W0, hidden]
  std::vector<Layer> layers_;
  Affine final_norm_, pre_norm_, linear_1_, linear_2_, post_norm_;
};

}  // namespace sparrow
