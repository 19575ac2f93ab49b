#include "model/kimi_k3_vision.h"

#include <array>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/families.h"

namespace sparrow {

namespace {

// The eps of nn.RMSNorm(dim) built without one: torch takes the epsilon of the type it accumulates in, float32
// for the bf16 input vLLM gives it (ATen's rms_norm, opmath_type), not bf16's 2^-7.
constexpr float kRmsEps = std::numeric_limits<float>::epsilon();
constexpr float kLayerNormEps = 1e-5f;  // nn.LayerNorm's default, which every LayerNorm here keeps

Tensor apply(const Tensor& x, const Tensor& w, const Tensor& b) {
  Tensor y = ops::linear(x, w);
  if (b.defined()) ops::add_bias_(y, b);
  return y;
}

// One output index's taps along an axis of `in` values resized to `out` (PyTorch's upsample kernels,
// align_corners=False, no scale factor: the source of output i is (i + 0.5) in / out - 0.5).
struct Taps {
  std::array<int64_t, 4> index{};
  std::array<double, 4> weight{};
  int count = 0;
};

// upsample_bilinear2d: the source clamped at 0, its floor and the next index (the last repeats), linear weights.
Taps bilinear_taps(int64_t i, int64_t in, int64_t out) {
  const double src = std::max(0.0, double(in) / double(out) * (double(i) + 0.5) - 0.5);
  const int64_t i0 = int64_t(src);
  const double lambda = std::min(std::max(src - double(i0), 0.0), 1.0);
  return Taps{{i0, i0 + (i0 < in - 1 ? 1 : 0), 0, 0}, {1.0 - lambda, lambda, 0.0, 0.0}, 2};
}

// upsample_bicubic2d: Keys' cubic convolution with A = -0.75 over floor(src) - 1 .. + 2, each index clamped into
// [0, in) (aten/src/ATen/native/UpSample.h get_cubic_upsample_coefficients).
Taps bicubic_taps(int64_t i, int64_t in, int64_t out) {
  constexpr double A = -0.75;
  const double src = double(in) / double(out) * (double(i) + 0.5) - 0.5;
  const int64_t i0 = std::min(int64_t(std::floor(src)), in - 1);
  const double t = std::min(std::max(src - double(i0), 0.0), 1.0);
  auto near = [](double x) { return ((A + 2) * x - (A + 3)) * x * x + 1; };  // |x| <= 1
  auto far = [](double x) { return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A; };  // 1 < |x| < 2
  Taps taps{{}, {far(t + 1), near(t), near(1 - t), far(2 - t)}, 4};
  for (int j = 0; j < 4; ++j) taps.index[size_t(j)] = std::min(std::max(i0 - 1 + j, int64_t(0)), in - 1);
  return taps;
}

}  // namespace

std::unique_ptr<KimiK3VisionEncoder> KimiK3VisionEncoder::load(const std::string& dir, Device device) {
  return load(*Checkpoint::open(dir), device);
}

std::unique_ptr<KimiK3VisionEncoder> KimiK3VisionEncoder::load(Checkpoint& ckpt, Device device) {
  const Config& config = ckpt.config();
  SPARROW_CHECK(config.has("vision_config"), ckpt.dir(), "/config.json has no vision_config: not a Kimi K3 checkpoint "
                "with a vision tower");
  // KimiK3VisionConfig's keys and defaults: vLLM builds the tower from the vt_* names (its hidden_size and the
  // like are aliases it sets from them) and the legacy init_pos_emb_* sizes.
  const Config vision = config.get_object("vision_config");
  auto encoder = std::unique_ptr<KimiK3VisionEncoder>(new KimiK3VisionEncoder);
  KimiK3VisionEncoder& e = *encoder;
  e.device_ = device;
  ckpt.place_on(device);
  e.hidden_ = vision.get_int("vt_hidden_size", 1024);
  e.heads_ = vision.get_int("vt_num_attention_heads", 12);
  // An absent qkv_hidden_size is KimiK3VisionConfig's 1536; a null one the hidden size (the encoder's `or`).
  const bool qkv_null = vision.json().contains("qkv_hidden_size") && vision.json()["qkv_hidden_size"].is_null();
  e.qkv_ = qkv_null ? e.hidden_ : vision.get_int("qkv_hidden_size", 1536);
  vision.require(e.hidden_ > 0 && e.heads_ > 0 && e.qkv_ > 0 && e.qkv_ % (4 * e.heads_) == 0, "qkv_hidden_size",
                 "be a positive multiple of 4 x vt_num_attention_heads (the 2-D rotary takes head_dim / 4 "
                 "frequencies)");
  e.head_dim_ = e.qkv_ / e.heads_;
  e.patch_ = vision.get_int("patch_size", 14);
  const std::vector<int64_t> merge =
      vision.has("merge_kernel_size") ? vision.get_int_list("merge_kernel_size") : std::vector<int64_t>{2, 2};
  vision.require(merge.size() == 2 && merge[0] == merge[1] && merge[0] > 0, "merge_kernel_size",
                 "be a square window [k, k]");
  e.merge_ = merge[0];
  vision.require(e.patch_ > 0, "patch_size", "be positive");
  e.table_h_ = vision.get_int("init_pos_emb_height", 64);
  e.table_w_ = vision.get_int("init_pos_emb_width", 64);
  e.table_t_ = vision.get_int("init_pos_emb_time", 4);
  e.text_hidden_ = config.get_object("text_config").get_int("hidden_size");
  e.image_token_ = int32_t(config.get_int("media_placeholder_token_id", 163605));
  e.projector_eps_ = float(vision.get_float("projector_ln_eps", 1e-5));

  auto expect = [&](const char* key, const char* def, std::initializer_list<const char*> supported) {
    const std::string value = vision.get_string(key, def);
    std::string list;
    for (const char* s : supported) {
      if (value == s) return value;
      list += (list.empty() ? "" : ", ") + std::string(s);
    }
    vision.unsupported(key, value, list);
  };
  expect("pos_emb_type", "divided_fixed", {"divided_fixed"});
  expect("merge_type", "sd2_tpool", {"sd2_tpool"});
  expect("mlp_type", "mlp2", {"mlp2"});
  expect("video_attn_type", "spatial_temporal", {"spatial_temporal"});
  e.norm_ = expect("norm_type", "rmsnorm", {"rmsnorm", "layernorm"}) == "rmsnorm" ? Norm::Rms : Norm::Layer;
  e.interpolation_ = expect("pos_emb_interpolation_mode", "bilinear", {"bilinear", "bicubic"}) == "bilinear"
                         ? Interpolation::Bilinear
                         : Interpolation::Bicubic;
  e.projector_ = expect("mm_projector_type", "patchmergerv2", {"patchmergerv2", "patchmerger"}) == "patchmergerv2"
                     ? Projector::PatchMergerV2
                     : Projector::PatchMerger;
  // vLLM's get_act_fn(activation_func or hidden_act).
  const std::string act = vision.get_string("activation_func", vision.get_string("hidden_act", "gelu_pytorch_tanh"));
  if (act != "gelu_pytorch_tanh" && act != "gelu") vision.unsupported("activation_func", act, "gelu_pytorch_tanh, gelu");
  e.tanh_gelu_ = act == "gelu_pytorch_tanh";
  const bool attn_bias = vision.get_bool("attn_bias", false), linear_bias = vision.get_bool("linear_bias", false);
  const bool patch_bias = vision.get_bool("patch_embed_proj_bias", false);

  const int64_t H = e.hidden_, Q = e.qkv_, I = vision.get_int("vt_intermediate_size", 4096), T = e.text_hidden_;
  const std::string v = "vision_tower.";
  auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
    return Affine{ckpt.take(name + ".weight", {out, in}), bias ? ckpt.take(name + ".bias", {out}) : Tensor()};
  };
  auto norm = [&](const std::string& name, int64_t dim, bool layer_norm) {
    return Affine{ckpt.take(name + ".weight", {dim}), layer_norm ? ckpt.take(name + ".bias", {dim}) : Tensor()};
  };
  const bool ln = e.norm_ == Norm::Layer;
  e.patch_embed_ = Affine{ckpt.take(v + "patch_embed.proj.weight", {H, 3, e.patch_, e.patch_}).reshape({H, 3 * e.patch_ * e.patch_}),
                    patch_bias ? ckpt.take(v + "patch_embed.proj.bias", {H}) : Tensor()};
  // The position table is resized on the host (positions()), from its stored values.
  e.table_ = ckpt.take(v + "patch_embed.pos_emb.weight", {e.table_h_, e.table_w_, H})
                 .to(Device::Cpu, ScalarType::F32)
                 .reshape({e.table_h_ * e.table_w_, H});
  for (int64_t i = 0, n = vision.get_int("vt_num_hidden_layers", 27); i < n; ++i) {
    const std::string p = v + "encoder.blocks." + std::to_string(i) + ".";
    // wqkv is [q; k; v] by rows (the view (3, heads, head_dim) of its output): split once here.
    const Affine qkv = linear(p + "wqkv", 3 * Q, H, attn_bias);
    auto part = [&](int64_t j) {
      return Affine{qkv.w.rows(j * Q, (j + 1) * Q).clone(),
                    attn_bias ? qkv.b.reshape({3, Q}).rows(j, j + 1).reshape({Q}).clone() : Tensor()};
    };
    e.layers_.push_back(Layer{norm(p + "norm0", H, ln), part(0), part(1), part(2), linear(p + "wo", H, Q, attn_bias),
                              norm(p + "norm1", H, ln), linear(p + "mlp.fc0", I, H, linear_bias),
                              linear(p + "mlp.fc1", H, I, linear_bias)});
  }
  e.final_norm_ = norm(v + "encoder.final_layernorm", H, ln);
  // The release's mm_projector.proj.0 / .2 are vLLM's linear_1 / linear_2 (the wrapper's hf_to_vllm_mapper).
  const int64_t M = H * e.merge_ * e.merge_;
  const bool v1 = e.projector_ == Projector::PatchMerger;
  if (v1) e.pre_norm_ = norm("mm_projector.pre_norm", H, /*layer_norm=*/true);
  e.linear_1_ = linear("mm_projector.proj.0", M, M, v1);
  e.linear_2_ = linear("mm_projector.proj.2", T, M, v1);
  if (!v1) e.post_norm_ = norm("mm_projector.post_norm", T, /*layer_norm=*/false);
  return encoder;
}

Tensor KimiK3VisionEncoder::norm(const Tensor& x, const Affine& a) const {
  return norm_ == Norm::Layer ? ops::layer_norm(x, a.w, a.b, kLayerNormEps) : ops::rms_norm(x, a.w, kRmsEps);
}

Tensor KimiK3VisionEncoder::positions(const VisionGrid& g) const {
  const int64_t H = hidden_, plane = g.h * g.w;
  Tensor out = Tensor::zeros({g.t * plane, H});
  if (g.h == table_h_ && g.w == table_w_) {
    std::copy(table_.data(), table_.data() + plane * H, out.data());
  } else {
    // F.interpolate over the [hidden, H0, W0] planes: separable, one set of taps per output row and column.
    auto taps = [&](int64_t i, int64_t in, int64_t n) {
      return interpolation_ == Interpolation::Bilinear ? bilinear_taps(i, in, n) : bicubic_taps(i, in, n);
    };
    std::vector<Taps> cols;
    for (int64_t x = 0; x < g.w; ++x) cols.push_back(taps(x, table_w_, g.w));
    // Output rows in parallel (each output's sum the same whatever the split): 22 M products at K3's 74 x 74.
    parallel_for(g.h, [&](int64_t y_begin, int64_t y_end) {
      std::vector<double> acc(static_cast<size_t>(H));
      for (int64_t y = y_begin; y < y_end; ++y) {
        const Taps ty = taps(y, table_h_, g.h);
        for (int64_t x = 0; x < g.w; ++x) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int a = 0; a < ty.count; ++a)
            for (int b = 0; b < cols[size_t(x)].count; ++b) {
              const double w = ty.weight[size_t(a)] * cols[size_t(x)].weight[size_t(b)];
              const float* src = table_.row(ty.index[size_t(a)] * table_w_ + cols[size_t(x)].index[size_t(b)]);
              for (int64_t c = 0; c < H; ++c) acc[size_t(c)] += w * double(src[c]);
            }
          float* dst = out.row(y * g.w + x);
          for (int64_t c = 0; c < H; ++c) dst[c] = float(acc[size_t(c)]);
        }
      }
    });
  }
  // Frames after the first: the first frame's rows plus the fixed time table (get_1d_sincos_pos_embed: sines of
  // f * 10000^(-i / (H/2)), then cosines), computed in float32 as numpy does.
  for (int64_t f = 1; f < g.t; ++f)
    for (int64_t r = 0; r < plane; ++r) {
      float* dst = out.row(f * plane + r);
      const float* first = out.row(r);
      for (int64_t c = 0; c < H; ++c) {
        const int64_t i = c % (H / 2);
        const float omega = 1.0f / std::pow(10000.0f, float(i) / (float(H) / 2.0f));
        const float angle = float(f) * omega;
        dst[c] = first[c] + (c < H / 2 ? std::sin(angle) : std::cos(angle));
      }
    }
  return out;
}

ImageAttention KimiK3VisionEncoder::rotation(const std::vector<VisionGrid>& grids) const {
  // Rope2DPosEmbRepeated: angle 2i = column * f_i, angle 2i + 1 = row * f_i, f_i = 10000^(-4i / head_dim); angle j
  // turns the pair (2j, 2j + 1) of each head (is_neox_style=False). The grid repeats per frame.
  const int64_t D = head_dim_, angles = D / 2;
  std::vector<double> freq(static_cast<size_t>(angles / 2));
  for (int64_t i = 0; i < angles / 2; ++i) freq[size_t(i)] = 1.0 / std::pow(10000.0, double(4 * i) / double(D));
  int64_t rows = 0;
  for (const VisionGrid& g : grids) rows += g.t * g.h * g.w;
  ImageAttention a{Tensor::empty({rows, angles}), Tensor::empty({rows, angles}), {}};
  int64_t row = 0;
  for (const VisionGrid& g : grids) {
    a.rows_per_image.push_back(g.t * g.h * g.w);
    for (int64_t local = 0; local < g.t * g.h * g.w; ++local, ++row) {
      const int64_t y = local % (g.h * g.w) / g.w, col = local % g.w;
      for (int64_t j = 0; j < angles; ++j) {
        const double angle = double(j % 2 == 0 ? col : y) * freq[size_t(j / 2)];
        a.cos.row(row)[j] = float(std::cos(angle)), a.sin.row(row)[j] = float(std::sin(angle));
      }
    }
  }
  a.cos = a.cos.to(device_), a.sin = a.sin.to(device_);
  return a;
}

Tensor KimiK3VisionEncoder::attend(const Tensor& x, const Layer& layer, const ImageAttention& a) const {
  Tensor q = apply(x, layer.q.w, layer.q.b), k = apply(x, layer.k.w, layer.k.b);
  const Tensor v = apply(x, layer.v.w, layer.v.b);
  ops::rotate_pairs_(q, a.cos, a.sin, head_dim_, /*interleaved=*/true);
  ops::rotate_pairs_(k, a.cos, a.sin, head_dim_, /*interleaved=*/true);
  return apply(attend_within_images(q, k, v, heads_, a.rows_per_image), layer.wo.w, layer.wo.b);
}

Tensor KimiK3VisionEncoder::project(const Tensor& merged) const {
  Tensor x = merged;
  if (projector_ == Projector::PatchMerger) {  // pre_norm on each of a window's rows, then the four side by side
    const int64_t windows = merged.dim(0);
    x = ops::layer_norm(merged.reshape({windows * merge_ * merge_, hidden_}), pre_norm_.w, pre_norm_.b, kLayerNormEps)
            .reshape({windows, merge_ * merge_ * hidden_});
  }
  Tensor mid = apply(x, linear_1_.w, linear_1_.b);
  ops::gelu_(mid);  // transformers' GELUActivation: the erf form
  Tensor out = apply(mid, linear_2_.w, linear_2_.b);
  return projector_ == Projector::PatchMergerV2 ? ops::rms_norm(out, post_norm_.w, projector_eps_) : out;
}

Tensor KimiK3VisionEncoder::embed(const Tensor& pixel_values, const std::vector<VisionGrid>& grids) const {
  SPARROW_CHECK(pixel_values.on_cpu() && pixel_values.type() == ScalarType::F32 && pixel_values.ndim() == 2 &&
                    pixel_values.dim(1) == patch_width(),
                "Kimi K3 vision encoder: patches must be fp32 [rows, ", patch_width(), "] on the host, got ",
                shape_str(pixel_values.shape()));
  int64_t rows = 0, windows = 0;
  for (const VisionGrid& g : grids) {
    SPARROW_CHECK(g.t > 0 && g.h > 0 && g.w > 0 && g.h % merge_ == 0 && g.w % merge_ == 0 && g.h <= 512 &&
                      g.w <= 512,
                  "Kimi K3 vision encoder: grid ", g.t, " x ", g.h, " x ", g.w, " is not a whole number of ", merge_,
                  "x", merge_, " windows within the rotary's 512 x 512 patches");
    SPARROW_CHECK(g.t <= table_t_, "Kimi K3 vision encoder: ", g.t, " frames, more than init_pos_emb_time ", table_t_);
    rows += g.t * g.h * g.w;
    windows += tokens(g);
  }
  SPARROW_CHECK(rows == pixel_values.dim(0), "Kimi K3 vision encoder: the grids hold ", rows, " patches, got ",
                pixel_values.dim(0), " rows");
  Tensor x = apply(pixel_values.to(device_, ops::act_type(device_)), patch_embed_.w, patch_embed_.b);
  int64_t first = 0;
  for (const VisionGrid& g : grids) {
    Tensor part = x.rows(first, first + g.t * g.h * g.w);
    ops::add_(part, positions(g).to(device_, ops::act_type(device_)));
    first += g.t * g.h * g.w;
  }
  const ImageAttention rotary = rotation(grids);
  for (const Layer& layer : layers_) {
    ops::add_(x, attend(norm(x, layer.norm0), layer, rotary));
    Tensor up = apply(norm(x, layer.norm1), layer.fc0.w, layer.fc0.b);
    ops::gelu_(up, tanh_gelu_);
    ops::add_(x, apply(up, layer.fc1.w, layer.fc1.b));
  }
  x = norm(x, final_norm_);
  // sd2_tpool: per image the mean over frames, then window (a, b)'s rows (2a + i, 2b + j), i and j in order, side
  // by side; windows row-major. Each frame's rows gathered in that order, summed over the frames, divided by t.
  const int64_t m = merge_;
  Tensor merged = Tensor::empty({windows * m * m, hidden_}, x.type(), x.device());
  int64_t done = 0;
  first = 0;
  for (const VisionGrid& g : grids) {
    Tensor image = merged.rows(done, done + tokens(g) * m * m);
    for (int64_t f = 0; f < g.t; ++f) {
      std::vector<int64_t> rows;
      for (int64_t a = 0; a < g.h / m; ++a)
        for (int64_t b = 0; b < g.w / m; ++b)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < m; ++j) rows.push_back(first + f * g.h * g.w + (a * m + i) * g.w + b * m + j);
      const Tensor frame = ops::select_rows(x, rows);
      if (f == 0) image.copy_from(frame);
      else ops::add_(image, frame);
    }
    if (g.t > 1) ops::scale_(image, 1.0f / float(g.t));
    done += tokens(g) * m * m;
    first += g.t * g.h * g.w;
  }
  merged = merged.reshape({windows, m * m * hidden_});
  return project(merged).to(Device::Cpu, ScalarType::F32);
}

std::unique_ptr<VisionEncoder> load_kimi_k3_vision(const std::string& dir, Device device, bool dummy) {
  const std::unique_ptr<Checkpoint> ckpt = dummy ? Checkpoint::open_dummy(dir) : Checkpoint::open(dir);
  if (!ckpt->config().has("vision_config") || !(dummy || ckpt->has("vision_tower.patch_embed.proj.weight")))
    return nullptr;
  return KimiK3VisionEncoder::load(*ckpt, device);
}

}  // namespace sparrow
