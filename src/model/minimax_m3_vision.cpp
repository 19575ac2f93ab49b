#include "model/minimax_m3_vision.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "model/families.h"
#include "kernels/ops.h"

namespace sparrow {

namespace {

template <class Affine>
Tensor linear_bias(const Tensor& x, const Affine& a) {
  Tensor y = ops::linear(x, a.w);
  ops::add_bias_(y, a.b);
  return y;
}

// A setting of the tower's geometry: the vision config's own key, or the release's img_token_compression_config
// (what vLLM reads), else `def`.
int64_t compression_setting(const Config& vision, const char* key, int64_t def) {
  if (vision.has(key)) return vision.get_int(key);
  if (vision.has("img_token_compression_config"))
    return vision.get_object("img_token_compression_config").get_int(key, def);
  return def;
}

}  // namespace

std::unique_ptr<MiniMaxM3VisionEncoder> MiniMaxM3VisionEncoder::load(const std::string& dir, Device device) {
  return load(*Checkpoint::open(dir), device);
}

std::unique_ptr<MiniMaxM3VisionEncoder> MiniMaxM3VisionEncoder::load(Checkpoint& ckpt, Device device) {
  const Config& config = ckpt.config();
  SPARROW_CHECK(config.has("vision_config"), ckpt.dir(), "/config.json has no vision_config: not a MiniMax-M3-VL "
                "checkpoint");
  const Config vision = config.get_object("vision_config");
  auto encoder = std::unique_ptr<MiniMaxM3VisionEncoder>(new MiniMaxM3VisionEncoder);
  MiniMaxM3VisionEncoder& e = *encoder;
  e.device_ = device;
  ckpt.place_on(device);
  e.hidden_ = vision.get_int("hidden_size");
  e.heads_ = vision.get_int("num_attention_heads");
  SPARROW_CHECK(e.hidden_ > 0 && e.heads_ > 0 && e.hidden_ % e.heads_ == 0, vision.where(), ": hidden_size ", e.hidden_,
                " is not a multiple of num_attention_heads ", e.heads_);
  e.head_dim_ = e.hidden_ / e.heads_;
  e.eps_ = float(vision.get_float("layer_norm_eps", 1e-5));
  e.merge_ = compression_setting(vision, "spatial_merge_size", 2);
  const int64_t temporal = compression_setting(vision, "temporal_patch_size", 2);
  const int64_t patch = vision.get_int("patch_size"), channels = vision.get_int("num_channels", 3);
  SPARROW_CHECK(e.merge_ > 0 && temporal > 0 && patch > 0 && channels > 0, vision.where(),
                ": bad patch geometry (patch_size ", patch, ", temporal_patch_size ", temporal, ", spatial_merge_size ",
                e.merge_, ")");
  e.patch_width_ = channels * temporal * patch * patch;
  e.text_hidden_ = config.get_object("text_config").get_int("hidden_size");
  e.image_token_ = int32_t(config.get_int("image_token_index", config.get_int("image_token_id", -1)));
  const std::string act = vision.get_string("hidden_act", "gelu");
  SPARROW_CHECK(act == "gelu", vision.where(), ": hidden_act '", act, "' (the tower takes gelu)");

  // vLLM's VisionTransformer: rope_theta from the config (rope_parameters in transformers' form), 10000 else.
  double theta = 10000.0;
  if (vision.has("rope_parameters")) theta = vision.get_object("rope_parameters").get_float("rope_theta", theta);
  else theta = vision.get_float("rope_theta", theta);
  const int64_t axis = 2 * ((2 * (e.head_dim_ / 2) / 3) / 2);
  for (int64_t i = 0; i < axis; i += 2) e.inv_freq_.push_back(float(1.0 / std::pow(theta, double(i) / double(axis))));

  const std::string root = ckpt.has("model.vision_tower.vision_model.pre_layrnorm.weight") ? "model." : "";
  const std::string v = root + "vision_tower.vision_model.";
  const int64_t H = e.hidden_;
  // `name`.weight ([out] for a LayerNorm, [out, in] for a Linear) and `name`.bias ([out]).
  auto affine = [&](const std::string& name, int64_t out, int64_t in = 0) {
    return Affine{ckpt.take(name + ".weight", in ? Shape{out, in} : Shape{out}), ckpt.take(name + ".bias", {out})};
  };
  e.patch_w_ = ckpt.take(v + "embeddings.patch_embedding.weight", {H, channels, temporal, patch, patch})
                   .reshape({H, e.patch_width_});
  e.pre_ = affine(v + "pre_layrnorm", H);
  const int64_t inter = vision.get_int("intermediate_size");
  for (int64_t i = 0, n = vision.get_int("num_hidden_layers"); i < n; ++i) {
    const std::string p = v + "encoder.layers." + std::to_string(i) + ".";
    // The MLP: transformers writes block_sparse_moe.fc1 / fc2, the release mlp.fc1 / fc2 (vLLM's weight mapper).
    const std::string mlp = p + (ckpt.has(p + "block_sparse_moe.fc1.weight") ? "block_sparse_moe." : "mlp.");
    e.layers_.push_back(Layer{affine(p + "layer_norm1", H), affine(p + "self_attn.q_proj", H, H),
                              affine(p + "self_attn.k_proj", H, H), affine(p + "self_attn.v_proj", H, H),
                              affine(p + "self_attn.out_proj", H, H), affine(p + "layer_norm2", H),
                              affine(mlp + "fc1", inter, H), affine(mlp + "fc2", H, inter)});
  }
  const int64_t mid = config.get_int("projector_hidden_size", e.text_hidden_), T = e.text_hidden_;
  e.proj1_ = affine(root + "multi_modal_projector.linear_1", mid, H);
  e.proj2_ = affine(root + "multi_modal_projector.linear_2", T, mid);
  e.merge1_ = affine(root + "patch_merge_mlp.linear_1", mid, T * e.merge_ * e.merge_);
  e.merge2_ = affine(root + "patch_merge_mlp.linear_2", T, mid);
  return encoder;
}

ImageAttention MiniMaxM3VisionEncoder::rotation(const std::vector<VisionGrid>& grids) const {
  // Patch r of an image at (t, h, w), in the processor's merge-window order; frequency j of axis j / half_axis.
  const int64_t half_axis = int64_t(inv_freq_.size()), rot_half = 3 * half_axis;  // NeoX halves of the 3a rotated
  int64_t rows = 0;
  for (const VisionGrid& g : grids) rows += g.t * g.h * g.w;
  ImageAttention a{Tensor::empty({rows, rot_half}), Tensor::empty({rows, rot_half}), {}};
  int64_t row = 0;
  for (const VisionGrid& g : grids) {
    a.rows_per_image.push_back(g.t * g.h * g.w);
    for (int64_t local = 0; local < g.t * g.h * g.w; ++local, ++row) {
      const int64_t rem = local % (g.h * g.w), bh = rem / (merge_ * g.w), r = rem % (merge_ * g.w);
      const int64_t bw = r / (merge_ * merge_), r2 = r % (merge_ * merge_);
      const int64_t pos[3] = {local / (g.h * g.w), bh * merge_ + r2 / merge_, bw * merge_ + r2 % merge_};
      for (int64_t j = 0; j < rot_half; ++j) {
        const float angle = float(pos[j / half_axis]) * inv_freq_[size_t(j % half_axis)];
        a.cos.row(row)[j] = std::cos(angle), a.sin.row(row)[j] = std::sin(angle);
      }
    }
  }
  a.cos = a.cos.to(device_), a.sin = a.sin.to(device_);
  return a;
}

Tensor MiniMaxM3VisionEncoder::attend(const Tensor& x, const Layer& layer, const ImageAttention& a) const {
  Tensor q = linear_bias(x, layer.q), k = linear_bias(x, layer.k);
  const Tensor v = linear_bias(x, layer.v);
  ops::rotate_pairs_(q, a.cos, a.sin, head_dim_, /*interleaved=*/false);
  ops::rotate_pairs_(k, a.cos, a.sin, head_dim_, /*interleaved=*/false);
  return linear_bias(attend_within_images(q, k, v, heads_, a.rows_per_image), layer.out);
}

Tensor MiniMaxM3VisionEncoder::embed(const Tensor& pixel_values, const std::vector<VisionGrid>& grids) const {
  SPARROW_CHECK(pixel_values.on_cpu() && pixel_values.type() == ScalarType::F32 && pixel_values.ndim() == 2 &&
                    pixel_values.dim(1) == patch_width_,
                "MiniMax-M3-VL vision encoder: patches must be fp32 [rows, ", patch_width_, "] on the host, got ",
                shape_str(pixel_values.shape()));
  int64_t rows = 0;
  for (const VisionGrid& g : grids) {
    SPARROW_CHECK(g.t > 0 && g.h > 0 && g.w > 0 && g.h % merge_ == 0 && g.w % merge_ == 0,
                  "MiniMax-M3-VL vision encoder: grid ", g.t, " x ", g.h, " x ", g.w, " is not a whole number of ",
                  merge_, "x", merge_, " windows");
    rows += g.t * g.h * g.w;
  }
  SPARROW_CHECK(rows == pixel_values.dim(0), "MiniMax-M3-VL vision encoder: the grids hold ", rows, " patches, got ",
                pixel_values.dim(0), " rows");
  Tensor x = ops::layer_norm(ops::linear(pixel_values.to(device_, ops::act_type(device_)), patch_w_), pre_.w, pre_.b, eps_);
  const ImageAttention rotary = rotation(grids);
  for (const Layer& layer : layers_) {
    ops::add_(x, attend(ops::layer_norm(x, layer.ln1.w, layer.ln1.b, eps_), layer, rotary));
    Tensor up = linear_bias(ops::layer_norm(x, layer.ln2.w, layer.ln2.b, eps_), layer.fc1);
    ops::gelu_(up);
    ops::add_(x, linear_bias(up, layer.fc2));
  }
  Tensor mid = linear_bias(x, proj1_);
  ops::gelu_(mid);
  const Tensor projected = linear_bias(mid, proj2_);
  Tensor merged =
      linear_bias(projected.reshape({rows / (merge_ * merge_), text_hidden_ * merge_ * merge_}), merge1_);
  ops::gelu_(merged);
  return linear_bias(merged, merge2_).to(Device::Cpu, ScalarType::F32);
}

std::unique_ptr<VisionEncoder> load_minimax_m3_vision(const std::string& dir, Device device, bool dummy) {
  const std::unique_ptr<Checkpoint> ckpt = dummy ? Checkpoint::open_dummy(dir) : Checkpoint::open(dir);
  if (!ckpt->config().has("vision_config") ||
      !(dummy || ckpt->has("vision_tower.vision_model.pre_layrnorm.weight") ||
        ckpt->has("model.vision_tower.vision_model.pre_layrnorm.weight")))
    return nullptr;
  return MiniMaxM3VisionEncoder::load(*ckpt, device);  // the checkpoint opened once for the check and the weights
}

}  // namespace sparrow
