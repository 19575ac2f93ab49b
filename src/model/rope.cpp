#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace sparrow {

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

static double json_number(const nlohmann::json& j, const char* key, double def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  SPARROW_CHECK(j[key].is_number(), "config.json: rope_parameters.", key, " must be a number");
  return j[key].get<double>();
}

Rope Rope::from_config(const nlohmann::json& params, int rot_dim, int64_t max_position_embeddings) {
  SPARROW_CHECK(rot_dim > 0 && rot_dim % 2 == 0, "config.json: rotary dimension must be even and positive, got ",
                rot_dim);
  std::string type = "default";
  if (params.is_object()) {
    const char* key = params.contains("rope_type") ? "rope_type" : params.contains("type") ? "type" : nullptr;
    if (key) {
      SPARROW_CHECK(params[key].is_string(), "config.json: rope_parameters.", key, " must be a string");
      type = params[key].get<std::string>();
    }
  }
  const double theta = params.is_object() ? json_number(params, "rope_theta", 10000.0) : 10000.0;
  const int half = rot_dim / 2;
  Rope rope;
  rope.inv_freq.resize(half);
  // torch: base ** (arange(0, dim, 2).float() / dim), in fp32, then 1 / that.
  std::vector<float> pos_freqs(half);
  for (int i = 0; i < half; ++i)
    pos_freqs[i] = std::pow(float(theta), float(2 * i) / float(rot_dim));
  if (type == "default") {
    for (int i = 0; i < half; ++i) rope.inv_freq[i] = 1.0f / pos_freqs[i];
    return rope;
  }
  SPARROW_CHECK(type == "yarn", "config.json: unsupported rope_type '", type, "' (supported: default, yarn)");
  const double original = json_number(params, "original_max_position_embeddings", -1);
  SPARROW_CHECK(original > 0, "config.json: yarn rope needs rope_parameters.original_max_position_embeddings");
  double factor = json_number(params, "factor", double(max_position_embeddings) / original);
  double attention_factor = json_number(params, "attention_factor", -1);
  double mscale = json_number(params, "mscale", 0), mscale_all_dim = json_number(params, "mscale_all_dim", 0);
  if (attention_factor < 0) {
    if (mscale != 0 && mscale_all_dim != 0)
      attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim);
    else
      attention_factor = yarn_get_mscale(factor, 1.0);
  }
  double beta_fast = json_number(params, "beta_fast", 0), beta_slow = json_number(params, "beta_slow", 0);
  if (beta_fast == 0) beta_fast = 32;
  if (beta_slow == 0) beta_slow = 1;
  bool truncate = !(params.contains("truncate") && params["truncate"].is_boolean() && !params["truncate"].get<bool>());
  auto correction_dim = [&](double rotations) {
    return (rot_dim * std::log(original / (rotations * 2 * std::numbers::pi))) / (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(rot_dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    float ramp = std::clamp((float(i) - float(low)) / (float(high) - float(low)), 0.0f, 1.0f);
    float extrapolation_factor = 1.0f - ramp;
    float inv_extra = 1.0f / pos_freqs[i];
    float inv_inter = 1.0f / (float(factor) * pos_freqs[i]);
    rope.inv_freq[i] = inv_inter * (1.0f - extrapolation_factor) + inv_extra * extrapolation_factor;
  }
  rope.attention_scaling = float(attention_factor);
  return rope;
}

const Tensor& Rope::inv_freq_on(Device device) const {
  Tensor& cached = device == Device::Cpu ? inv_freq_cpu : inv_freq_cuda;
  if (!cached.defined() || cached.numel() != int64_t(inv_freq.size())) {
    Tensor host = Tensor::empty({int64_t(inv_freq.size())});
    std::copy(inv_freq.begin(), inv_freq.end(), host.data());
    cached = host.to(device);
  }
  return cached;
}

void Rope::angles(int64_t pos, float* cos, float* sin) const {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    float a = inv_freq[i] * float(pos);
    cos[i] = std::cos(a) * attention_scaling;
    sin[i] = std::sin(a) * attention_scaling;
  }
}

}  // namespace sparrow
