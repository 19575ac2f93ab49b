// Rotary position embeddings as transformers computes them (modeling_rope_utils.py, transformers 5.17):
// inverse frequencies from `rope_parameters` ("default" and "yarn"), angles pos * inv_freq in fp32,
// cos/sin scaled by the YaRN attention factor. Two pairings exist and models use both:
//   neox (rotate_half):  pairs (x[i], x[i + d/2])                 — Llama, the DSA indexer, MiniMax;
//   interleaved:         pairs (x[2i], x[2i+1]), written back as   — DeepSeek MLA
//                        [rotated evens..., rotated odds...] exactly like HF's apply_rotary_pos_emb_interleave
//                        (q and k get the same permutation, so q·k is the interleaved rotation's).
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "kernels/cpu/reference_ops.h"

namespace sparrow {

struct Rope {
  std::vector<float> inv_freq;  // rot_dim / 2 frequencies
  float attention_scaling = 1.0f;
  mutable Tensor inv_freq_cpu, inv_freq_cuda;  // caches of inv_freq_on

  int rot_dim() const { return int(inv_freq.size() * 2); }
  // cos[i], sin[i] for i < rot_dim/2 at position pos (already multiplied by attention_scaling).
  void angles(int64_t pos, float* cos, float* sin) const;
  // inv_freq as an fp32 tensor on `device` (for ops::rope_; made once per device).
  const Tensor& inv_freq_on(Device device) const;

  // `rope_parameters` as in config.json (rope_type default|yarn, rope_theta, factor, ...).
  // rot_dim is the number of rotated dims; max_position_embeddings is used by YaRN when factor is absent.
  static Rope from_config(const nlohmann::json& rope_parameters, int rot_dim, int64_t max_position_embeddings);
};

// The pairings themselves are CPU ops (kernels/cpu/reference_ops.h); the GPU has the same in kernels/cuda.
using cpu::apply_rope_interleaved;
using cpu::apply_rope_neox;

// YaRN's softmax-scale correction (DeepSeek's yarn_get_mscale): 0.1 * mscale * ln(scale) + 1 for scale > 1.
double yarn_get_mscale(double scale, double mscale);

}  // namespace sparrow
